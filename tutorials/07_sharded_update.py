"""Tutorial 7: one PPO update sharded over 2 processes with FSDP2, equal to the one-process update.
(modules: minirsi/core/distributed.py, minirsi/core/rpr.py)

Run:  python tutorials/07_sharded_update.py        (about 20 seconds on a laptop CPU)

At scale the actor and the critic do not fit on one GPU, so each of W ranks holds 1/W of every
parameter, gradient and Adam moment (FSDP2, ``torch.distributed.fsdp.fully_shard``), and the
ranks split the step's episodes. This script starts 2 CPU processes (the gloo backend, the same
code path as NCCL on GPUs) and shows, on a tiny random Qwen3 and 7 made-up episodes:

  1. what is sharded: each rank's slice of each weight matrix (DTensor shards, dim 0 split in two);
  2. what is all-reduced: the loss normaliser N (action tokens of the minibatch), summed over the
     ranks, and the metric sums; FSDP itself all-gathers each layer's weights for its forward and
     reduce-scatters its gradient (the average over ranks) straight after its backward;
  3. why the update equals the one-process one: rank r's loss is sum over its tokens / (N / W);
     the reduce-scatter averages the W gradients, so each rank's shard receives
     (1/W) sum_r grad(sum_{t in r} l_t) / (N / W) = grad(sum_t l_t) / N, the one-process gradient.
     A rank that divided by its own token count instead gets a different (wrong) update: shown too.
"""

import copy
import os
import random
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from minirsi.core import distributed  # noqa: E402
from minirsi.core.critic import build_critic  # noqa: E402
from minirsi.core.distributed import SINGLE, World, max_abs_diff  # noqa: E402
from minirsi.core.episode import minibatches, trimmed  # noqa: E402
from minirsi.core.episode import Episode  # noqa: E402
from minirsi.core.rpr import RPRConfig, make_optimizers, ppo_update, prepare_batch  # noqa: E402
from tiny import VOCAB, tiny_qwen  # noqa: E402


def episodes(n: int = 7) -> tuple[list[Episode], list[float]]:
    """A 5-token prompt, then 1-3 turns of a 3-6 token action and a 2-8 token observation."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        ids, mask, turns = [rng.randrange(1, VOCAB) for _ in range(5)], [0] * 5, [0] * 5
        k_max = rng.randint(1, 3)
        for k in range(k_max):
            a = rng.randint(3, 6)
            ids, mask, turns = ids + [rng.randrange(1, VOCAB) for _ in range(a)], mask + [1] * a, turns + [k] * a
            if k < k_max - 1:
                o = rng.randint(2, 8)
                ids, mask, turns = ids + [rng.randrange(1, VOCAB) for _ in range(o)], mask + [0] * o, turns + [k + 1] * o
        out.append(Episode(task_id="t", family="f", difficulty="easy", token_ids=ids,
                           logprobs=[-1.0 if m else None for m in mask], action_mask=mask, turn_ids=turns,
                           turns=k_max, success=False, passed=0, total=1))
    return out, [rng.random() for _ in out]


class LocalNormaliser(World):
    """The mistake this tutorial warns about: each rank divides by its own token count."""

    def normalizer(self, n_local: torch.Tensor) -> torch.Tensor:
        return n_local


def one_update(actor, critic, world, eps, rewards, cfg):
    batch = prepare_batch(actor, critic, eps, rewards, cfg, world=world)
    ppo_update(actor, critic, batch, cfg, make_optimizers(actor, critic, cfg), world=world)
    return world.full_state_dict(actor), world.full_state_dict(critic)


def worker(rank: int, world_size: int, port: int, results: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    world = distributed.init("cpu")  # gloo on the CPU
    cfg = RPRConfig(minibatch_size=4, grad_accum=2, ppo_epochs=2, lr_actor=1e-4, lr_critic=1e-4, seed=0)
    eps, rewards = episodes()
    actor = tiny_qwen(seed=0)
    critic = build_critic(actor, head_init_std=0.1)

    # The reference: one process, every rank computes it on its own unsharded copies.
    ref_actor, ref_critic = one_update(copy.deepcopy(actor), copy.deepcopy(critic), SINGLE, eps, rewards, cfg)

    # 1. What is sharded.
    a2, c2 = world.shard(copy.deepcopy(actor)), world.shard(copy.deepcopy(critic))
    q = a2.model.layers[0].self_attn.q_proj.weight
    held = sum(p.to_local().numel() for p in a2.parameters())
    assert q.to_local().shape[0] == q.shape[0] // world_size and held < sum(p.numel() for p in actor.parameters())
    line = (f"rank {rank}: q_proj.weight is a {type(q).__name__} of full shape {tuple(q.shape)}; this rank holds "
            f"rows {rank * q.shape[0] // world_size}-{(rank + 1) * q.shape[0] // world_size - 1}, local shape "
            f"{tuple(q.to_local().shape)}; {held:,} of the actor's {sum(p.numel() for p in actor.parameters()):,} "
            f"parameters (and as many gradients and Adam moments)")

    # 2. What is all-reduced: the first minibatch's N.
    b = prepare_batch(a2, c2, eps, rewards, cfg, world=world)
    gen = torch.Generator().manual_seed(cfg.seed)  # ppo_update draws its minibatches exactly so
    micro = next(minibatches(len(eps), cfg.minibatch_size, cfg.grad_accum, gen, b["attention_mask"].sum(1)))
    n_local = sum(int(world.local(trimmed(b, idx))["action_mask"].sum()) for idx in micro)
    n_all = torch.tensor(float(n_local))
    dist.all_reduce(n_all)
    assert 0 < n_local < int(n_all), "each rank holds some, not all, of the minibatch's action tokens"

    # 3. The sharded update, and the one with the wrong normaliser.
    s_actor, s_critic = one_update(a2, c2, world, eps, rewards, cfg)
    wrong = LocalNormaliser(rank=rank, size=world_size)
    w_actor, _ = one_update(wrong.shard(copy.deepcopy(actor)), wrong.shard(copy.deepcopy(critic)), wrong, eps,
                            rewards, cfg)
    lines = [None] * world_size
    dist.all_gather_object(lines, f"{line}\nrank {rank}: {n_local} of the N = {int(n_all)} action tokens "
                                  f"of the first minibatch are in its rows; it divides its loss by N / 2")
    if rank == 0:
        results["lines"] = lines
        results["moved"] = max_abs_diff(SINGLE.full_state_dict(actor), ref_actor)
        results["actor"] = max_abs_diff(ref_actor, s_actor)
        results["critic"] = max_abs_diff(ref_critic, s_critic)
        results["wrong"] = max_abs_diff(ref_actor, w_actor)
    distributed.shutdown()
    distributed.exit_rank(0)  # skip the interpreter's teardown (minirsi.core.distributed.exit_rank)


if __name__ == "__main__":
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(worker, args=(2, port, results), nprocs=2, join=True)
    for text in results["lines"]:
        print(text)
    print(f"\none PPO update (2 epochs of minibatches of up to 4 episodes, 2 micro-batches each) moved the actor by up to "
          f"{results['moved']:.1e}")
    print(f"sharded over 2 ranks vs one process: actor differs by {results['actor']:.1e}, critic by "
          f"{results['critic']:.1e} (float summation order; Adam turns noise on ~0 gradients into ~lr-sized steps)")
    print(f"with each rank dividing by its own token count instead of N / W: the actor differs by "
          f"{results['wrong']:.1e}")
    assert results["moved"] > 1e-5, "the update moved the actor by more than the sharding tolerance"
    assert results["actor"] <= 1e-5 and results["critic"] <= 1e-5, "the sharded update must equal the one-process one"
    assert results["wrong"] > 10 * max(results["actor"], 1e-7), "a per-rank normaliser gives another update"

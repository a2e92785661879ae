"""Benchmark: one PPO update (``rpr.prepare_batch`` + ``rpr.ppo_update``) on the same batch in one
process and sharded with FSDP2 over 2 gloo processes (minirsi/core/distributed.py), in one run.

    python bench/distributed.py                       # ~1-2 minutes on 2 CPU cores
    python bench/distributed.py --episodes 32 --hidden 256 --layers 4

Prints the best of ``--repeats`` update times for: 1 process x 1 thread, 1 process x 2 threads
(the same 2 cores used by threads) and 2 processes x 1 thread (the same cores used by data
parallelism, with FSDP's all-gathers and reduce-scatters), and their ratios. On a CPU the
collectives go through gloo over loopback, so the ratio says what the sharding costs on top of
the split compute, not what NCCL on a GPU node would; the model is a random Qwen3 built from a
config (``--hidden``, ``--layers``, ``--vocab``). The two results must agree: the script also
prints the largest parameter difference between the 1-process and the 2-process update.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minirsi.core import distributed  # noqa: E402
from minirsi.core.critic import build_critic  # noqa: E402
from minirsi.core.distributed import SINGLE, max_abs_diff  # noqa: E402
from minirsi.core.episode import Episode  # noqa: E402
from minirsi.core.rpr import RPRConfig, make_optimizers, ppo_update, prepare_batch  # noqa: E402


def build(args: argparse.Namespace):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=args.hidden // 4, max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    actor = Qwen3ForCausalLM(cfg)
    return actor, build_critic(actor, head_init_std=0.01)


def episodes(args: argparse.Namespace) -> tuple[list[Episode], list[float]]:
    """``--episodes`` episodes: a 32-token prompt, then 4 turns of a 24-token action and a
    40-token observation (the last turn ends on its action)."""
    rng = random.Random(0)
    out = []
    for _ in range(args.episodes):
        ids, mask, turns = [rng.randrange(args.vocab) for _ in range(32)], [0] * 32, [0] * 32
        for k in range(4):
            ids, mask, turns = ids + [rng.randrange(args.vocab) for _ in range(24)], mask + [1] * 24, turns + [k] * 24
            if k < 3:
                ids, mask, turns = ids + [rng.randrange(args.vocab) for _ in range(40)], mask + [0] * 40, turns + [k + 1] * 40
        out.append(Episode(task_id="b", family="f", difficulty="easy", token_ids=ids,
                           logprobs=[-1.0 if m else None for m in mask], action_mask=mask, turn_ids=turns, turns=4,
                           success=False, passed=0, total=1))
    return out, [rng.random() for _ in out]


def timed_updates(world: distributed.World, args: argparse.Namespace) -> tuple[float, dict]:
    """Best time of ``args.repeats`` updates (each from the same starting weights), and the weights after one."""
    actor0, critic0 = build(args)
    eps, rewards = episodes(args)
    cfg = RPRConfig(minibatch_size=args.minibatch, grad_accum=args.grad_accum, ppo_epochs=1, lr_actor=1e-4,
                    lr_critic=1e-4, seed=0, forward_chunk=args.minibatch)
    best, state = float("inf"), {}
    for _ in range(args.repeats + 1):  # the first is a warm-up (allocator, thread pools)
        actor, critic = world.shard(copy.deepcopy(actor0), keep_unsharded=False), world.shard(copy.deepcopy(critic0), keep_unsharded=False)
        optimizers = make_optimizers(actor, critic, cfg)
        world.barrier()
        t0 = time.perf_counter()
        batch = prepare_batch(actor, critic, eps, rewards, cfg, world=world)
        ppo_update(actor, critic, batch, cfg, optimizers, world=world)
        world.barrier()
        best = min(best, time.perf_counter() - t0) if state else best
        state = world.full_state_dict(actor)
    return best, state


def worker(rank: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    world = distributed.init("cpu")
    seconds, state = timed_updates(world, args)
    if world.is_main:
        out["seconds"], out["state"] = seconds, state
    distributed.shutdown()
    distributed.exit_rank(0)  # skip the interpreter's teardown (minirsi.core.distributed.exit_rank)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--minibatch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    tokens = sum(len(e.token_ids) for e in episodes(args)[0])
    print(f"batch: {args.episodes} episodes, {tokens} tokens; model hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}; minibatch {args.minibatch}, grad_accum {args.grad_accum}")
    torch.set_num_threads(1)
    t1, s1 = timed_updates(SINGLE, args)
    torch.set_num_threads(2)
    t1x2, _ = timed_updates(SINGLE, args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(worker, args=(port, args, out), nprocs=2, join=True)
    t2 = out["seconds"]
    print(f"1 process  x 1 thread : {t1:6.2f} s  ({tokens / t1:7.0f} tokens/s)")
    print(f"1 process  x 2 threads: {t1x2:6.2f} s  ({tokens / t1x2:7.0f} tokens/s)")
    print(f"2 processes x 1 thread: {t2:6.2f} s  ({tokens / t2:7.0f} tokens/s)")
    print(f"ratio 2-process / 1-process (1 thread): {t2 / t1:.2f};  2-process / 1-process x 2 threads: {t2 / t1x2:.2f}")
    print(f"largest parameter difference, 2-process vs 1-process update: {max_abs_diff(s1, out['state']):.1e}")


if __name__ == "__main__":
    main()

"""Run under ``torchrun --nproc_per_node 2 tests/dist_equal.py OUT.json [--lora]`` (tests/test_distributed.py
does): one PPO update, one RSR SFT step and one critic warm-up update, each sharded with FSDP2
over the ranks and, on the same episodes, in one process; rank 0 writes the largest parameter
difference of each to OUT.json. Then a 2-process checkpoint is saved and reloaded in 2 processes.
Not a pytest module (its name does not start with test_): it needs a process group."""

from __future__ import annotations

import copy
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from minirsi.core import distributed  # noqa: E402
from minirsi.core.critic import WarmupConfig, build_critic, warmup_critic  # noqa: E402
from minirsi.core.distributed import SINGLE, max_abs_diff  # noqa: E402
from minirsi.core.rpr import RPRConfig, make_optimizers, ppo_update, prepare_batch  # noqa: E402
from minirsi.core.rsr import RSRConfig, make_optimizer, sft  # noqa: E402
from test_rpr import synthetic_episode  # noqa: E402
from tiny import tiny_qwen  # noqa: E402


LR = float(next((a.split("=")[1] for a in sys.argv if a.startswith("--lr=")), "1e-4"))
"""Learning rate of every update. Adam moves a parameter whose gradient is ~0 by up to lr on
the sign of float noise, so the tolerance is relative to it: 1e-4 is a move of ~4e-4 here."""


def models(lora: bool):
    actor = tiny_qwen(seed=0)
    critic = build_critic(actor, head_init_std=0.1)  # a non-zero head: the backbone gets gradients at once
    if lora:
        from minirsi.engine.models import LoraSettings, attach_lora

        torch.manual_seed(1)
        actor = attach_lora(actor, LoraSettings(r=4, alpha=8))
        for name, p in actor.named_parameters():  # B starts at 0 in peft: give it values so A moves too
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    return actor, critic


def main() -> None:
    out, lora = Path(sys.argv[1]), "--lora" in sys.argv
    world = distributed.init("cpu")
    rng = random.Random(0)
    # 7 episodes, minibatches of 4 in 2 micro-batches: the last minibatch (3) has a 1-row
    # micro-batch, so rank 1 runs a stand-in row there.
    episodes = [synthetic_episode(rng, rng.randint(1, 3)) for _ in range(7)]
    rewards = [rng.random() for _ in episodes]
    cfg = RPRConfig(minibatch_size=4, grad_accum=2, ppo_epochs=2, lr_actor=LR, lr_critic=LR,
                    entropy_coef=0.01, kl_coef=0.1 if lora else 0.0, seed=0, forward_chunk=3)
    result: dict[str, float] = {"world_size": world.size}

    # -- PPO: one process ---------------------------------------------------------------------
    actor, critic = models(lora)
    a1, c1 = copy.deepcopy(actor), copy.deepcopy(critic)
    ref1 = None if lora else copy.deepcopy(actor).eval()
    batch = prepare_batch(a1, c1, episodes, rewards, cfg, ref_model=ref1)
    opt1 = make_optimizers(a1, c1, cfg)
    m1 = ppo_update(a1, c1, batch, cfg, opt1, ref1)
    # -- PPO: sharded --------------------------------------------------------------------------
    a2, c2 = world.shard(copy.deepcopy(actor)), world.shard(copy.deepcopy(critic))
    batch2 = prepare_batch(a2, c2, episodes, rewards, cfg, world=world)
    m2 = ppo_update(a2, c2, batch2, cfg, make_optimizers(a2, c2, cfg), world=world)
    s_a, s_c = world.full_state_dict(a2), world.full_state_dict(c2)
    if world.is_main:
        result["ppo_actor"] = max_abs_diff(SINGLE.full_state_dict(a1), s_a)
        result["ppo_critic"] = max_abs_diff(SINGLE.full_state_dict(c1), s_c)
        result["ppo_actor_moved"] = max_abs_diff(SINGLE.full_state_dict(actor), s_a)
        act = batch["action_mask"].bool()  # padding positions hold whatever each pass's width gave
        result["ppo_old_logprobs"] = float((batch["old_logprobs"] - batch2["old_logprobs"])[act].abs().max())
        result["ppo_old_values"] = float((batch["old_values"] - batch2["old_values"])[act].abs().max())
        result["ppo_metrics"] = max(abs(m1[k] - m2[k]) for k in ("policy_loss", "value_loss", "entropy",
                                                                  "approx_kl", "clip_frac", "kl_ref"))

    # -- a one-process optimizer.pt (index-keyed) loaded into sharded optimizers, gathered back by name
    a3 = world.shard(copy.deepcopy(a1), keep_unsharded=False)
    opt3 = make_optimizers(a3, world.shard(copy.deepcopy(c1), keep_unsharded=False), cfg)
    world.load_optimizer_state(a3, opt3.actor, opt1.actor.state_dict())
    back = world.optimizer_state(a3, opt3.actor)
    if world.is_main:
        names = [n for n, p in a1.named_parameters() if p.requires_grad]
        one = opt1.actor.state_dict()["state"]
        result["optimizer_reload"] = max(float((one[i][k] - back["state"][n][k]).abs().max())
                                         for i, n in enumerate(names) for k in ("exp_avg", "exp_avg_sq"))

    # -- RSR SFT step ---------------------------------------------------------------------------
    examples = [(e.token_ids, e.action_mask) for e in episodes]
    scfg = RSRConfig(epochs=1, batch_size=5, lr=LR, seed=0)  # 5 + 2: a 2-row batch too
    s1 = copy.deepcopy(actor)
    l1 = sft(s1, examples, scfg, pad_id=0, optimizer=make_optimizer(s1, scfg))
    s2 = world.shard(copy.deepcopy(actor))
    l2 = sft(s2, examples, scfg, pad_id=0, optimizer=make_optimizer(s2, scfg), world=world)
    s_s = world.full_state_dict(s2)
    if world.is_main:
        result["sft_actor"] = max_abs_diff(SINGLE.full_state_dict(s1), s_s)
        result["sft_loss"] = max(abs(x - y) for x, y in zip(l1, l2))

    # -- critic warm-up update -----------------------------------------------------------------
    wcfg = WarmupConfig(epochs=2, minibatch_size=4, grad_accum=2, value_clip=0.2, lr_critic=LR, gamma_turn=1.0,
                        lam_turn=0.95, seed=0)
    w1 = copy.deepcopy(critic)
    ev1 = warmup_critic(w1, episodes, rewards, wcfg)
    w2 = world.shard(copy.deepcopy(critic))
    ev2 = warmup_critic(w2, episodes, rewards, wcfg, world=world)
    s_w = world.full_state_dict(w2)
    if world.is_main:
        result["warmup_critic"] = max_abs_diff(SINGLE.full_state_dict(w1), s_w)
        result["warmup_ev"] = max(abs(x - y) for x, y in zip(ev1, ev2))

    # -- a 2-process checkpoint, reloaded in 2 processes ---------------------------------------
    if not lora:
        from transformers import AutoModelForCausalLM

        ckpt = out.with_suffix(".ckpt")
        world.save(a2, lambda plain: plain.save_pretrained(ckpt))
        back = world.shard(AutoModelForCausalLM.from_pretrained(ckpt))
        s_back = world.full_state_dict(back)
        if world.is_main:
            result["reload_2proc"] = max_abs_diff(s_a, {k: v for k, v in s_back.items() if k in s_a})
            torch.save(s_a, out.with_suffix(".state.pt"))  # for the 1-process reload in the test

    if world.is_main:
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
    distributed.shutdown()
    distributed.exit_rank(0)  # skip the interpreter's teardown (minirsi.core.distributed.exit_rank)


if __name__ == "__main__":
    main()

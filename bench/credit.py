"""The critic and credit-assignment rungs of the probe ladder, over seeds: steps to P >= 0.9.

Runs ``minirsi.run.probes.bandit`` (the real path: HFSampler -> prepare_batch -> TB-GAE ->
ppo_update) on the tiny random Qwen3 of the unit tests, for each named variant and seed, and
prints the joint step at which P(rewarded) first reached ``--target`` ("-" = never within
``--steps``) and the final P; ``--json`` keeps every curve. tests/test_learning.py asserts what
these runs showed at every seed; the README's probe-ladder table quotes them (seeds 0-7: about
25 min on a quiet 2-core machine for all seven variants). key=value arguments override RPRConfig
fields (``lr_critic=1e-2 value_clip=0``).

Variants (each the same run but for the one thing named):

  offset-critic     rewards 10 / 11, a fresh critic (the test's)
  offset-zero       rewards 10 / 11, V = 0 (probes.ZeroCritic)
  offset-inherited  rewards 10 / 11, the critic warmed up first (critic.warmup_critic)
  credit-tb         turn-0 decision, 4 turns of 4 observation + 8 action tokens, TB-GAE
  credit-token      the same, per-token GAE (RPRConfig.advantage="token_gae")
  credit-inherited  the same as credit-tb with the critic warmed up first
  credit-zero       the same as credit-tb with V = 0

    PYTHONPATH=. python bench/credit.py --seeds 0-7 offset-critic offset-zero offset-inherited
    PYTHONPATH=. python bench/credit.py --seeds 0-7 --steps 80 credit-tb credit-token credit-inherited
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny import tiny_qwen  # noqa: E402  (the unit tests' model)

from minirsi.core.critic import WarmupConfig, build_critic  # noqa: E402
from minirsi.core.rpr import RPRConfig  # noqa: E402
from minirsi.run.probes import ZeroCritic, bandit, steps_to, warm_up_on_bandit  # noqa: E402

OFFSET = dict(reward_values=(10.0, 11.0))
CREDIT = dict(obs_len=4, later_turns=4, later_tokens=8)
VARIANTS = {
    "offset-critic": (OFFSET, "tb_gae", "fresh"),
    "offset-zero": (OFFSET, "tb_gae", "zero"),
    "offset-inherited": (OFFSET, "tb_gae", "inherited"),
    "credit-tb": (CREDIT, "tb_gae", "fresh"),
    "credit-token": (CREDIT, "token_gae", "fresh"),
    "credit-inherited": (CREDIT, "tb_gae", "inherited"),
    "credit-zero": (CREDIT, "tb_gae", "zero"),
}


def rpr_config(seed: int, advantage: str = "tb_gae", **overrides) -> RPRConfig:
    """The probes' PPO settings, rungs 1 and 2's (tests/test_learning.py): lr 1e-3 for actor and
    critic, RPRConfig's defaults otherwise (value clip 0.2); ``overrides`` replace fields."""
    kw = dict(lr_actor=1e-3, lr_critic=1e-3, gamma_turn=1.0, lam_turn=0.95, seed=seed, advantage=advantage)
    return RPRConfig(**(kw | overrides))


def run(variant: str, seed: int, steps: int, target: float, warmup_episodes: int, **overrides) -> dict:
    layout, advantage, critic_kind = VARIANTS[variant]
    torch.set_num_threads(1)
    actor = tiny_qwen(seed=seed)
    if critic_kind == "zero":
        critic = ZeroCritic()
    else:
        critic = build_critic(actor)
    cfg = rpr_config(seed, advantage, **overrides)
    if critic_kind == "inherited":
        # One epoch over the frozen actor's rollouts (32 AdamW updates at lr 1e-2: enough for the
        # critic to reach V ~ 10 on the offset bandit; at 1e-3 it reaches ~2), on the returns of
        # the RPR config it precedes.
        warm = WarmupConfig(lr_critic=1e-2, gamma_turn=cfg.gamma_turn, lam_turn=cfg.lam_turn, seed=seed)
        warm_up_on_bandit(actor, critic, warm, n=warmup_episodes, seed=10_000 + seed, **layout)
    t0 = time.perf_counter()
    curve = bandit(actor, critic, cfg, steps=steps, episodes_per_step=64, calibration=3, seed=seed, **layout)
    return {"variant": variant, "seed": seed, "steps_to": steps_to(curve, target), "final": curve[-1],
            "start": curve[0], "seconds": time.perf_counter() - t0, "curve": curve}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+", help=f"{', '.join(VARIANTS)}; key=value overrides RPRConfig")
    ap.add_argument("--seeds", default="0-4", help="e.g. 0-4 or 0,3,7")
    ap.add_argument("--steps", type=int, default=40, help="joint PPO steps per run")
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--warmup-episodes", type=int, default=256)
    ap.add_argument("--json", type=Path, help="append one JSON line per run here")
    args = ap.parse_args(argv)
    overrides = {}
    for item in [v for v in args.variants if "=" in v]:  # RPRConfig overrides, e.g. lr_critic=1e-3
        key, _, value = item.partition("=")
        overrides[key] = type(getattr(RPRConfig(), key))(value)
    args.variants = [v for v in args.variants if "=" not in v]
    for v in args.variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; use one of {', '.join(VARIANTS)}")
    if "-" in args.seeds:
        lo, hi = (int(x) for x in args.seeds.split("-"))
        seeds = list(range(lo, hi + 1))
    else:
        seeds = [int(x) for x in args.seeds.split(",")]
    for variant in args.variants:
        results = []
        for seed in seeds:
            r = run(variant, seed, args.steps, args.target, args.warmup_episodes, **overrides)
            results.append(r)
            print(f"{variant:17s} seed {seed}: P {r['start']:.3f} -> {r['final']:.3f}, steps to {args.target}: "
                  f"{'-' if r['steps_to'] is None else r['steps_to']}  ({r['seconds']:.1f} s)", flush=True)
            if args.json:
                with args.json.open("a") as f:
                    f.write(json.dumps(r | {"overrides": overrides}) + "\n")
        reached = [r["steps_to"] for r in results if r["steps_to"] is not None]
        print(f"{variant}: reached {len(reached)}/{len(results)}; steps {sorted(reached)}; final "
              f"{[round(r['final'], 3) for r in results]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

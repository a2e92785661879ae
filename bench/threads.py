"""Benchmark: torch's thread count for the training steps and for the rollouts (toy-cpu's
``threads: 2`` and ``rollout.threads: 1``).

Two measurements, in this one run, each with 1 and then 2 intra-op threads:

1. ``update``: RPR's update (``prepare_batch`` + ``ppo_update``) on ``--episodes`` synthetic
   episodes laid out like the default run's (bench/rpr.py's ``synthetic_episodes``), twice,
   from the same actor, critic and optimizer states. Prints each thread count's seconds, the
   ratio, and whether the two runs' updated weights are bit-identical (a reduction split across
   threads may sum in another order; the smoke preset's checkpoints did not change, README).
2. ``rollout``: ``collect`` of ``--rollout-episodes`` episodes of toy training tasks in real
   sandboxes (bwrap), the same seeds. Prints the seconds, the ratio and whether the episodes'
   token ids are the same. During a rollout the sandboxes and verifiers need a core, so a
   second torch thread competes with them.

Run on a quiet machine (the ratios are the point, not the seconds)::

    python bench/threads.py --model minirsi/presets/toy-base
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import tempfile
import time

import torch

from minirsi.core.critic import build_critic, fingerprint
from minirsi.core.episode import pad_id_of
from minirsi.core.rpr import RPRConfig, make_optimizers, ppo_update, prepare_batch
from minirsi.engine.models import torch_threads
from minirsi.engine.rollout import RolloutConfig, collect
from minirsi.engine.sampler import HFSampler
from model_under_test import load_model, toy_tasks  # bench/model_under_test.py: this script's folder is on sys.path
from rpr import synthetic_episodes


def timed_update(actor, critic, eps, cfg: RPRConfig, pad_id: int, threads: int) -> tuple[float, str]:
    """Two updates of copies of ``actor`` and ``critic`` on ``threads`` threads: (seconds, weights' hash)."""
    actor, critic = copy.deepcopy(actor), copy.deepcopy(critic)
    optimizers = make_optimizers(actor, critic, cfg)
    rewards = [float(e.success) for e in eps]
    with torch_threads(threads):
        t0 = time.perf_counter()
        for _ in range(2):
            batch = prepare_batch(actor, critic, eps, rewards, cfg, pad_id=pad_id)
            ppo_update(actor, critic, batch, cfg, optimizers)
        return time.perf_counter() - t0, f"{fingerprint(actor)[:8]}/{fingerprint(critic)[:8]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: random tiny model)")
    p.add_argument("--episodes", type=int, default=24, help="episodes per update batch")
    p.add_argument("--prompt", type=int, default=250)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--action", type=int, default=25)
    p.add_argument("--obs", type=int, default=60)
    p.add_argument("--rollout-episodes", type=int, default=64)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as d:
        tasks = toy_tasks(d, args.rollout_episodes, seed=1)
        actor, tok = load_model(args.model, tasks)
        torch.manual_seed(0)
        critic = build_critic(actor)

        # 1. the update
        cfg = RPRConfig(minibatch_size=8, ppo_epochs=2, episodes_per_step=args.episodes, steps=1,
                        critic_calibration_updates=0, lr_actor=3e-4, lr_critic=1e-3, reward="fdr", gamma_turn=0.9,
                        seed=0)
        eps = synthetic_episodes(args.episodes, len(tok), args.prompt, args.turns, args.action, args.obs)
        timed_update(actor, critic, eps[:4], cfg, pad_id_of(tok), 1)  # warm-up: first-call allocations
        update = {n: timed_update(actor, critic, eps, cfg, pad_id_of(tok), n) for n in (1, 2)}

        # 2. the rollout
        rcfg = RolloutConfig(concurrency=32, max_turns=10, max_new_tokens=64, temperature=1.0,
                             max_context_tokens=4096, seed=0)
        sampler = HFSampler(actor, tok)
        collect(tasks[:4], sampler, tok, rcfg, progress=False)  # warm-up
        rollout = {}
        for n in (1, 2):
            t0 = time.perf_counter()
            got = collect(tasks, sampler, tok, dataclasses.replace(rcfg, threads=n), progress=False)
            rollout[n] = (time.perf_counter() - t0, [e.token_ids for e in got])

    n_act = sum(sum(e.action_mask) for e in eps)
    print(f"model: {args.model or 'random tiny model'}; {os.cpu_count()} CPUs")
    print(f"update: 2 x (prepare_batch + ppo_update), {args.episodes} episodes, {n_act} action tokens, "
          f"2 PPO epochs, minibatch 8")
    for n, (s, h) in update.items():
        print(f"  {n} thread(s): {s:7.2f} s  weights {h}")
    print(f"  1 -> 2 threads: {update[1][0] / update[2][0]:.2f}x faster; weights "
          f"{'bit-identical' if update[1][1] == update[2][1] else 'DIFFERENT'}")
    print(f"rollout: {args.rollout_episodes} toy training episodes, concurrency 32, bwrap")
    for n, (s, _) in rollout.items():
        print(f"  {n} thread(s): {s:7.2f} s")
    print(f"  1 -> 2 threads: {rollout[1][0] / rollout[2][0]:.2f}x faster; episodes "
          f"{'identical' if rollout[1][1] == rollout[2][1] else 'DIFFERENT'}")


if __name__ == "__main__":
    main()

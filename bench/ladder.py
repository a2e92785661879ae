"""The probe ladder on the toy shell tasks: does RPR raise a training pool's success?

Rungs 1-2 (the bandits) are unit tests (tests/test_learning.py). This bench runs the rungs
above them with the recipe's own code, ``critic.warmup_critic`` then ``rpr.run_rpr``, on a pool
of toy tasks that grows rung by rung: one task sampled many times, a small pool, a larger
pool, the whole training pool. Where a rung fails, the fault lies between it and the rung below.

It prints the pool's success (S) per RPR step and the change from the calibration steps (the
frozen actor) to the last ``--tail`` joint steps, and writes ``ladder.json`` and a plot.

    python bench/ladder.py --actor RUN/01-rsr1/actor --tasks RUN/tasks/train --pool 4 --out /tmp/l4
    python bench/ladder.py ... --select 0.2:0.5 --measure 8   # tasks the actor solves 20-50% of the time
    python bench/ladder.py ... rpr1.lr_actor=5e-4 rpr1.steps=16  # toy-cpu preset overrides
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from minirsi.config import load_config
from minirsi.core.critic import build_critic, warmup_critic
from minirsi.core.rpr import run_rpr, score
from minirsi.core.rsr import sample_tasks
from minirsi.engine.models import load_actor
from minirsi.engine.rollout import make_rollout_fn
from minirsi.run.evaluate import load_suite
from minirsi.run.config import RunConfig, resolve_preset
from minirsi.run.stages import calibrate_scales


def pick_pool(tasks: list, args: argparse.Namespace, rollout_fn, actor) -> tuple[list, dict[str, float]]:
    """The first ``--pool`` tasks (``--select all``), the first easy task of each family
    (``--select first-easy``), or the tasks whose measured
    success over ``--measure`` samples lies in ``--select LO:HI``."""
    if args.select == "all":
        return tasks[: args.pool], {}
    if args.select.startswith("ids="):
        ids = args.select[4:].split(",")
        return [t for t in tasks if t.task_id in ids], {}
    if args.select == "first-easy":
        seen, pool = set(), []
        for t in tasks:
            if t.difficulty == "easy" and t.family not in seen:
                seen.add(t.family)
                pool.append(t)
        return pool[: args.pool], {}
    lo, hi = (float(x) for x in args.select.split(":"))
    eps = rollout_fn(actor, [t for t in tasks for _ in range(args.measure)], 12345)
    rate: dict[str, float] = {}
    for t in tasks:
        mine = [e.success for e in eps if e.task_id == t.task_id]
        rate[t.task_id] = sum(mine) / max(len(mine), 1)
    pool = [t for t in tasks if lo <= rate[t.task_id] <= hi][: args.pool]
    return pool, {t.task_id: rate[t.task_id] for t in pool}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actor", required=True, help="actor checkpoint (e.g. a run's 01-rsr1/actor)")
    ap.add_argument("--tasks", required=True, help="a folder of tasks (e.g. a run's tasks/train)")
    ap.add_argument("--pool", type=int, default=4, help="tasks in the pool")
    ap.add_argument("--select", default="first-easy", help="first-easy, all (the first --pool tasks), ids=ID,ID..., or LO:HI measured success")
    ap.add_argument("--measure", type=int, default=8, help="samples per task to measure success (LO:HI)")
    ap.add_argument("--preset", default="toy-cpu", help="preset whose rollout / warmup / rpr1 settings apply")
    ap.add_argument("--tail", type=int, default=4, help="joint steps averaged at the end")
    ap.add_argument("--final", type=int, default=4,
                    help="samples per pool task measured before and after RPR (same seeds; 0: off)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="", help="folder for ladder.json and ladder.png")
    ap.add_argument("overrides", nargs="*", help="preset overrides, e.g. rpr1.lr_actor=5e-4")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(RunConfig, resolve_preset(args.preset), args.overrides)
    root = Path(args.tasks)
    tasks = load_suite(root)
    actor, tok = load_actor(args.actor)
    rollout_fn = make_rollout_fn(tok, cfg.rollout, progress=False)
    pool, measured = pick_pool(tasks, args, rollout_fn, actor)
    if not pool:
        print(f"no task of {root} matches --select {args.select}", file=sys.stderr)
        return 1
    scales = calibrate_scales(tasks, cfg)
    print(f"pool ({len(pool)}): {[t.task_id for t in pool]} {measured or ''}", flush=True)

    def measure(seed: int) -> dict[str, float]:
        """Every pool task ``--final`` times: success per task, the same count for each."""
        eps = rollout_fn(actor, [t for t in pool for _ in range(args.final)], seed)
        return {t.task_id: sum(e.success for e in eps if e.task_id == t.task_id) / args.final for t in pool}

    t0 = time.time()
    actor.eval().requires_grad_(False)
    before = measure(4242) if args.final else {}
    # the recipe's warm-up: warmup.tasks of the pool (seeded), at least 32 episodes on a small pool
    warm_pool = sample_tasks(pool, cfg.warmup.tasks, 777)
    warm_eps = rollout_fn(actor, [t for t in warm_pool for _ in range(max(cfg.warmup.samples_per_task, 32 // len(warm_pool)))], 777)
    critic = build_critic(actor)
    evs = warmup_critic(critic, warm_eps, score(warm_eps, cfg.warmup.reward, scales), 
                         dataclasses.replace(cfg.warmup, gamma_turn=cfg.rpr1.gamma_turn, lam_turn=cfg.rpr1.lam_turn))
    actor.requires_grad_(True)
    print(f"warm-up: {len(warm_eps)} episodes, S {sum(e.success for e in warm_eps) / len(warm_eps):.2f}, "
          f"EV {evs[0]:.2f} -> {evs[-1]:.2f}", flush=True)
    rcfg = dataclasses.replace(cfg.rpr1, seed=cfg.seed)
    per_task: dict[str, list[list[int]]] = {t.task_id: [] for t in pool}  # per step: successes of the task

    # RPR samples at its own temperature, as the recipe's stage does (the trainer scores with it)
    rpr_rollout_fn = make_rollout_fn(tok, dataclasses.replace(cfg.rollout, temperature=rcfg.temperature), progress=False)

    def counted(model, tasks_, seed):
        eps = rpr_rollout_fn(model, tasks_, seed)
        for tid in per_task:
            per_task[tid].append([int(e.success) for e in eps if e.task_id == tid])
        return eps

    history = run_rpr(actor, critic, tok, pool, rcfg, counted, scales,
                      log_fn=lambda r: print(f"  step {r['step']:2d} {r['phase']:9s} S {r['binary_reward']:.2f} "
                                             f"pool {r['pool_success']:.2f} trained {r.get('trained_episodes', '-')} "
                                             f"FDR {r['dense_reward']:.2f} EV {r['explained_variance']:+.2f} "
                                             f"KL {r.get('approx_kl', 0.0):.3f} clip {r.get('clip_frac', 0.0):.2f} "
                                             f"turns {r['turns']:.1f}", flush=True))
    # pool_success: what a uniform draw of the pool would measure (EdgeStream.pool_success under edge sampling)
    calib = [h["pool_success"] for h in history if h["phase"] == "calibrate"] or [history[0]["pool_success"]]
    joint = [h["pool_success"] for h in history if h["phase"] == "joint"]
    start, end = sum(calib) / len(calib), sum(joint[-args.tail:]) / len(joint[-args.tail:])
    print(f"pool success: {start:.2f} (calibration, frozen actor) -> {end:.2f} (last {args.tail} joint steps): "
          f"{100 * (end - start):+.1f} points in {time.time() - t0:.0f} s")
    after = measure(4242) if args.final else {}
    if args.final:
        b, a = sum(before.values()) / len(pool), sum(after.values()) / len(pool)
        print(f"pool success measured with {args.final} samples a task: {b:.2f} before -> {a:.2f} after: "
              f"{100 * (a - b):+.1f} points")
    for tid, steps in per_task.items():
        first, last = [x for s in steps[: rcfg.critic_calibration_updates] for x in s], [x for s in steps[-args.tail:] for x in s]
        print(f"  {tid:32s} {sum(first) / max(len(first), 1):.2f} -> {sum(last) / max(len(last), 1):.2f}"
              + (f"   measured {before[tid]:.2f} -> {after[tid]:.2f}" if args.final else ""))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ladder.json").write_text(json.dumps({"pool": [t.task_id for t in pool], "start": start,
                                                     "end": end, "before": before, "after": after, "history": history,
                                                     "per_task": per_task}, indent=1) + "\n")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([h["step"] for h in history], [h["binary_reward"] for h in history], marker="o")
        ax.axvline(rcfg.critic_calibration_updates - 0.5, color="grey", ls=":", label="joint updates start")
        ax.set(xlabel="RPR step", ylabel="pool success S", title=f"RPR on a pool of {len(pool)} toy tasks",
               ylim=(0, 1))
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ladder.png", dpi=110)
        print(f"wrote {out / 'ladder.json'} and {out / 'ladder.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

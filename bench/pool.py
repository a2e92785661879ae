"""Did a stage move its training pool? Two of a run's actors on the run's training tasks, paired.

A stage's curve in ``minirsi report`` (``pool_success``) estimates the pool's success from each
step's 64 drawn episodes, each drawn bucket weighed by its share of the pool: a step's figure
spreads by 4-10 points, so a stage's rise of a few points can hide in it. This measures the stage directly: every
task of ``RUN/tasks/train`` ``--samples`` times with the actor a stage started from and the one it
ended with, the same sampling seeds for both (common random numbers), and their difference with
its standard error over tasks (``minirsi.run.evaluate.paired``), overall and by difficulty. The
rollout settings are the run's (``RUN/config.yaml``, ``rollout``).

    python bench/pool.py RUN --before 04-rsr2 --after 05-rpr2
    python bench/pool.py RUN --before 01-rsr1 --after 03-rpr1 --samples 2 --out /tmp/p
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

from minirsi.config import load_config
from minirsi.engine.models import load_actor
from minirsi.engine.rollout import make_rollout_fn
from minirsi.run.config import RunConfig
from minirsi.run.evaluate import load_suite, paired_by
from minirsi.run.report import difficulty_order


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a run directory (minirsi run --out RUN)")
    ap.add_argument("--before", required=True, help="the stage the actor comes from, e.g. 04-rsr2")
    ap.add_argument("--after", required=True, help="the stage that trained it, e.g. 05-rpr2")
    ap.add_argument("--samples", type=int, default=1, help="episodes per task and actor")
    ap.add_argument("--seed", type=int, default=4242, help="the sampling seed both actors share")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="", help="folder for pool.json (per-task successes of both)")
    args = ap.parse_args()
    run = Path(args.run)
    actors = {name: run / "stages" / name / "actor" for name in (args.before, args.after)}
    missing = [str(p) for p in actors.values() if not (p / "config.json").is_file()]
    if missing or not (run / "config.yaml").is_file():
        print(f"{run}: no run config or no actor at {', '.join(missing) or '-'}; name two finished stages "
              f"of {run / 'stages'}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    cfg = load_config(RunConfig, run / "config.yaml", [])
    tasks = load_suite(run / "tasks" / "train")
    difficulty = {t.task_id: t.difficulty for t in tasks}
    episodes = {}
    for name, path in actors.items():
        t0 = time.time()
        actor, tok = load_actor(path)
        actor.eval()
        episodes[name] = make_rollout_fn(tok, cfg.rollout, progress=False)(
            actor, [t for t in tasks for _ in range(args.samples)], args.seed)
        s = sum(e.success for e in episodes[name]) / len(episodes[name])
        print(f"{name}: {100 * s:.1f}% of {len(episodes[name])} episodes ({time.time() - t0:.0f} s)", flush=True)
    before, after = episodes[args.before], episodes[args.after]
    order = difficulty_order(set(difficulty.values()))
    rows = paired_by(before, after, {"all": lambda t: True,
                                     **{d: (lambda t, d=d: difficulty[t] == d) for d in order}})
    for name, r in rows.items():
        print(f"{args.before} -> {args.after} {name:8s} {100 * r['diff']:+.1f} points "
              f"(paired s.e. {100 * r['stderr']:.1f}, {r['n_tasks']} tasks)")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        success = {n: dict(collections.Counter(e.task_id for e in eps if e.success)) for n, eps in episodes.items()}
        (out / "pool.json").write_text(json.dumps({"run": str(run), "samples": args.samples, "seed": args.seed,
                                                   "paired": rows, "successes": success}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How many of an actor's groups hold both outcomes, at several sampling temperatures.

RPR trains on the groups of ``samples_per_task`` episodes of a task that hold a success and a
failure (``drop_uniform_groups``); a near-deterministic actor gives few. This draws ``--tasks``
tasks of a folder uniformly (seeded), samples each ``--group`` times at every temperature, and
prints success, the mixed groups (RPR's own ``uniform_groups`` test), and the groups by their
count of successes. No training.

    python3 bench/groups.py --actor RUN/stages/01-rsr1/actor --tasks RUN/tasks/train --temperatures 1,1.25,1.5,2
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch

from minirsi.config import load_config
from minirsi.core.rpr import uniform_groups
from minirsi.engine.models import load_actor
from minirsi.engine.rollout import make_rollout_fn
from minirsi.run.config import RunConfig, resolve_preset
from minirsi.run.evaluate import load_suite


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actor", required=True, help="actor checkpoint (e.g. a run's stages/01-rsr1/actor)")
    ap.add_argument("--tasks", required=True, help="a folder of tasks (e.g. a run's tasks/train)")
    ap.add_argument("--temperatures", default="1.0", help="comma-separated sampling temperatures")
    ap.add_argument("--n-tasks", type=int, default=64, help="tasks drawn uniformly from the folder")
    ap.add_argument("--group", type=int, default=4, help="samples of each task (RPR's samples_per_task)")
    ap.add_argument("--seed", type=int, default=99, help="rollout seed (the draw of tasks uses 5)")
    ap.add_argument("--preset", default="toy-cpu", help="preset whose rollout settings apply")
    ap.add_argument("--json", action="store_true", help="print one JSON object per temperature")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(RunConfig, resolve_preset(args.preset), [])
    root = Path(args.tasks)
    tasks = load_suite(root)
    pool = random.Random(5).sample(tasks, min(args.n_tasks, len(tasks)))
    actor, tok = load_actor(args.actor)
    actor.eval().requires_grad_(False)
    for tau in (float(x) for x in args.temperatures.split(",")):
        t0 = time.time()
        rollout_fn = make_rollout_fn(tok, dataclasses.replace(cfg.rollout, temperature=tau), progress=False)
        episodes = rollout_fn(actor, [t for t in pool for _ in range(args.group)], args.seed)
        wins: dict[str, int] = collections.Counter()
        for e in episodes:
            wins[e.task_id] += bool(e.success)
        by_count = collections.Counter(wins[t.task_id] for t in pool)
        row = {"temperature": tau, "success": sum(e.success for e in episodes) / len(episodes),
               "groups": len(pool), "mixed": len(pool) - len(uniform_groups(episodes)),
               "by_successes": {str(k): by_count[k] for k in range(args.group + 1)}, "seconds": time.time() - t0}
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(f"temperature {tau}: success {row['success']:.3f}, mixed {row['mixed']} of {len(pool)} groups, "
                  f"by successes {row['by_successes']} ({row['seconds']:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

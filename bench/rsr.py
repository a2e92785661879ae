"""Size an RSR stage on the training pool: success and failure classes before and after.

The RSR rung of the probe ladder (bench/ladder.py is RPR's): load an actor (e.g. a run's
03-rpr1/actor), measure ``--measure`` training tasks once each, run ``rsr.run_rsr`` with the
preset's ``--stage`` settings plus overrides, and measure the same tasks with the same seed
again. Prints success by difficulty, the failure taxonomy (minirsi.run.failures) and what the SFT
set held (distinct rewrites by difficulty, turns), the paired change with its standard error on
all measured tasks, on those the SFT set holds a rewrite of (which SFT can memorise) and on the
others, and writes ``rsr.json``. Choose settings here, on training tasks, never on the
evaluation suites.

    python bench/rsr.py --actor RUN/stages/03-rpr1/actor --tasks RUN/tasks/train --out /tmp/r0
    python bench/rsr.py ... rsr2.lr=1e-4 rsr2.epochs=1
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from minirsi.config import load_config
from minirsi.core.rsr import run_rsr
from minirsi.engine.models import load_actor, save_actor
from minirsi.engine.rollout import make_replay_fn, make_rollout_fn
from minirsi.engine.sampler import HFSampler
from minirsi.run import failures
from minirsi.run.evaluate import load_suite, paired_by
from minirsi.run.config import RunConfig, resolve_preset
from minirsi.run.rundir import stage_seed


def measure(actor, rollout_fn, tasks: list, seed: int) -> tuple[dict, list]:
    """Each task once (seeded): success overall and by difficulty, and the failure classes; and
    the episodes."""
    actor.eval()
    eps = rollout_fn(actor, tasks, seed)
    diff = {t.task_id: t.difficulty for t in tasks}
    by: dict[str, list[int]] = collections.defaultdict(list)
    for e in eps:
        by[diff[e.task_id]].append(int(e.success))
    return {"success": sum(e.success for e in eps) / len(eps),
            "by_difficulty": {d: sum(v) / len(v) for d, v in sorted(by.items())},
            "turns": sum(e.turns for e in eps) / len(eps),
            "failures": failures.summarise(eps, {t.task_id: getattr(t, "path", None) for t in tasks})["counts"]}, eps


def split_by_sft_set(before: list, after: list, trained: set[str]) -> dict[str, dict]:
    """The paired change (``evaluate.paired``) on every measured task, on the tasks the SFT set
    holds a rewrite of (``trained``: what SFT could have memorised) and on the others."""
    return paired_by(before, after, {"all": lambda t: True, "in the SFT set": lambda t: t in trained,
                                     "not in the SFT set": lambda t: t not in trained})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--actor", required=True, help="actor checkpoint (e.g. a run's stages/03-rpr1/actor)")
    ap.add_argument("--tasks", required=True, help="a folder of tasks (e.g. a run's tasks/train)")
    ap.add_argument("--stage", default="rsr2", help="the preset's RSR section whose settings apply")
    ap.add_argument("--measure", type=int, default=600, help="training tasks measured before and after")
    ap.add_argument("--preset", default="toy-cpu")
    ap.add_argument("--seed", type=int, default=0, help="the run seed the stage's seed derives from")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="", help="folder for rsr.json")
    ap.add_argument("--save", default="", help="folder to save the trained actor in (e.g. for bench/ladder.py)")
    ap.add_argument("overrides", nargs="*", help="preset overrides, e.g. rsr2.lr=1e-4")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(RunConfig, resolve_preset(args.preset), args.overrides)
    root = Path(args.tasks)
    tasks = load_suite(root)
    actor, tok = load_actor(args.actor)
    rollout_fn = make_rollout_fn(tok, cfg.rollout, progress=False)
    probe = tasks[: args.measure]
    t0 = time.time()
    before, before_eps = measure(actor, rollout_fn, probe, 4242)
    scfg = dataclasses.replace(getattr(cfg, args.stage), seed=stage_seed(args.seed, args.stage))
    stats = run_rsr(actor, tok, tasks, scfg, rollout_fn, make_replay_fn(scfg.backend, scfg.command_timeout),
                    sampler_factory=HFSampler)
    if args.save:
        save_actor(actor, tok, args.save)
    after, after_eps = measure(actor, rollout_fn, probe, 4242)
    split = split_by_sft_set(before_eps, after_eps, {k["task_id"] for k in stats.kept})
    diff = {t.task_id: t.difficulty for t in tasks}
    kept = collections.Counter(diff[k["task_id"]] for k in stats.kept)
    print(f"RSR set: {stats.sft_examples} distinct rewrites of {stats.runs_verified} verified runs "
          f"({stats.runs_sampled} sampled), by difficulty {dict(sorted(kept.items()))}, "
          f"turns {stats.mean_turns_before:.2f} -> {stats.mean_turns_after:.2f}, "
          f"SFT loss {stats.sft_loss_first:.3f} -> {stats.sft_loss_last:.3f}")
    for name, m in (("before", before), ("after", after)):
        print(f"{name:6s} S {100 * m['success']:.1f}%  "
              + " ".join(f"{d} {100 * v:.1f}" for d, v in m["by_difficulty"].items())
              + f"  turns {m['turns']:.2f}  failures {m['failures']}")
    print(f"training-pool success {100 * before['success']:.1f}% -> {100 * after['success']:.1f}%: "
          f"{100 * (after['success'] - before['success']):+.1f} points ({len(probe)} tasks, {time.time() - t0:.0f} s)")
    for name, r in split.items():
        print(f"  {name:18s} {r['n_tasks']:4d} tasks: {100 * r['before']:.1f}% -> {100 * r['after']:.1f}%, "
              f"paired {100 * r['diff']:+.1f} (s.e. {100 * r['stderr']:.1f})")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "rsr.json").write_text(json.dumps({"overrides": args.overrides, "before": before, "after": after,
                                                  "by_sft_set": split,
                                                  "kept_by_difficulty": kept, "stats": {k: v for k, v in stats.to_dict().items() if k != "kept"}},
                                                 indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What doing nothing earns: the reward of stopping at once against the right run's, discounted.

RPR pays its reward (FDR or SPR) at the episode's last token, and TB-GAE discounts it by
``gamma_turn`` once per turn boundary. An untouched sandbox already passes some checks (a source
file kept, a directory left in place), so stopping at once earns ``P0 / D_f`` under FDR; the
right run earns ``C / D_f`` but only after its L turns (one per command: the step lines it
reads, the obstacles' fixes, the step's commands), which the first token sees as
``gamma_turn^L`` of it. Where the first is at least the second, the stage's reward pays the
agent to stop: a property of the world and the discount alone, measured here without a model.

    python3 bench/floor.py                      # the toy-cpu training pool (1,000 tasks, ~1 min)
    python3 bench/floor.py --n 200 --json out.json

It prints, per family and difficulty, C, P0 and L, then for each discount on the grid the number
of tasks where stopping at once pays at least as much as the right run, under FDR (RPR-1) and SPR
(RPR-2), and the smallest such discount with none (what the toy-cpu preset's ``gamma_turn`` is).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from minirsi.config import load_config
from minirsi.core.rpr import score
from minirsi.env.task_cli import run_empty
from minirsi.env.tasks import load_task
from minirsi.run.config import RunConfig, resolve_preset
from minirsi.run.stages import calibrate_scales
from toy_envs.base import write_task
from toy_envs.suites import suite_instances

GRID = (0.9, 0.95, 0.97, 0.99, 1.0)


def measure(cfg: RunConfig, n: int, backend: str) -> tuple[list[dict], dict[str, float]]:
    """C, P0 (checks an untouched sandbox passes) and L (the right run's turns) of the first
    ``n`` training-pool tasks, and their families' D_f as the run calibrates them."""
    insts = suite_instances("train", n, cfg.suites.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tasks = [load_task(write_task(inst, Path(tmp))) for inst in insts]
        for inst, task in zip(insts, tasks):
            v = run_empty(task, backend=backend)
            if v.error:
                raise RuntimeError(f"task {inst.task_id}: the verifier of an untouched sandbox failed: {v.error}")
            rows.append({"task": inst.task_id, "family": inst.family.name, "difficulty": inst.difficulty,
                         "C": v.total, "P0": v.passed, "L": len(inst.clean_run)})
        scales = calibrate_scales(tasks, cfg)
    return rows, scales


def stop_pays(rows: list[dict], scales: dict[str, float], gamma: float, reward: str) -> list[str]:
    """The tasks where stopping at once earns at least the right run discounted by ``gamma^L``
    (each scored as RPR scores an episode: ``rpr.score``)."""
    stop = score([SimpleNamespace(success=False, passed=x["P0"], family=x["family"]) for x in rows], reward, scales)
    right = score([SimpleNamespace(success=True, passed=x["C"], family=x["family"]) for x in rows], reward, scales)
    return [x["task"] for x, a, b in zip(rows, stop, right) if a >= gamma ** x["L"] * b]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=None, help="pool tasks (default: the preset's suites.train)")
    ap.add_argument("--preset", default="toy-cpu")
    ap.add_argument("--backend", default="bwrap")
    ap.add_argument("--json", default=None, help="write the rows and the counts here")
    args = ap.parse_args(argv)
    cfg = load_config(RunConfig, resolve_preset(args.preset), [])
    rows, scales = measure(cfg, args.n or cfg.suites.train, args.backend)
    groups = collections.defaultdict(list)
    for x in rows:
        groups[(x["family"], x["difficulty"])].append(x)
    print(f"{len(rows)} training-pool tasks; D_f {scales}")
    print(f"{'family':9} {'difficulty':10} {'n':>4} {'C':>5} {'P0':>5} {'P0/C':>5} {'L':>5}")
    for (fam, diff), xs in sorted(groups.items()):
        mean = lambda k: sum(x[k] for x in xs) / len(xs)  # noqa: E731
        share = sum(x["P0"] / x["C"] for x in xs) / len(xs)
        print(f"{fam:9} {diff:10} {len(xs):4} {mean('C'):5.1f} {mean('P0'):5.1f} {share:5.2f} {mean('L'):5.1f}")
    table = {}
    for g in GRID:
        table[g] = {rw: stop_pays(rows, scales, g, rw) for rw in ("fdr", "spr")}
        print(f"gamma_turn {g}: stopping at once pays >= the right run on {len(table[g]['fdr'])} tasks under FDR, "
              f"{len(table[g]['spr'])} under SPR")
    ok = [g for g in GRID if not table[g]["fdr"] and not table[g]["spr"]]
    print(f"smallest discount with none: {min(ok) if ok else 'none on the grid'}; the preset's "
          f"rpr1.gamma_turn {cfg.rpr1.gamma_turn}, rpr2.gamma_turn {cfg.rpr2.gamma_turn}")
    preset = {"rpr1": len(stop_pays(rows, scales, cfg.rpr1.gamma_turn, cfg.rpr1.reward)),
              "rpr2": len(stop_pays(rows, scales, cfg.rpr2.gamma_turn, cfg.rpr2.reward))}
    print(f"under the preset's discounts and rewards: rpr1 {preset['rpr1']}, rpr2 {preset['rpr2']} tasks")
    if args.json:
        Path(args.json).write_text(json.dumps({"scales": scales, "rows": rows, "preset": preset,
                                               "grid": {str(g): {k: len(v) for k, v in t.items()}
                                                        for g, t in table.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

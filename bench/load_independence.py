"""Results that do not depend on the machine's load: the smoke preset, run twice with one seed,
once as the machine is and once with every core kept busy, must write byte-identical results.json.

    python bench/load_independence.py [--out DIR] [--burners N] [--max-minutes M] [key=value ...]

Runs ``minirsi run --preset smoke`` into DIR/idle, then into DIR/loaded while N processes (default
one per core) spin a ``while True`` loop at normal priority (the runs themselves at nice 10, so
they get the cores less often than the loops); each loop is started under ``timeout`` and ends by
itself after --max-minutes even if this script is killed, and is stopped when the loaded run
ends. Then it compares results.json byte for byte (exit status 1 when they differ), the final
actor's weights, and per evaluated stage the evaluation episodes: how many have the same token
ids, their stop reasons, and their median wall time against their median command time (what
the episode time limit counts, ``minirsi/engine/rollout.py``).

"Idle" means no load of ours: other jobs on the machine may load either run. The claim is that
the result does not depend on that. Where it did, a wall-clock limit had fired (up to commit
b0f0bea the episode time limit counted wall time; docs/experiments.md, "Load, machines and
results"). Takes two smoke runs: ~6 min idle, 15-30 min loaded on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_smoke(out: Path, overrides: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = ["nice", "-n", "10", sys.executable, "-m", "minirsi.cli", "run", "--preset", "smoke", "--out", str(out),
           "--no-report", *overrides]
    t0 = time.time()
    with open(f"{out}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}); see {out}.log")
    return time.time() - t0


def burners(n: int, max_minutes: float) -> list[subprocess.Popen]:
    loop = [sys.executable, "-c", "while True: pass"]
    return [subprocess.Popen(["timeout", str(int(max_minutes * 60)), *loop]) for _ in range(n)]


def episodes(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def compare(idle: Path, loaded: Path) -> None:
    for a_file in sorted(idle.glob("stages/*/eval/*.jsonl")):
        b_file = loaded / a_file.relative_to(idle)
        a, b = episodes(a_file), episodes(b_file)
        same = sum(x["token_ids"] == y["token_ids"] for x, y in zip(a, b))
        print(f"{a_file.relative_to(idle)}: {same}/{len(a)} episodes with the same token ids")
        for name, eps in (("idle", a), ("loaded", b)):
            reasons = dict(collections.Counter(e["stop_reason"] for e in eps))
            wall = statistics.median(e["meta"]["wall_s"] for e in eps)
            cmd = statistics.median(e["meta"].get("command_s", float("nan")) for e in eps)
            print(f"  {name:<7} stop reasons {reasons}; median wall {wall:.1f} s, median command time {cmd:.3f} s")
    finals = sorted(idle.glob("stages/*/actor/model.safetensors"))
    if finals:
        last = finals[-1].relative_to(idle)
        same = (idle / last).read_bytes() == (loaded / last).read_bytes()
        print(f"{last}: {'byte-identical' if same else 'DIFFERENT'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/minirsi-load-bench", help="parent of the two run directories")
    ap.add_argument("--burners", type=int, default=os.cpu_count() or 2, help="CPU-burning loops (default: one per core)")
    ap.add_argument("--max-minutes", type=float, default=60.0, help="each loop ends by itself after this long")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the smoke preset, for both runs")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    idle, loaded = out / "idle", out / "loaded"
    for d in (idle, loaded):
        if d.exists():
            sys.exit(f"{d} exists; remove it or pick another --out")

    t_idle = run_smoke(idle, args.overrides)
    with open("/proc/loadavg") as f:
        load_idle = f.read().split()[0]
    loops = burners(args.burners, args.max_minutes)
    try:
        t_loaded = run_smoke(loaded, args.overrides)
        with open("/proc/loadavg") as f:
            load_loaded = f.read().split()[0]
    finally:
        for p in loops:
            p.terminate()
            p.wait()
    print(f"idle run {t_idle / 60:.1f} min (load average {load_idle} at its end); loaded run with "
          f"{args.burners} burners {t_loaded / 60:.1f} min (load average {load_loaded} at its end)")
    compare(idle, loaded)
    same = (idle / "results.json").read_bytes() == (loaded / "results.json").read_bytes()
    print(f"results.json: {'byte-identical' if same else 'DIFFERENT'} ({idle}/results.json, {loaded}/results.json)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

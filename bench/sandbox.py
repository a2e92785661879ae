"""Sandbox speed: per-command overhead and open+close time, bwrap and Docker, in one run.

    python bench/sandbox.py [--n 200] [--opens 20]

Measures (medians, milliseconds):
- plain: ``subprocess.run(["/bin/true"])`` on the host, the floor any shell-out pays;
- run(builtin): ``sb.run("true")``: the shell protocol alone (no fork in the sandbox);
- run(external): ``sb.run("/bin/true")``: a fork+exec inside the sandbox, comparable to plain;
- open+close: ``open_sandbox(task)`` then ``close()`` on the `hello` fixture (work directory copy,
  jail start, shell ready, teardown).
Per-command overhead = run(external) - plain, reported with the ratio run(external) / plain.
Docker is measured when DOCKER_HOST answers (bash scripts/dockerd.sh start). Targets (issue 3):
bwrap overhead < 15 ms per command, open+close < 150 ms.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minirsi.env.sandbox import SandboxError, open_sandbox  # noqa: E402
from minirsi.env.tasks import load_task  # noqa: E402
from timing import median_ms  # noqa: E402  (bench/timing.py: this script's folder is on sys.path)

TASK = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tasks" / "good" / "hello"


def measure(backend: str, n: int, opens: int) -> dict[str, float]:
    task = load_task(TASK)
    with open_sandbox(task, backend=backend) as sb:
        sb.run("true", timeout=30)  # warm
        builtin = median_ms(lambda: sb.run("true", timeout=30), n)
        external = median_ms(lambda: sb.run("/bin/true", timeout=30), n)
    open_close = median_ms(lambda: open_sandbox(task, backend=backend).close(), opens)
    return {"builtin": builtin, "external": external, "open_close": open_close}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="commands per measurement")
    ap.add_argument("--opens", type=int, default=20, help="open+close cycles per backend")
    args = ap.parse_args()

    plain = median_ms(lambda: subprocess.run(["/bin/true"], check=True), args.n)
    results = {"bwrap": measure("bwrap", args.n, args.opens)}
    if os.environ.get("DOCKER_HOST"):
        try:
            results["docker"] = measure("docker", args.n, max(3, args.opens // 4))
        except SandboxError as e:
            print(f"docker: skipped ({e})")
    else:
        print("docker: skipped (DOCKER_HOST unset; bash scripts/dockerd.sh start)")

    print(f"plain subprocess.run(['/bin/true']): {plain:.2f} ms (median of {args.n})")
    print(f"{'backend':<8} {'run(true)':>10} {'run(/bin/true)':>15} {'overhead':>9} {'ratio':>6} {'open+close':>11}")
    for name, r in results.items():
        overhead = r["external"] - plain
        print(f"{name:<8} {r['builtin']:>8.2f}ms {r['external']:>13.2f}ms {overhead:>7.2f}ms "
              f"{r['external'] / plain:>5.2f}x {r['open_close']:>9.1f}ms")
    if "docker" in results:
        d, b = results["docker"], results["bwrap"]
        print(f"docker / bwrap: per command {d['external'] / b['external']:.1f}x, open+close {d['open_close'] / b['open_close']:.1f}x")
    b = results["bwrap"]
    print(f"bwrap targets: overhead {b['external'] - plain:.2f} ms (< 15 ms: {b['external'] - plain < 15}), "
          f"open+close {b['open_close']:.1f} ms (< 150 ms: {b['open_close'] < 150})")


if __name__ == "__main__":
    main()

"""Environment layers: preparation, cached preparation, and sandbox open+close on a layer, in one run.

    python bench/layers.py [--opens 20] [--keep-cache]

Prepares tests/fixtures/tasks/tb2/word-stats (Dockerfile: FROM python:3.13-slim-bookworm, two
apt packages (jq, tree), one pip package (six), two COPY lines; test.sh: the standard uvx line,
so pytest and pytest-json-ctrf are prepared too) into a fresh private layer cache, and prints
(seconds, milliseconds):
- prepare (cold): every layer built with the network (the Debian mirror and PyPI);
- prepare (cached): the second preparation, which only hashes environment/ and test.sh;
- disk: each layer's size (its upper directory only: the diff, not a copy of the ~400 MB rootfs);
- open+close: ``open_sandbox(task)`` then ``close()`` on the prepared layer (median), next to
  the same on the `hello` fixture without a layer (the base rootfs), and their ratio.
Targets (issue 16): cached preparation < 1 s; open+close on a layer < 150 ms. Needs root.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minirsi.env.prepare import prepare  # noqa: E402
from minirsi.env.sandbox import open_sandbox  # noqa: E402
from minirsi.env.sandbox.bwrap import default_rootfs  # noqa: E402
from minirsi.env.tasks import load_task  # noqa: E402
from timing import median_ms  # noqa: E402  (bench/timing.py: this script's folder is on sys.path)

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tasks"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--opens", type=int, default=20, help="open+close cycles per task")
    ap.add_argument("--keep-cache", action="store_true", help="leave the private layer cache in /tmp")
    args = ap.parse_args()

    cache = Path(tempfile.mkdtemp(prefix="minirsi-bench-layers-"))
    os.environ["MINIRSI_LAYERS"] = str(cache)
    task = load_task(FIXTURES / "tb2" / "word-stats")
    try:
        t0 = time.perf_counter()
        prepared, built = prepare(task, default_rootfs())
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, built_again = prepare(task, default_rootfs())
        cached = time.perf_counter() - t0
        assert built and not built_again
        layers = [(name, layer.key, layer.meta) for name, layer in
                  [("env", prepared.env_layer), ("apt", prepared.apt_layer), ("pip", prepared.pip_layer)] if layer]
        plain = load_task(FIXTURES / "good" / "hello")
        open_sandbox(task).close()  # warm the page cache for both
        open_sandbox(plain).close()
        on_layer = median_ms(lambda: open_sandbox(task).close(), args.opens)
        on_rootfs = median_ms(lambda: open_sandbox(plain).close(), args.opens)
    finally:
        if not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)

    print(f"prepare (cold, network): {cold:.1f} s   cached: {cached * 1000:.1f} ms "
          f"(< 1 s: {cached < 1.0}; {cold / cached:.0f}x faster)")
    for name, key, meta in layers:
        print(f"  {name} layer {key}: {meta['disk_bytes'] / 2**20:.1f} MiB, built in {meta['seconds']:.1f} s")
    print(f"open+close (median of {args.opens}): on the layer {on_layer:.1f} ms, on the base rootfs {on_rootfs:.1f} ms "
          f"({on_layer / on_rootfs:.2f}x); < 150 ms: {on_layer < 150}")


if __name__ == "__main__":
    main()

"""What the benches share: the median wall time of repeated calls."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_ms(fn: Callable[[], object], n: int) -> float:
    """Median over ``n`` calls of ``fn()``, in milliseconds (the median shrugs off the slow
    outliers a loaded machine adds)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)

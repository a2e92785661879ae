"""Family Dense Reward (FDR) and its frozen per-family calibration (docs/method.md section 2).

    D_f = Q_q({C_i : calibration task i in family f}),   q = 0.90 (docs/method.md)
    FDR = P / D_f                                         (not clipped)

=========  =====================================================================
Symbol     Meaning
=========  =====================================================================
P          passed non-hygiene checks of a run
C          all non-hygiene checks of a task
D_f        the family's scale: the q-quantile of C over its calibration tasks
fallback   D for a family with no calibration tasks (docs/method.md: 82)
=========  =====================================================================

FDR is deliberately not clipped: a failed run that passes more checks than D_f scores >= 1,
the proxy-outcome mismatch that SPR (``minirsi/core/spr.py``) removes. ``minirsi/core/reward_audit.py``
counts such runs.

Choices docs/method.md leaves open (ours)
------------------------------------
- Quantile method: linear interpolation between order statistics, position q (n - 1) in the
  sorted counts (Hyndman-Fan type 7, numpy's and torch's default ``"linear"``). Example:
  counts [4, 10, 20], q = 0.9: position 1.8, so D_f = 10 + 0.8 (20 - 10) = 18.
- A family listed with no calibration tasks gets the fallback. A family never seen at
  calibration is asked for with ``scale_for(family, scales)``, which also returns the
  fallback: ``calibrate`` returns a ``Scales`` (a ``dict[str, float]``) that remembers the
  fallback and quantile it was made with, and ``save_scales`` writes both to the JSON so a
  run's calibration is frozen with it.
- D_f must be > 0: a family whose calibration tasks all have 0 checks raises ValueError.

Call::

    scales = calibrate({"files": [12, 30, 18], "git": [40, 52]})   # quantile 0.9, fallback 82
    save_scales(scales, "run/reward_scales.json"); scales = load_scales("run/reward_scales.json")
    r = family_dense_reward(passed=15, family="files", scales=scales)
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Mapping, Sequence

from minirsi.core.atomic import atomic_write_json

__all__ = [
    "DEFAULT_QUANTILE", "DEFAULT_FALLBACK", "Scales", "calibrate", "quantile_linear",
    "scale_for", "save_scales", "load_scales", "family_dense_reward", "check_counts",
]

DEFAULT_QUANTILE = 0.9
DEFAULT_FALLBACK = 82.0
SCALES_FORMAT = "minirsi.fdr.scales/1"


class Scales(dict):
    """D_f per family (a plain ``dict[str, float]``), plus the ``fallback`` D for families it
    does not list and the ``quantile`` it was calibrated with."""

    def __init__(self, D_f: Mapping[str, float] = (), fallback: float = DEFAULT_FALLBACK,
                 quantile: float = DEFAULT_QUANTILE):
        super().__init__(D_f)
        for family, D in self.items():
            check_family(family)
            check_scale(D, f"D_f for family {family!r}")
        self.fallback = check_scale(fallback, "fallback")
        self.quantile = check_quantile(quantile)

    def __repr__(self) -> str:
        return f"Scales({dict(self)!r}, fallback={self.fallback}, quantile={self.quantile})"


# --------------------------------------------------------------------------- validation


def check_family(family: object) -> str:
    if not isinstance(family, str) or not family.strip():
        raise ValueError(f"family must be a non-empty string, got {family!r}; fix: use the "
                         "task's category from task.toml")
    return family


def check_scale(D: object, what: str) -> float:
    if isinstance(D, bool) or not isinstance(D, numbers.Real) or not math.isfinite(D) or D <= 0:
        raise ValueError(f"{what} = {D!r} must be a finite number > 0")
    return float(D)


def check_quantile(quantile: object, what: str = "quantile") -> float:
    """The one definition of a valid calibration quantile q (``RunConfig.fdr_quantile`` too)."""
    if isinstance(quantile, bool) or not isinstance(quantile, numbers.Real) or not (
            0.0 <= quantile <= 1.0):  # also rejects NaN
        raise ValueError(f"{what} = {quantile!r} must lie in [0, 1], e.g. 0.9")
    return float(quantile)


def check_counts(passed: object, total: object | None = None, what: str = "run") -> int:
    """Validate P (and C when given): integers, 0 <= P <= C. Returns P."""
    for name, x in (("passed", passed), ("total", total)):
        if x is None:
            continue
        if isinstance(x, numbers.Real) and not isinstance(x, numbers.Integral) and (
                math.isfinite(x) and float(x).is_integer()):
            x = int(x)  # 12.0 is a count; 12.5 and NaN are not
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0:
            raise ValueError(f"{what}: {name} = {x!r} must be a non-negative integer count "
                             "of checks")
    if total is not None and int(passed) > int(total):
        raise ValueError(f"{what}: passed = {passed} > total = {total}; P counts passed "
                         "non-hygiene checks, C all non-hygiene checks of the task")
    return int(passed)


# --------------------------------------------------------------------------- calibration


def quantile_linear(xs: Sequence[float], q: float) -> float:
    """The q-quantile of ``xs`` by linear interpolation at position q (n - 1) (type 7)."""
    check_quantile(q)
    if not xs:
        raise ValueError("quantile of an empty list")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


def calibrate(
    check_counts_by_family: Mapping[str, Sequence[int]],
    quantile: float = DEFAULT_QUANTILE,
    fallback: float = DEFAULT_FALLBACK,
) -> Scales:
    """D_f = the ``quantile`` of C over each family's calibration tasks (fallback if none)."""
    check_quantile(quantile)
    check_scale(fallback, "fallback")
    D_f = {}
    for family, counts in check_counts_by_family.items():
        check_family(family)
        counts = list(counts)
        for C in counts:
            check_counts(C, what=f"calibration task of family {family!r}")
        if not counts:
            D_f[family] = float(fallback)
            continue
        D = quantile_linear([float(C) for C in counts], quantile)
        if D <= 0:
            raise ValueError(f"family {family!r}: the {quantile} quantile of its check counts "
                             f"{counts} is {D}; D_f must be > 0; fix: calibrate on tasks that "
                             "have checks")
        D_f[family] = D
    return Scales(D_f, fallback=fallback, quantile=quantile)


def scale_for(family: str, scales: Mapping[str, float], fallback: float | None = None) -> float:
    """D_f for ``family``; for a family ``scales`` does not list: ``fallback`` if given, else
    the fallback the scales were calibrated with (82 for a plain dict)."""
    check_family(family)
    if family in scales:
        return check_scale(scales[family], f"D_f for family {family!r}")
    if fallback is None:
        fallback = getattr(scales, "fallback", DEFAULT_FALLBACK)
    return check_scale(fallback, "fallback")


def save_scales(scales: Mapping[str, float], path: str | Path) -> None:
    """Write the frozen calibration (D_f, fallback, quantile) as JSON, atomically."""
    scales = scales if isinstance(scales, Scales) else Scales(scales)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": SCALES_FORMAT, "quantile": scales.quantile, "fallback": scales.fallback,
           "D_f": dict(sorted(scales.items()))}
    atomic_write_json(path, doc)


def load_scales(path: str | Path) -> Scales:
    """Read what ``save_scales`` wrote; a malformed file raises ValueError naming it."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); fix: re-run the calibration") from None
    if not isinstance(doc, dict) or doc.get("format") != SCALES_FORMAT:
        raise ValueError(f"{path}: field 'format' must be {SCALES_FORMAT!r}; this is not a "
                         "file written by minirsi.core.fdr.save_scales")
    for key in ("quantile", "fallback", "D_f"):
        if key not in doc:
            raise ValueError(f"{path}: missing field {key!r}")
    if not isinstance(doc["D_f"], dict):
        raise ValueError(f"{path}: field 'D_f' must map family -> scale")
    try:
        return Scales(doc["D_f"], fallback=doc["fallback"], quantile=doc["quantile"])
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


# --------------------------------------------------------------------------- the reward


def family_dense_reward(passed: int, family: str, scales: Mapping[str, float],
                        total: int | None = None) -> float:
    """FDR = P / D_f, not clipped. ``total`` (C), when given, is checked: P <= C."""
    P = check_counts(passed, total, what=f"family {family!r}")
    return P / scale_for(family, scales)

"""Success-Prioritized Reward (SPR), docs/method.md section 2.

    SPR = S + P / (P + D'_f),    S in {0, 1},  D'_f a frozen per-family constant > 0

=========  ==========================================================================
Symbol     Meaning
=========  ==========================================================================
S          the verifier's strict outcome (``/logs/verifier/reward.txt``): 1 or 0
P          passed non-hygiene checks
D'_f       the family's SPR scale; defaults to FDR's D_f (``minirsi/core/fdr.py``)
=========  ==========================================================================

Why it fixes FDR: P / (P + D') lies in [0, 1) for every P >= 0 and D' > 0, so every failure
scores < 1 and every success >= 1, whatever P; and d/dP [P / (P + D')] = D' / (P + D')^2 > 0,
so SPR still grows with progress. Edge: P = 0 gives SPR = S. D' = 0 would make the term 1
for every P > 0 and 0/0 at P = 0, so D' must be > 0 (validated, as for D_f).

Choices docs/method.md leaves open (ours): a family missing from ``scales_prime`` (or from
``scales`` when ``scales_prime`` is None) gets that table's fallback, exactly as FDR does
(``minirsi.core.fdr.scale_for``). ``total`` (C), when given, is checked: P <= C.

Call::

    from minirsi.core.fdr import calibrate
    from minirsi.core.spr import success_prioritized_reward
    scales = calibrate({"files": [12, 30, 18]})
    success_prioritized_reward(success=False, passed=15, family="files", scales=scales)  # < 1
"""

from __future__ import annotations

from typing import Mapping

from minirsi.core.fdr import check_counts, scale_for

__all__ = ["success_prioritized_reward"]


def success_prioritized_reward(
    success: bool,
    passed: int,
    family: str,
    scales: Mapping[str, float],
    scales_prime: Mapping[str, float] | None = None,
    total: int | None = None,
) -> float:
    """SPR = S + P / (P + D'_f), with D'_f from ``scales_prime`` (default: ``scales``)."""
    if not isinstance(success, bool) and success not in (0, 1):
        raise ValueError(f"family {family!r}: success = {success!r} must be True/False (or 1/0)")
    P = check_counts(passed, total, what=f"family {family!r}")
    D_prime = scale_for(family, scales if scales_prime is None else scales_prime)
    return float(bool(success)) + P / (P + D_prime)

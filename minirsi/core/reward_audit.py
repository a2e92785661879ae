"""Reward audit: how much of a reward's mass goes to failed runs (docs/method.md section 2).

Over a set of scored runs and one reward function R:

    failed share of reward mass = sum_{failed runs} R / sum_{all runs} R
    failures scoring >= 1       = #{failed runs with R >= 1}
    failures passing every executed check = #{failed runs whose executed checks all passed}

The paper's audit: 50.09% of the mass goes to failures under FDR against 28.72% under SPR;
158 failures score >= 1 under FDR (none can under SPR); 48 of 4,352 runs passed every executed
check and still failed the gate.

A run is a ``minirsi.core.episode.Episode`` or any mapping with ``success``, ``passed``, ``total``,
``family`` and either ``executed_all_passed`` or ``checks`` (check name -> passed | failed |
error | skipped, read as ``Episode.executed_all_passed`` reads it).

Choices (ours): a reward mass of 0 gives a failed share of 0 (no mass is misplaced); a reward
function returning NaN raises ValueError naming the run.

Call::

    from minirsi.core.reward_audit import audit_fdr_spr
    for report in audit_fdr_spr(episodes, scales):
        print(report.format())

or ``audit(runs, reward_fn, name)`` for any ``reward_fn(ScoredRun) -> float``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from minirsi.core.fdr import check_counts, check_family, family_dense_reward
from minirsi.core.spr import success_prioritized_reward

__all__ = ["ScoredRun", "AuditReport", "as_scored_run", "audit", "audit_fdr_spr",
           "fdr_reward", "spr_reward"]


@dataclass(frozen=True)
class ScoredRun:
    """What the audit needs from one run."""

    success: bool
    """S, the verifier's strict outcome."""
    passed: int
    """P, passed non-hygiene checks."""
    total: int
    """C, all non-hygiene checks of the task."""
    family: str
    """f, the task's category."""
    executed_all_passed: bool
    """Every check that ran passed (it may still have failed the gate)."""


def as_scored_run(run: Any, index: int = 0) -> ScoredRun:
    """An Episode or a mapping as a validated ``ScoredRun``; ``index`` names it in errors."""
    if isinstance(run, ScoredRun):
        return run
    get = run.get if isinstance(run, Mapping) else (lambda k, d=None: getattr(run, k, d))
    what = f"run {index}"
    missing = [k for k in ("success", "passed", "total", "family") if get(k) is None]
    if missing:
        raise ValueError(f"{what}: missing field(s) {missing}; a run needs success, passed, "
                         "total, family")
    executed_all_passed = get("executed_all_passed")
    if executed_all_passed is None:
        checks = get("checks")
        if checks is None:
            raise ValueError(f"{what}: needs 'executed_all_passed' or 'checks'")
        ran = [v for v in checks.values() if v in ("passed", "failed", "error")]
        executed_all_passed = bool(ran) and all(v == "passed" for v in ran)
    success = get("success")
    if success not in (True, False, 0, 1):
        raise ValueError(f"{what}: success = {success!r} must be True/False")
    family = check_family(get("family"))
    check_counts(get("passed"), get("total"), what=f"{what} (family {family!r})")
    return ScoredRun(bool(success), int(get("passed")), int(get("total")), family,
                     bool(executed_all_passed))


@dataclass(frozen=True)
class AuditReport:
    """The audit of one reward function over one set of runs."""

    reward: str
    """Name of the reward (e.g. FDR, SPR)."""
    runs: int
    successes: int
    failures: int
    reward_mass: float
    """Sum of rewards over all runs."""
    failed_reward_mass: float
    """Sum of rewards over failed runs."""
    failed_share: float
    """failed_reward_mass / reward_mass (0 when the mass is 0)."""
    failures_scoring_at_least_1: int
    """Failed runs whose reward is >= 1 (a failure outscoring a bare success)."""
    failures_all_executed_passed: int
    """Failed runs that passed every executed check (independent of the reward)."""

    def format(self) -> str:
        return (
            f"{self.reward}: {self.runs} runs ({self.successes} succeeded, {self.failures} "
            f"failed)\n"
            f"  failed share of reward mass   {self.failed_share:7.2%}  "
            f"({self.failed_reward_mass:.4g} of {self.reward_mass:.4g})\n"
            f"  failures scoring >= 1         {self.failures_scoring_at_least_1:7d}\n"
            f"  failures passing every executed check {self.failures_all_executed_passed:d}"
        )


def audit(runs: Iterable[Any], reward_fn: Callable[[ScoredRun], float],
          name: str = "reward") -> AuditReport:
    """Audit ``reward_fn`` over ``runs`` (Episodes, mappings or ScoredRuns)."""
    scored = [as_scored_run(run, i) for i, run in enumerate(runs)]
    mass = failed_mass = 0.0
    at_least_1 = 0
    for i, run in enumerate(scored):
        R = float(reward_fn(run))
        if math.isnan(R):
            raise ValueError(f"run {i} (family {run.family!r}): {name} is NaN")
        mass += R
        if not run.success:
            failed_mass += R
            at_least_1 += R >= 1.0
    failures = sum(not run.success for run in scored)
    return AuditReport(
        reward=name,
        runs=len(scored),
        successes=len(scored) - failures,
        failures=failures,
        reward_mass=mass,
        failed_reward_mass=failed_mass,
        failed_share=failed_mass / mass if mass != 0 else 0.0,
        failures_scoring_at_least_1=at_least_1,
        failures_all_executed_passed=sum(
            not run.success and run.executed_all_passed for run in scored),
    )


def fdr_reward(scales: Mapping[str, float]) -> Callable[[ScoredRun], float]:
    """``reward_fn`` for FDR = P / D_f."""
    return lambda run: family_dense_reward(run.passed, run.family, scales, total=run.total)


def spr_reward(scales: Mapping[str, float],
               scales_prime: Mapping[str, float] | None = None) -> Callable[[ScoredRun], float]:
    """``reward_fn`` for SPR = S + P / (P + D'_f)."""
    return lambda run: success_prioritized_reward(run.success, run.passed, run.family, scales,
                                                  scales_prime, total=run.total)


def audit_fdr_spr(runs: Iterable[Any], scales: Mapping[str, float],
                  scales_prime: Mapping[str, float] | None = None) -> list[AuditReport]:
    """The paper's audit: the same runs under FDR and under SPR."""
    runs = list(runs)
    return [audit(runs, fdr_reward(scales), "FDR"),
            audit(runs, spr_reward(scales, scales_prime), "SPR")]

"""Tutorial 2: rewards from checks: FDR, SPR and the reward audit.
(modules: minirsi/core/fdr.py, minirsi/core/spr.py, minirsi/core/reward_audit.py)

Run:  python tutorials/02_rewards.py

A task's verifier runs C checks (pytest tests; hygiene ones excluded) and a strict gate S.
Family Dense Reward scales the passed count P by D_f, the 0.90 quantile of C over the family's
calibration tasks: FDR = P / D_f. It is not clipped, so a run that passes many checks but fails
the gate can out-score a success. Success-Prioritized Reward fixes that ordering:
SPR = S + P / (P + D'_f) puts every failure below 1 and every success at or above 1.
The audit measures how much reward mass goes to failures (the paper: 50.09% under FDR,
28.72% under SPR over 4,352 runs).
"""

from minirsi.core.fdr import calibrate, family_dense_reward
from minirsi.core.reward_audit import audit_fdr_spr
from minirsi.core.spr import success_prioritized_reward

# Calibration: checks per task of each family's calibration tasks. Frozen once per run.
scales = calibrate({"files": [4, 5, 6, 8, 10], "text": [3, 3, 4]})
print("D_f:", {f: round(d, 2) for f, d in scales.items()}, "| unknown family ->", scales.fallback)
# The 0.90 quantile, linearly interpolated: files 8 + 0.6 * (10 - 8) = 9.2; text 3 + 0.8 * (4 - 3) = 3.8.
assert abs(scales["files"] - 9.2) < 1e-9 and abs(scales["text"] - 3.8) < 1e-9 and scales.fallback == 82

# Four runs of the "files" family (D_f = 9.2). The second passes 10 checks and fails the gate.
runs = [
    {"success": True, "passed": 4, "total": 4, "family": "files", "executed_all_passed": True},
    {"success": False, "passed": 10, "total": 10, "family": "files", "executed_all_passed": True},
    {"success": False, "passed": 2, "total": 8, "family": "files", "executed_all_passed": False},
    {"success": True, "passed": 3, "total": 3, "family": "text", "executed_all_passed": True},
]
print(f"{'S':>2} {'P':>3} {'FDR':>6} {'SPR':>6}")
for r in runs:
    fdr = family_dense_reward(r["passed"], r["family"], scales)
    spr = success_prioritized_reward(r["success"], r["passed"], r["family"], scales)
    print(f"{int(r['success']):>2} {r['passed']:>3} {fdr:>6.3f} {spr:>6.3f}")
    assert abs(fdr - r["passed"] / scales[r["family"]]) < 1e-12
    assert (spr >= 1) == r["success"]  # SPR orders every success above every failure

# The failing run that passed all 10 checks scores > 1 under FDR: the proxy-outcome mismatch.
assert family_dense_reward(10, "files", scales) > 1

fdr_audit, spr_audit = audit_fdr_spr(runs, scales)
for report in (fdr_audit, spr_audit):
    print(report.format())
    assert (report.runs, report.successes, report.failures) == (4, 2, 2)
    assert report.failures_all_executed_passed == 1  # the second run: a property of the runs, not the reward
# SPR moves reward mass from failures to successes, and no failure reaches 1 under it.
assert spr_audit.failed_share < fdr_audit.failed_share
assert (fdr_audit.failures_scoring_at_least_1, spr_audit.failures_scoring_at_least_1) == (1, 0)

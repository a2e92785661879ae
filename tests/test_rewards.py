"""FDR, SPR, their calibration and the reward audit (minirsi/core/fdr.py, spr.py, reward_audit.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minirsi.core.episode import Episode
from minirsi.core.fdr import (Scales, calibrate, family_dense_reward, load_scales, quantile_linear,
                         save_scales, scale_for)
from minirsi.core.reward_audit import AuditReport, audit, audit_fdr_spr
from minirsi.core.spr import success_prioritized_reward

SETTINGS = settings(max_examples=150, deadline=None)
counts = st.lists(st.integers(0, 500), min_size=1, max_size=30)

# --------------------------------------------------------------------------- calibration


def test_quantile_hand_worked():
    # sorted [4, 10, 20], q = 0.9: position 0.9 * 2 = 1.8 -> 10 + 0.8 * (20 - 10) = 18
    assert quantile_linear([20, 4, 10], 0.9) == pytest.approx(18.0)
    # one task: every quantile is its count
    assert quantile_linear([7], 0.9) == 7


@SETTINGS
@given(counts, st.floats(0.0, 1.0))
def test_quantile_matches_numpy_linear(xs, q):
    assert quantile_linear(xs, q) == pytest.approx(float(np.quantile(xs, q)), abs=1e-9)


def test_calibrate_quantile_and_fallback():
    scales = calibrate({"files": [20, 4, 10], "git": [], "one": [3]})
    assert scales == {"files": pytest.approx(18.0), "git": 82.0, "one": 3.0}
    assert scales.fallback == 82.0 and scales.quantile == 0.9
    # A family never seen at calibration gets the fallback too.
    assert scale_for("unseen", scales) == 82.0
    assert scale_for("unseen", scales, fallback=40.0) == 40.0
    assert scale_for("unseen", {"files": 18.0}) == 82.0  # a plain dict: the default fallback
    other = calibrate({"files": [20, 4, 10], "git": []}, quantile=0.5, fallback=50)
    assert other == {"files": 10.0, "git": 50.0}
    assert scale_for("unseen", other) == 50.0


def test_json_round_trip(tmp_path):
    scales = calibrate({"files": [20, 4, 10], "git": [40, 52]}, quantile=0.75, fallback=60)
    path = tmp_path / "run" / "reward_scales.json"
    save_scales(scales, path)
    loaded = load_scales(path)
    assert loaded == scales and isinstance(loaded, Scales)
    assert loaded.fallback == 60.0 and loaded.quantile == 0.75
    doc = json.loads(path.read_text())
    assert doc["fallback"] == 60.0 and doc["quantile"] == 0.75 and "files" in doc["D_f"]
    save_scales({"a": 2.0}, path)  # a plain dict is saved with the default fallback
    assert load_scales(path).fallback == 82.0


def test_load_rejects_malformed_files(tmp_path):
    path = tmp_path / "s.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_scales(path)
    path.write_text(json.dumps({"format": "minirsi.fdr.scales/1", "quantile": 0.9,
                                "fallback": 82, "D_f": {"files": -3}}))
    with pytest.raises(ValueError, match=r"s.json.*files.*-3"):
        load_scales(path)
    path.write_text(json.dumps({"D_f": {}}))
    with pytest.raises(ValueError, match="format"):
        load_scales(path)


@pytest.mark.parametrize("call, match", [
    (lambda: calibrate({"files": [3, -1]}), "-1"),
    (lambda: calibrate({"": [3]}), "non-empty"),
    (lambda: calibrate({"files": [3, math.nan]}), "nan"),
    (lambda: calibrate({"files": [3]}, quantile=1.5), "quantile = 1.5"),
    (lambda: calibrate({"files": [3]}, quantile=math.nan), "quantile = nan"),
    (lambda: calibrate({"files": [3]}, fallback=0), "fallback = 0"),
    (lambda: calibrate({"files": [0, 0]}), "must be > 0"),
    (lambda: family_dense_reward(5, "files", {"files": 10.0}, total=4), "passed = 5 > total"),
    (lambda: family_dense_reward(-2, "files", {"files": 10.0}), "passed = -2"),
    (lambda: family_dense_reward(math.nan, "files", {"files": 10.0}), "passed = nan"),
    (lambda: family_dense_reward(2, "", {"files": 10.0}), "non-empty"),
    (lambda: success_prioritized_reward(True, 3, "f", {"f": 0.0}), "D_f for family 'f'"),
    (lambda: success_prioritized_reward(math.nan, 3, "f", {"f": 5.0}), "success = nan"),
    (lambda: success_prioritized_reward(False, 9, "f", {"f": 5.0}, total=8), "passed = 9"),
])
def test_bad_input_raises_naming_the_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --------------------------------------------------------------------------- FDR and SPR


@pytest.mark.parametrize("passed, family, expected", [
    (0, "files", 0.0),      # nothing passed
    (9, "files", 0.5),      # D_files = 18 (counts [20, 4, 10] at q = 0.9): 9 / 18
    (18, "files", 1.0),     # P = D_f
    (27, "files", 1.5),     # 27 / 18, not clipped
    (5, "one", 5 / 3),      # a family of one calibration task: D = its count, 3
    (41, "git", 0.5),       # a family with no calibration tasks: the fallback, 41 / 82
    (41, "unseen", 0.5),    # a family never calibrated: the fallback too
])
def test_fdr_hand_worked(passed, family, expected):
    scales = calibrate({"files": [20, 4, 10], "git": [], "one": [3]})
    assert family_dense_reward(passed, family, scales) == pytest.approx(expected, abs=1e-12)


@SETTINGS
@given(st.integers(0, 500), st.integers(0, 500), st.integers(1, 200))
def test_fdr_is_linear_in_P_and_one_at_P_equal_D(P1, P2, D):
    # FDR(P1 + P2) = FDR(P1) + FDR(P2) (a linear, unclipped reward) and FDR(D_f) = 1.
    scales = {"f": float(D)}
    fdr = lambda P: family_dense_reward(P, "f", scales)  # noqa: E731
    assert fdr(P1 + P2) == pytest.approx(fdr(P1) + fdr(P2), rel=1e-12, abs=1e-12)
    assert fdr(D) == 1.0


def test_fdr_is_not_clipped():
    # 30 passed checks in a family with D_f = 18: a failure scoring 30/18 = 1.67 >= 1.
    assert family_dense_reward(30, "files", {"files": 18.0}) == pytest.approx(30 / 18)


def test_spr_hand_worked():
    # D' = 10: failure with P = 10 -> 0 + 10 / 20 = 0.5; success with P = 30 -> 1 + 30/40.
    scales = {"f": 10.0}
    assert success_prioritized_reward(False, 10, "f", scales) == 0.5
    assert success_prioritized_reward(True, 30, "f", scales) == 1.75
    # P = 0: SPR = S.
    assert success_prioritized_reward(False, 0, "f", scales) == 0.0
    assert success_prioritized_reward(True, 0, "f", scales) == 1.0
    # D'_f overrides D_f when given: P = 10, D' = 30 -> 10 / 40.
    assert success_prioritized_reward(False, 10, "f", scales, {"f": 30.0}) == 0.25


@SETTINGS
@given(st.integers(0, 10**6), st.floats(1e-3, 1e4), st.booleans())
def test_spr_failure_below_1_success_at_least_1(P, D, success):
    r = success_prioritized_reward(success, P, "f", {"f": D})
    if success:
        assert r >= 1.0
    else:
        assert 0.0 <= r < 1.0


@SETTINGS
@given(st.integers(0, 10**4), st.integers(1, 100), st.floats(1e-2, 1e3), st.booleans())
def test_spr_monotone_in_P(P, step, D, success):
    lo = success_prioritized_reward(success, P, "f", {"f": D})
    hi = success_prioritized_reward(success, P + step, "f", {"f": D})
    assert hi > lo


# --------------------------------------------------------------------------- audit


def runs_hand_made():
    """Six runs, family 'files' with D_f = 10.

    run  S  P   C   all executed passed   FDR = P/10   SPR = S + P/(P+10)
    0    1  10  10  yes                    1.0          1 + 10/20 = 1.5
    1    1  5   10  no                     0.5          1 + 5/15  = 1.3333
    2    0  12  20  no                     1.2          12/22     = 0.5455
    3    0  10  10  yes (gate still fails) 1.0          10/20     = 0.5
    4    0  0   10  no                     0.0          0
    5    0  3   10  no                     0.3          3/13      = 0.2308
    FDR: mass 4.0, failed 2.5 -> share 62.5%; failures >= 1: runs 2 and 3.
    SPR: mass 1.5 + 1.3333 + 0.5455 + 0.5 + 0 + 0.2308 = 4.1096, failed 1.2762 -> 31.06%.
    Failures passing every executed check: run 3 only.
    """
    def checks(n_pass, n_fail):
        return {f"p{i}": "passed" for i in range(n_pass)} | {
            f"f{i}": "failed" for i in range(n_fail)}

    def episode(S, P, C, all_passed):
        return Episode(task_id="t", family="files", difficulty="easy", token_ids=[1],
                       logprobs=[None], action_mask=[1], turn_ids=[0], turns=1, success=S,
                       passed=P, total=C, checks=checks(P, 0 if all_passed else C - P))

    return [
        episode(True, 10, 10, True),
        {"success": True, "passed": 5, "total": 10, "family": "files",
         "executed_all_passed": False},
        episode(False, 12, 20, False),
        {"success": False, "passed": 10, "total": 10, "family": "files",
         "checks": {"a": "passed", "b": "skipped"}},
        episode(False, 0, 10, False),
        episode(False, 3, 10, False),
    ]


def test_audit_hand_made():
    fdr, spr = audit_fdr_spr(runs_hand_made(), {"files": 10.0})
    assert (fdr.runs, fdr.successes, fdr.failures) == (6, 2, 4)
    assert fdr.reward_mass == pytest.approx(4.0)
    assert fdr.failed_share == pytest.approx(2.5 / 4.0)
    assert fdr.failures_scoring_at_least_1 == 2
    spr_mass = 1.5 + 1 + 5 / 15 + 12 / 22 + 0.5 + 3 / 13
    assert spr.reward_mass == pytest.approx(spr_mass)
    assert spr.failed_share == pytest.approx((12 / 22 + 0.5 + 3 / 13) / spr_mass)
    assert spr.failures_scoring_at_least_1 == 0
    assert fdr.failures_all_executed_passed == spr.failures_all_executed_passed == 1
    text = fdr.format()
    assert "62.50%" in text and "FDR" in text and "scoring >= 1" in text


def test_audit_custom_reward_and_edge_cases():
    report = audit(runs_hand_made(), lambda run: 0.0, name="zero")
    assert isinstance(report, AuditReport) and report.failed_share == 0.0
    with pytest.raises(ValueError, match="run 0.*NaN"):
        audit(runs_hand_made(), lambda run: math.nan)
    with pytest.raises(ValueError, match=r"run 1.*passed = 7 > total = 3"):
        audit([runs_hand_made()[0], {"success": False, "passed": 7, "total": 3,
                                     "family": "files", "executed_all_passed": False}],
              lambda run: 1.0)
    with pytest.raises(ValueError, match="missing field"):
        audit([{"success": True}], lambda run: 1.0)

"""Reports from a fabricated run directory: the tables, the PNGs, and the reward audit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minirsi.core import fdr
from minirsi.core.episode import Episode
from minirsi.run import report

PNG = b"\x89PNG\r\n\x1a\n"


def suite(m: float, easy: float, hard: float, long: bool = False) -> dict:
    r = {"mean_at_3": m, "n_tasks": 4, "n_episodes": 12, "by_difficulty": {"easy": easy, "hard": hard},
         "n_by_difficulty": {"easy": 3, "hard": 1}}
    if long:
        r.update(process_reward=0.25 + m / 10, strict_completion={"completed": int(4 * m), "tasks": 4})
    return r


RESULTS = {
    "base": {"core": suite(0.20, 0.25, 0.05), "long": suite(0.0, 0.0, 0.0, long=True)},
    "rpr2": {"core": suite(0.55, 0.60, 0.40), "long": suite(0.25, 0.3, 0.1, long=True)},
    "direct_ppo": {"core": suite(0.30, 0.35, 0.15), "long": suite(0.0, 0.0, 0.0, long=True)},
}


def fabricate_run(root: Path) -> Path:
    (root / "stages" / "00-base").mkdir(parents=True)
    (root / "stages" / "05-rpr2").mkdir(parents=True)
    (root / "results.json").write_text(json.dumps(RESULTS))
    (root / "stages" / "00-base" / "DONE.json").write_text(json.dumps({"stage": "base", "label": "Base", "wall_s": 60}))
    (root / "stages" / "05-rpr2" / "DONE.json").write_text(json.dumps({"stage": "rpr2", "label": "RPR-2", "wall_s": 90}))
    (root / "stages" / "05-rpr2" / "eval.json").write_text(json.dumps({"results": RESULTS["rpr2"], "wall_s": 30}))
    lines = []
    for stage in ("warmup", "rpr2"):
        for step in range(4):
            rec = {"stage": stage, "step": step, "explained_variance": -0.5 + 0.2 * step}
            if stage == "rpr2":
                rec.update(dense_reward=0.1 * step, binary_reward=0.05 * step, turns=4 - step * 0.5, logprob_gap=5e-3)
            lines.append(json.dumps(rec))
    (root / "metrics.jsonl").write_text("\n".join(lines) + "\n{torn")
    return root


def test_results_table_rows_and_mean():
    t = report.results_table(RESULTS)
    lines = t.splitlines()
    assert lines[0] == "| Stage | core | long | Mean |"
    assert lines[2] == "| Base | 20.0 | 0.0 | 10.0 |"
    assert lines[3] == "| RPR-2 | 55.0 | 25.0 | 40.0 |"
    assert lines[4].startswith("| Direct PPO | 30.0")


def test_difficulty_is_pooled_by_task_count():
    # RPR-2 easy: core 0.60 (3 tasks) and long 0.30 (3 tasks) -> 0.45; hard: (0.40 + 0.10) / 2
    assert report.pooled_by_difficulty(RESULTS["rpr2"]) == pytest.approx({"easy": 0.45, "hard": 0.25})
    t = report.difficulty_table(RESULTS)
    assert "easy (n=6)" in t and "| RPR-2 | 45.0 | 25.0 |" in t


def test_write_report_makes_tables_and_pngs(tmp_path):
    run = fabricate_run(tmp_path / "run")
    path = report.write_report(run)
    text = path.read_text()
    assert "| Stage | core | long | Mean |" in text
    assert "| RPR-2 | 55.0 | 25.0 | 40.0 |" in text
    assert "## By difficulty" in text and "| Base | 12.5 | 2.5 |" in text  # easy (0.25*3 + 0*3) / 6, hard (0.05 + 0) / 2
    assert "| RPR-2 | 0.275 | 1/4 |" in text  # process reward 0.25 + 0.025, strict completion
    assert "| 05-rpr2 | RPR-2 | 90 | 30 |" in text
    for name in ("success.png", "signals.png"):
        png = run / name
        assert png.read_bytes()[:8] == PNG and png.stat().st_size > 5000
        assert f"({name})" in text


def test_report_cli_and_missing_results(tmp_path, capsys):
    assert report.cli([str(tmp_path)], command="report") == 2
    assert "results.json" in capsys.readouterr().err
    run = fabricate_run(tmp_path / "run")
    assert report.cli([str(run)], command="report") == 0
    assert (run / "report.md").is_file()


def ep(success: bool, passed: int, total: int, family: str = "files", checks: dict | None = None) -> Episode:
    return Episode(task_id="t", family=family, difficulty="easy", token_ids=[1, 2], logprobs=[None, -0.1],
                   action_mask=[0, 1], turn_ids=[0, 0], turns=1, success=success, passed=passed, total=total,
                   checks=checks or {})


def fabricate_episodes(run: Path) -> None:
    (run / "stages" / "03-rpr1").mkdir(parents=True)
    fdr.save_scales({"files": 4.0}, run / "calibration.json")
    eps = [
        ep(True, 4, 4, checks={"a": "passed", "b": "passed"}),    # FDR 1.0   SPR 1 + 4/8 = 1.5
        ep(False, 4, 5, checks={"a": "passed", "b": "passed"}),   # FDR 1.0   SPR 4/8 = 0.5; all executed passed
        ep(False, 2, 5, checks={"a": "passed", "b": "failed"}),   # FDR 0.5   SPR 2/6 = 0.333
        ep(False, 0, 5, checks={"a": "failed"}),                  # FDR 0     SPR 0
    ]
    (run / "stages" / "03-rpr1" / "episodes.jsonl").write_text("".join(e.to_json() + "\n" for e in eps))


def test_audit_numbers_on_fabricated_episodes(tmp_path, capsys):
    run = tmp_path / "run"
    fabricate_episodes(run)
    a = report.audit_run(run)
    assert a["episodes"] == 4
    # FDR mass: success 1.0, failures 1.0 + 0.5 + 0 -> failed share 1.5 / 2.5 = 60%
    assert a["fdr"]["failed_share"] == pytest.approx(0.6)
    assert a["fdr"]["failures_scoring_at_least_1"] == 1
    # SPR mass: success 1.5, failures 0.5 + 1/3 -> failed share (5/6) / (1.5 + 5/6)
    assert a["spr"]["failed_share"] == pytest.approx((5 / 6) / (1.5 + 5 / 6))
    assert a["spr"]["failures_scoring_at_least_1"] == 0
    assert a["fdr"]["failures_all_executed_passed"] == a["spr"]["failures_all_executed_passed"] == 1
    assert report.cli([str(run)], command="audit") == 0
    out = capsys.readouterr().out
    assert "60.00%" in out and "failures scoring >= 1" in out


def test_audit_of_a_dir_without_calibration_is_a_clear_error(tmp_path, capsys):
    assert report.cli([str(tmp_path)], command="audit") == 2
    assert "calibration.json" in capsys.readouterr().err


def test_pool_table_reads_the_uniform_estimate_and_falls_back_to_the_drawn_success():
    """An edge-sampled stage logs both the drawn episodes' success and its estimate for a
    uniform draw of the pool: the table shows the estimate; a run logged before it, S."""
    edge = [{"stage": "rpr1", "phase": "joint", "step": i, "binary_reward": 0.9, "pool_success": 0.1 * i}
            for i in range(6)]
    old = [{"stage": "rpr2", "phase": "calibrate", "step": i, "binary_reward": 0.5} for i in range(3)]
    table = report.pool_table(edge + old, {"rpr1": "RPR-1", "rpr2": "RPR-2"})
    assert "| RPR-1 | 6 | 10.0 | 40.0 | +10.00 (0.00) |" in table  # a straight line: no error
    assert "| RPR-2 | 3 | 50.0 | 50.0 | +0.00 (0.00) |" in table


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=3, max_size=20))
def test_the_pool_trend_is_the_least_squares_slope_and_its_standard_error(ys):
    x = np.arange(len(ys), dtype=float)
    (slope, _), cov = np.polyfit(x, ys, 1, cov="unscaled")
    resid = np.asarray(ys) - np.polyval([slope, _], x)
    se = float(np.sqrt(cov[0, 0] * (resid @ resid) / (len(ys) - 2)))
    got = report.trend(ys)
    assert got[0] == pytest.approx(slope, abs=1e-9) and got[1] == pytest.approx(se, abs=1e-9)


def test_a_falling_stage_and_a_noisy_flat_one_are_told_apart():
    ys = [0.45, 0.46, 0.36, 0.54, 0.38, 0.35, 0.47, 0.22, 0.30, 0.40, 0.38, 0.28, 0.36, 0.42, 0.42, 0.30]
    slope, se = report.trend(ys)  # seed 2's RPR-2 of the README's table, rounded
    assert -0.01 < slope < 0 and abs(slope) < 2 * se  # first 3 -> last 3 falls 4 points; the slope: flat
    assert report.trend([0.2, 0.3])[1] is None and report.trend([0.2]) == (0.0, None)

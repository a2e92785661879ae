"""The ladder benches run start to end on a tiny setting, so they cannot rot between the sessions
that size a preset with them (bench/ladder.py once crashed on its first step, after a 1,000-task
measurement, because a calibration step logs no ``approx_kl``; it once sampled RPR's episodes at
the rollout temperature while the trainer scored them at ``rpr1.temperature``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minirsi.run.evaluate import generate_toy_suites

ROOT = Path(__file__).parents[1]
BASE = ROOT / "minirsi" / "presets" / "toy-base"


def _bench(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, f"bench/{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.timeout(600)
def test_ladder_runs_calibration_and_joint_steps(tmp_path: Path):
    generate_toy_suites(tmp_path / "tasks", ["train"], {"train": 48}, seed=0)
    out = tmp_path / "ladder"
    proc = _bench("ladder.py", "--actor", str(BASE), "--tasks", str(tmp_path / "tasks" / "train"), "--pool", "2",
                  "--preset", "smoke", "--final", "1", "--out", str(out),
                  "rpr1.steps=1", "rpr1.episodes_per_step=8", "warmup.tasks=2", "rpr1.temperature=1.5")
    got = json.loads((out / "ladder.json").read_text())
    assert [h["phase"] for h in got["history"]] == ["calibrate", "joint"]
    assert len(got["pool"]) == 2 and set(got["before"]) == set(got["after"]) == set(got["pool"])
    assert "pool success measured with 1 samples a task" in proc.stdout
    # RPR's episodes are sampled at rpr1.temperature: the trainer's log-probs match the sampler's
    assert max(h["logprob_gap"] for h in got["history"]) < 1e-4, [h["logprob_gap"] for h in got["history"]]

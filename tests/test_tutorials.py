"""Every tutorial runs, start to end, so none can rot (STYLE.md: tutorials are a course that runs).

Each script asserts what it teaches; here it only has to exit 0. They run as subprocesses, the
way a learner runs them, with one torch thread (faster for tiny models on a shared machine).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TUTORIALS = sorted((Path(__file__).parents[1] / "tutorials").glob("[0-9][0-9]_*.py"))


def test_the_course_covers_every_stage():
    """TB-GAE, rewards, sandbox, rollout, one RPR update, value alignment, a sharded update, RSR,
    and the five-stage recipe with its report: lessons 01-09."""
    assert [p.name[:2] for p in TUTORIALS][:9] == [f"{i:02d}" for i in range(1, 10)]


@pytest.mark.parametrize("script", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_runs(script: Path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          cwd=script.parents[1], env=env)
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

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


@pytest.mark.timeout(600)
def test_names_bench_counts_what_pretrain_measures():
    """bench/names.py splits the held-out name accuracy that ``minirsi pretrain`` records: its
    right names over all names is that accuracy, on the same sessions."""
    from minirsi.engine.models import load_actor
    from minirsi.run.pretrain import PretrainConfig, held_out_name_accuracy

    proc = _bench("names.py", "--model", str(BASE), "--sessions", "12", "--json")
    got = json.loads(proc.stdout)
    right = sum(n for k, n in got["kinds"].items() if k.endswith(": right"))
    total = sum(got["kinds"].values())
    model, tok = load_actor(BASE)
    want = held_out_name_accuracy(model.eval(), tok, PretrainConfig(val_sessions=12, seed=0))
    assert total == want["name_tokens"] and total > 0
    assert right / total == pytest.approx(want["name_accuracy"], abs=1e-9)
    comment = sum(n for k, n in got["kinds"].items() if k.startswith("comment"))
    assert sum(b for _, b in got["comment_by_instruction_line"].values()) == comment
    assert sum(b for _, b in got["comment_by_previous_comment"].values()) == comment
    assert sum(b for _, b in got["comment_by_previous_comment_and_word_before"].values()) == comment
    # the names of comments that restate the line the previous numbered comment restated,
    # counted from the sessions' text
    import re

    from minirsi.run.pretrain import held_out_sessions, name_words

    again, words = 0, name_words()
    for s in held_out_sessions(PretrainConfig(val_sessions=12, seed=0)):
        prev = None
        for t in s.turns:
            m = re.match(r"#\s*(\d+)\.", t.commands)
            if m:
                if m.group(1) == prev:
                    again += sum(w in words for w in re.findall(r"[a-z]+", t.commands.split("\n")[0]))
                prev = m.group(1)
    assert got["comment_by_previous_comment"]["the previous comment's line again"][1] == again > 0


def test_names_bench_word_before_is_what_an_induction_head_would_find():
    """``word_before``: what followed the name's previous token earlier in the context."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("names_bench", Path(__file__).parents[1] / "bench" / "names.py")
    names = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(names)
    #      0  1  2  3  4  5 | 6  7   (the line starts at 6; name at 7, the token before it is 5)
    ids = [9, 5, 1, 5, 1, 5, 5, 1]
    assert names.word_before(ids, 7, 6) == "only this name"  # 5 -> 1 at 2 and 4 (5 at 5 is followed by the line)
    assert names.word_before(ids, 7, 7) == "another token too"  # 5 -> 5 at 6 as well
    assert names.word_before([9, 4, 5, 1], 3, 3) == "nothing"  # 5 occurs only right before the name
    assert names.word_before([5, 2, 7, 5, 1], 4, 3) == "another token too"  # 5 -> 2 at 1


@pytest.mark.timeout(600)
def test_groups_bench_counts_every_group_once(tmp_path: Path):
    generate_toy_suites(tmp_path / "tasks", ["train"], {"train": 12}, seed=0)
    proc = _bench("groups.py", "--actor", str(BASE), "--tasks", str(tmp_path / "tasks" / "train"), "--n-tasks", "3",
                  "--group", "2", "--temperatures", "1,0", "--preset", "smoke", "--json")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["temperature"] for r in rows] == [1.0, 0.0]
    for r in rows:
        assert sum(r["by_successes"].values()) == r["groups"] == 3
        assert r["mixed"] == r["by_successes"]["1"]
        assert r["success"] == pytest.approx((r["by_successes"]["1"] + 2 * r["by_successes"]["2"]) / 6)
    assert rows[1]["mixed"] == 0  # greedy: a task's two samples are the same episode

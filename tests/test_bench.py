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
    assert sum(b for _, b in got["by_source"].values()) == total
    # the names of commands right after a step's line was printed that stand on that line,
    # counted from the sessions' text
    import re

    from minirsi.run.pretrain import held_out_sessions, name_words

    on_line, words = 0, name_words()
    for s in held_out_sessions(PretrainConfig(val_sessions=12, seed=0)):
        for a, b in zip(s.turns, s.turns[1:]):
            if a.command.startswith("sed -n "):
                said = set(re.findall(r"[a-z]+", a.output))
                on_line += sum(w in words and w in said for w in re.findall(r"[a-z]+", b.command))
    assert got["by_source"]["the step's line just above"][1] == on_line > 0


def test_names_bench_source_is_where_the_name_stands():
    """``source``: where a name stands in the context before it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("names_bench", Path(__file__).parents[1] / "bench" / "names.py")
    names = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(names)
    head = "Do the 2 numbered steps in steps.txt.\n```bash\nls\n```\ncat.txt\n[exit 0]\n"
    read = "```bash\nsed -n 1p steps.txt\n```\n1. Copy cat.txt to dog.txt.\n[exit 0]\n"
    assert names.source("dog", head + read + "```bash\ncp cat.txt ") == "the step's line just above"
    assert names.source("cat", head + read + "```bash\ncp cat.txt dog.txt && rm ") == "this block"
    assert names.source("cat", head + "```bash\n") == "another output just above"
    assert names.source("cat", head + read + "```bash\ncp cat.txt dog.txt\n```\n[exit 0]\n```bash\n") == "further up"
    assert names.source("dog", head + "```bash\n") == "nowhere"
    assert names.source("cat", head + "```bash\ncp bobcat.txt ") == "another output just above"  # not inside a word


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


@pytest.mark.timeout(600)
def test_toy_cpu_discount_never_pays_a_pool_task_to_stop_at_once(tmp_path: Path):
    """bench/floor.py: under the toy-cpu preset's gamma_turn and rewards, stopping at once earns
    less than the right run on every one of the training pool's first 200 tasks (at 0.9 under FDR
    it earned as much on 41 of them, and RPR-1 learnt to stop: docs/experiments.md, "What doing
    nothing earns")."""
    out = tmp_path / "floor.json"
    _bench("floor.py", "--n", "200", "--json", str(out))
    got = json.loads(out.read_text())
    assert got["grid"]["0.9"]["fdr"] > 0  # the measure can see the failure it guards against
    assert got["preset"] == {"rpr1": 0, "rpr2": 0}, got["preset"]
    assert all(0 <= r["P0"] < r["C"] for r in got["rows"])  # an untouched sandbox never passes a task

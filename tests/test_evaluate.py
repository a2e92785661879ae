"""Mean@k scoring: hand-worked cases of ``summarise``, and ``evaluate`` driving the rollout
engine (replaced here by a fake that fabricates episodes) with k attempts per task."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minirsi.core.episode import Episode
from minirsi.run import evaluate as ev


def ep(task: str, success: bool, passed: int = 0, total: int = 4, difficulty: str = "easy", turns: int = 2) -> Episode:
    return Episode(task_id=task, family="files", difficulty=difficulty, token_ids=[1, 2], logprobs=[None, -0.1],
                   action_mask=[0, 1], turn_ids=[0, 0], turns=turns, success=success, passed=passed, total=total)


def test_mean_at_3_hand_worked():
    # task a: 2/3, task b: 0/3, task c (hard): 3/3 -> Mean@3 = (2/3 + 0 + 1) / 3 = 5/9
    eps = [ep("a", True), ep("a", True), ep("a", False),
           ep("b", False), ep("b", False), ep("b", False),
           ep("c", True, difficulty="hard"), ep("c", True, difficulty="hard"), ep("c", True, difficulty="hard")]
    r = ev.summarise(eps, k=3)
    assert r["mean_at_3"] == pytest.approx(5 / 9)
    assert r["by_difficulty"] == pytest.approx({"easy": 1 / 3, "hard": 1.0})  # easy: (2/3 + 0) / 2
    assert r["n_by_difficulty"] == {"easy": 2, "hard": 1}
    assert (r["n_tasks"], r["n_episodes"]) == (3, 9)
    assert "process_reward" not in r


def test_long_suite_reports_process_reward_and_strict_completion():
    # P/C per attempt: a: 4/4, 4/4, 2/4 ; b: 1/4 x3 -> mean = (1 + 1 + .5 + .75) / 6 = 3.25 / 6
    eps = [ep("a", True, 4), ep("a", True, 4), ep("a", False, 2),
           ep("b", False, 1), ep("b", False, 1), ep("b", False, 1)]
    r = ev.summarise(eps, k=3, long_horizon=True)
    assert r["process_reward"] == pytest.approx(3.25 / 6)
    assert r["strict_completion"] == {"completed": 1, "tasks": 2}  # a passes the gate in 2 of 3


def test_a_task_with_fewer_attempts_counts_once():
    r = ev.summarise([ep("a", True), ep("b", False), ep("b", True), ep("b", True)], k=3)
    assert r["mean_at_3"] == pytest.approx((1 + 2 / 3) / 2)


def test_paired_difference_hand_worked():
    # per-task differences: a 1/3 -> 3/3 (+2/3), b 0 -> 1/3 (+1/3), c 1 -> 1 (0): mean 1/3,
    # var = ((1/3)^2 + 0 + (1/3)^2) / 2 = 1/9, stderr = sqrt(1/9 / 3)
    before = [ep("a", True), ep("a", False), ep("a", False), ep("b", False), ep("b", False), ep("b", False),
              ep("c", True), ep("c", True), ep("c", True)]
    after = [ep("a", True), ep("a", True), ep("a", True), ep("b", True), ep("b", False), ep("b", False),
             ep("c", True), ep("c", True), ep("c", True)]
    r = ev.paired(before, after)
    assert r["diff"] == pytest.approx(1 / 3) and r["n_tasks"] == 3
    assert r["stderr"] == pytest.approx((1 / 27) ** 0.5)
    # pairing removes the spread both evaluations share: smaller than either side's stderr
    assert r["stderr"] < ev.summarise(after, k=3)["stderr"]
    with pytest.raises(ValueError, match="different tasks"):
        ev.paired(before, after[:6])


def test_paired_by_groups_pairs_each_subset_of_tasks():
    # a: 0 -> 1 and b: 1 -> 1 in group x; c: 1 -> 0 in group y; group z holds no task
    before = [ep("a", False), ep("b", True), ep("c", True), ep("c", True)]
    after = [ep("a", True), ep("b", True), ep("c", False), ep("c", False)]
    rows = ev.paired_by(before, after, {"all": lambda t: True, "x": lambda t: t in "ab",
                                        "y": lambda t: t == "c", "z": lambda t: t == "d"})
    assert list(rows) == ["all", "x", "y"]
    assert rows["x"] == pytest.approx({"before": 0.5, "after": 1.0, "diff": 0.5, "stderr": 0.5, "n_tasks": 2})
    assert rows["y"] == pytest.approx({"before": 1.0, "after": 0.0, "diff": -1.0, "stderr": 0.0, "n_tasks": 1})
    assert rows["all"]["diff"] == pytest.approx(ev.paired(before, after)["diff"])
    # the success rates are over episodes (c counts twice), the difference over tasks
    assert (rows["all"]["before"], rows["all"]["after"]) == (0.75, 0.5)
    with pytest.raises(ValueError, match="different tasks"):
        ev.paired_by(before, after[:1], {"all": lambda t: True})


def test_no_episodes_is_an_error():
    with pytest.raises(ValueError, match="no episodes"):
        ev.summarise([], k=3)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=1, max_size=8), st.randoms())
def test_with_k_attempts_each_mean_at_k_is_the_pooled_success_rate_in_any_order(outcomes, rng):
    # Not the code's formula (a mean of per-task means) restated: when every task has exactly k
    # attempts it must equal the plain share of successful episodes, however the episodes are
    # ordered. (Where the counts differ the two part: test_a_task_with_fewer_attempts_counts_once.)
    eps = [ep(f"t{i}", s) for i, row in enumerate(outcomes) for s in row]
    rng.shuffle(eps)
    r = ev.summarise(eps, k=3)
    successes = sum(sum(row) for row in outcomes)
    assert r["mean_at_3"] == pytest.approx(successes / (3 * len(outcomes)))
    assert (r["n_tasks"], r["n_episodes"]) == (len(outcomes), 3 * len(outcomes))


def test_evaluate_runs_k_attempts_per_task_and_writes_episodes(tmp_path, monkeypatch):
    from minirsi.engine import rollout

    calls = []

    def fake_collect(tasks, sampler, tokenizer, cfg, out_path=None, progress=True, **kw):
        calls.append(([t.task_id for t in tasks], cfg.seed))
        return [ep(t.task_id, t.task_id.endswith("1"), difficulty=t.difficulty) for t in tasks]

    class Actor:
        training = True

        def eval(self):
            self.training = False
            return self

        def train(self, mode=True):
            self.training = mode
            return self

    monkeypatch.setattr(rollout, "collect", fake_collect)
    monkeypatch.setattr("minirsi.engine.sampler.HFSampler", lambda model, tok: SimpleNamespace(model=model))
    task = lambda i, d="easy": SimpleNamespace(task_id=f"t{i}", difficulty=d)  # noqa: E731
    suites = {"core": [task(0), task(1)], "long": [task(2, "hard")]}
    actor = Actor()
    res = ev.evaluate(actor, SimpleNamespace(), suites, k=3, out_dir=tmp_path, seed=7)
    # One batched collection: every suite's tasks, each repeated k times, with the given seed.
    assert calls == [(["t0", "t0", "t0", "t1", "t1", "t1", "t2", "t2", "t2"], 7)]
    assert res["core"]["mean_at_3"] == pytest.approx(0.5) and res["long"]["mean_at_3"] == 0.0
    assert res["core"]["n_episodes"] == 6 and res["long"]["n_episodes"] == 3
    assert "process_reward" in res["long"] and "process_reward" not in res["core"]
    assert len((tmp_path / "core.jsonl").read_text().splitlines()) == 6
    assert len((tmp_path / "long.jsonl").read_text().splitlines()) == 3
    assert actor.training  # left in the mode it came in


def test_load_suites_names_a_missing_suite(tmp_path):
    with pytest.raises(ValueError, match="suite 'core'"):
        ev.load_suites(tmp_path, ["core"])


def test_cli_missing_suite_dir_is_a_clear_error(tmp_path, capsys):
    rc = ev.cli(["--model", str(tmp_path), "--tasks", str(tmp_path / "nothing"), "--suites", "core"])
    assert rc == 2
    assert "suite 'core'" in capsys.readouterr().err


def test_cli_out_must_be_a_json_file_and_the_episodes_go_beside_it(tmp_path, capsys, monkeypatch):
    import minirsi.engine.models

    monkeypatch.setattr(ev, "load_suites", lambda root, names: {})
    monkeypatch.setattr(minirsi.engine.models, "load_actor", lambda path: (None, None))
    seen = {}
    monkeypatch.setattr(ev, "evaluate", lambda *a, out_dir, **k: seen.setdefault("out_dir", out_dir) and {"core": {}})
    args = ["--model", str(tmp_path), "--tasks", str(tmp_path), "--suites", "core"]
    # without .json the episodes' folder and the JSON file would be one path: refused before any work
    assert ev.cli(args + ["--out", str(tmp_path / "base")]) == 2
    assert "must name a .json file" in capsys.readouterr().err and "out_dir" not in seen
    assert ev.cli(args + ["--out", str(tmp_path / "base.json")]) == 0
    assert seen["out_dir"] == tmp_path / "base"
    assert (tmp_path / "base.json").is_file()


def test_cli_passes_temperature_and_rejects_a_negative_one(tmp_path, capsys, monkeypatch):
    import minirsi.engine.models

    seen = {}
    monkeypatch.setattr(ev, "load_suites", lambda root, names: {})
    monkeypatch.setattr(minirsi.engine.models, "load_actor", lambda path: (None, None))
    monkeypatch.setattr(ev, "evaluate", lambda *a, rollout_cfg, **k: seen.setdefault("cfg", rollout_cfg) and {})
    args = ["--model", str(tmp_path), "--tasks", str(tmp_path), "--suites", "core"]
    assert ev.cli(args + ["--temperature", "0"]) == 0
    assert seen.pop("cfg").temperature == 0.0
    assert ev.cli(args) == 0
    assert seen.pop("cfg").temperature == 1.0  # the recipe's evaluation temperature by default
    assert ev.cli(args + ["--temperature", "-1"]) == 2
    assert "rollout.temperature=-1.0" in capsys.readouterr().err

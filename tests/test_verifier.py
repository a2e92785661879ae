"""The protected verifier: S from reward.txt, P and C from junit XML, hygiene excluded; the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minirsi.env.sandbox import open_sandbox
from minirsi.env.task_cli import cli, run_empty, run_oracle
from minirsi.env.tasks import load_task
from minirsi.env.verifier import parse_junit, static_checks, verify

FIXTURES = Path(__file__).parent / "fixtures" / "tasks"
HELLO = load_task(FIXTURES / "good" / "hello")
REPO = Path(__file__).resolve().parents[1]

JUNIT = b"""<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="6">
  <testcase classname="test_outputs" name="test_a" time="0.01"/>
  <testcase classname="test_outputs" name="test_b" time="0.01"><failure message="x">boom</failure></testcase>
  <testcase classname="test_outputs" name="test_c" time="0.01"><skipped message="later"/></testcase>
  <testcase classname="test_outputs" name="test_d" time="0.01"/>
  <testcase classname="test_outputs" name="test_d" time="0.01"><error message="teardown">bad</error></testcase>
  <testcase classname="tests.test_outputs.TestGroup" name="test_e[1]" time="0.01">
    <properties><property name="minirsi.hygiene" value="1"/></properties></testcase>
  <testcase classname="test_outputs" name="test_hygiene_named" time="0.01"/>
</testsuite></testsuites>"""


def test_parse_junit_outcomes_and_hygiene():
    checks, hygiene = parse_junit(JUNIT)
    assert checks == {
        "test_outputs::test_a": "passed",
        "test_outputs::test_b": "failed",
        "test_outputs::test_c": "skipped",
        "test_outputs::test_d": "error",  # a teardown error after a pass: the worse outcome wins
        "test_outputs::TestGroup::test_e[1]": "passed",
        "test_outputs::test_hygiene_named": "passed",
    }
    assert hygiene == {"test_outputs::TestGroup::test_e[1]", "test_outputs::test_hygiene_named"}


def test_static_checks(tmp_path):
    (tmp_path / "test_outputs.py").write_text(
        "import pytest\n"
        "def test_a(): pass\n"
        "@pytest.mark.hygiene\n"
        "def test_b(): pass\n"
        "class TestG:\n"
        "    def test_c(self): pass\n"
        "def helper(): pass\n")
    assert static_checks(tmp_path) == {"test_outputs::test_a": False, "test_outputs::test_b": True,
                                       "test_outputs::TestG::test_c": False}


def test_static_checks_from_many_threads_and_on_unparsable_files(tmp_path):
    """The rollout verifies episodes on many threads at once, and CPython 3.11's AST constructor
    is not thread-safe (one evaluation episode lost its success to "SystemError: AST constructor
    recursion depth mismatch"); static_checks parses under a lock, once per file text. The race
    itself did not reproduce on demand (8 threads parsing for seconds), so this checks what can
    be checked: many threads get the same answer, the parse is cached, and a file that cannot
    be parsed (a syntax error, a NUL byte) declares no checks instead of failing the episode."""
    from concurrent.futures import ThreadPoolExecutor

    from minirsi.env.verifier import _file_checks

    body = "import pytest\n" + "".join(f"def test_{i}(): assert {'[' * 20}1{']' * 20}\n" for i in range(40))
    (tmp_path / "test_outputs.py").write_text(body)
    want = {f"test_outputs::test_{i}": False for i in range(40)}
    _file_checks.cache_clear()
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: static_checks(tmp_path), range(64)))
    assert all(g == want for g in got)
    assert _file_checks.cache_info().misses == 1
    for bad in ("def test_a(:\n", "def test_a(): pass\n\x00\n"):
        (tmp_path / "test_outputs.py").write_text(bad)
        assert static_checks(tmp_path) == {}


@pytest.mark.parametrize("raw, success", [
    (b"1\n", True), (b"1.0", True), (b" 1 ", True),  # S = 1 iff the file holds 1 ...
    (b"0\n", False), (b"0.5", False), (b"0.999", False), (b"2", False),  # ... and nothing else counts
])
def test_reward_file_is_one_or_not(raw, success):
    from minirsi.env.verifier import _read_reward

    assert _read_reward(raw) == (success, None)


def test_unreadable_or_missing_reward_file_is_zero_with_the_reason():
    from minirsi.env.verifier import _read_reward

    assert _read_reward(b"passed") == (False, "reward.txt holds 'passed', not 1 or 0")
    assert _read_reward(None) == (False, "test.sh wrote no /logs/verifier/reward.txt")


def test_oracle_passes_and_empty_run_fails():
    oracle, empty = run_oracle(HELLO), run_empty(HELLO)
    assert (oracle.success, oracle.passed, oracle.total) == (True, 2, 2) and oracle.error is None
    assert (empty.success, empty.passed, empty.total) == (False, 0, 2)
    # hygiene checks are reported but never counted
    assert oracle.checks["test_outputs::test_input_untouched"] == "passed"
    assert oracle.hygiene == ("test_outputs::test_input_untouched",)


def test_partial_progress_counts_checks_without_success():
    with open_sandbox(HELLO) as sb:
        sb.run("echo goodbye > greeting.txt", timeout=10)
        r = verify(sb, HELLO)
    assert (r.success, r.passed, r.total) == (False, 1, 2)


def test_breaking_a_hygiene_check_changes_neither_p_nor_c():
    with open_sandbox(HELLO) as sb:
        sb.run("echo hello > greeting.txt; echo changed > input.txt", timeout=10)
        r = verify(sb, HELLO)
    assert (r.passed, r.total) == (2, 2)
    assert r.checks["test_outputs::test_input_untouched"] == "failed"
    assert r.success is False  # the gate still sees every test


def _task_copy(tmp_path: Path, name: str = "good/hello") -> Path:
    dst = tmp_path / Path(name).name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def test_collection_error_still_counts_every_declared_check(tmp_path):
    d = _task_copy(tmp_path)
    tests = d / "tests" / "test_outputs.py"
    tests.write_text("import json\njson.loads(open('/app/greeting.txt').read())\n" + tests.read_text())
    task = load_task(d)
    with open_sandbox(task) as sb:
        sb.run("echo hello > greeting.txt", timeout=10)
        r = verify(sb, task)
    assert not r.success and r.passed == 0 and r.total == 2


def test_missing_reward_file_and_plugin_writes_junit(tmp_path):
    d = _task_copy(tmp_path)
    # test.sh without --junitxml and without a reward file: the plugin still writes junit.xml.
    (d / "tests" / "test.sh").write_text("#!/bin/bash\ncd /app\npytest -q -p no:cacheprovider /tests/test_outputs.py\n")
    task = load_task(d)
    with open_sandbox(task) as sb:
        sb.run("echo hello > greeting.txt", timeout=10)
        r = verify(sb, task)
    assert (r.success, r.passed, r.total) == (False, 2, 2)
    assert "reward.txt" in r.error


def test_verifier_timeout(tmp_path):
    d = _task_copy(tmp_path)
    (d / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\nsleep 1000\n")
    toml = d / "task.toml"
    toml.write_text(toml.read_text().replace("timeout_sec = 30.0", "timeout_sec = 1.0"))
    task = load_task(d)
    with open_sandbox(task) as sb:
        r = verify(sb, task)
    assert r.success is False and "timed out" in r.error and r.total == 2


def test_tb1_task_without_reward_file():
    task = load_task(FIXTURES / "good" / "tb1_task")
    assert run_oracle(task).success and not run_empty(task).success


def test_tb1_gate_is_the_exit_status_of_run_tests():
    """TB1 writes no reward.txt: S = run-tests.sh exited 0 and every check passed. This fixture's
    run-tests.sh exits 1 when anything but done.txt is left in /app, which its two checks do
    not see: passing every check is not enough."""
    task = load_task(FIXTURES / "gate" / "tb1_exit_code")
    with open_sandbox(task) as sb:
        sb.run("echo done > done.txt", timeout=10)
        clean = verify(sb, task)
    with open_sandbox(task) as sb:
        sb.run("echo done > done.txt; touch stray.txt", timeout=10)
        stray = verify(sb, task)
    assert (clean.success, clean.passed, clean.total) == (True, 2, 2), clean.output_tail
    assert set(stray.checks.values()) == {"passed"}  # every check passed ...
    assert (stray.success, stray.passed, stray.total) == (False, 2, 2), stray.output_tail  # ... the gate did not


@pytest.mark.parametrize("checks", ["one failing", "none"])
def test_tb1_exit_0_is_not_enough(tmp_path, checks):
    """The other half of the TB1 rule: a run-tests.sh that exits 0 whatever pytest said still
    needs every check passed, and at least one check."""
    d = _task_copy(tmp_path, "gate/tb1_exit_code")
    (d / "run-tests.sh").write_text("#!/bin/bash\ncd /app\npytest -q -p no:cacheprovider $TEST_DIR/test_outputs.py\n"
                                    "exit 0\n")
    if checks == "none":
        (d / "tests" / "test_outputs.py").write_text("# no checks\n")
    task = load_task(d)
    with open_sandbox(task) as sb:
        sb.run("echo not-done > done.txt", timeout=10)  # done.txt exists, does not say done
        r = verify(sb, task)
    want = {"one failing": {"test_outputs::test_done_exists": "passed", "test_outputs::test_done_says_done": "failed"},
            "none": {}}[checks]
    assert r.checks == want and r.success is False, (r.checks, r.output_tail)


def test_task_check_cli(capsys):
    assert cli(["check", str(FIXTURES / "good"), "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "3 passed, 0 failed, 0 invalid (of 3 tasks); empty run executed every check and all failed: 3/3" in out
    assert "hello" in out
    assert cli(["check", str(FIXTURES / "good" / "hello"), str(FIXTURES / "malformed" / "bad_toml")]) == 1
    assert "INVALID" in capsys.readouterr().out


def test_task_check_fails_when_the_empty_run_passes(tmp_path, capsys):
    d = _task_copy(tmp_path)
    (d / "environment" / "greeting.txt").write_text("hello\n")  # already solved at the start
    assert cli(["check", str(d)]) == 1
    assert "the empty run passes" in capsys.readouterr().out


def test_task_replay_subprocess(tmp_path):
    commands = tmp_path / "cmds.json"
    commands.write_text(json.dumps(["echo hello > greeting.txt", "cat greeting.txt"]))
    out = subprocess.run([sys.executable, "-m", "minirsi.cli", "task", "replay", str(FIXTURES / "good" / "hello"),
                          "--commands", str(commands)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["success"] is True and (result["passed"], result["total"]) == (2, 2)
    assert result["steps"][1]["output"] == "hello\n"
    assert set(result) >= {"success", "passed", "total", "checks", "output_tail"}


def test_task_replay_rejects_bad_commands_file(tmp_path):
    bad = tmp_path / "cmds.json"
    bad.write_text('{"not": "a list"}')
    assert cli(["replay", str(FIXTURES / "good" / "hello"), "--commands", str(bad)]) == 2


@pytest.mark.parametrize("argv", [["check"], ["replay", "x"], ["nope"]])
def test_cli_usage_errors(argv):
    with pytest.raises(SystemExit) as info:
        cli(argv)
    assert info.value.code == 2


def test_verify_after_close_is_an_error_not_a_crash():
    sb = open_sandbox(HELLO)
    sb.close()
    r = verify(sb, HELLO)
    assert r.success is False and r.total == 0 and "close" in r.error


def test_hygiene_property_matches_the_plugin():
    from minirsi.env.sandbox import junit_plugin
    from minirsi.env.verifier import HYGIENE_PROPERTY

    assert junit_plugin.HYGIENE_PROPERTY == HYGIENE_PROPERTY


def test_harbor_reward_json_counts_when_there_is_no_reward_txt(tmp_path):
    d = _task_copy(tmp_path)
    (d / "tests" / "test.sh").write_text(
        "#!/bin/bash\ncd /app\npytest -q -p no:cacheprovider /tests/test_outputs.py\n"
        "if [ $? -eq 0 ]; then r=1; else r=0; fi\necho \"{\\\"reward\\\": $r, \\\"other\\\": 0}\" > /logs/verifier/reward.json\n")
    task = load_task(d)
    with open_sandbox(task) as sb:
        sb.run("echo hello > greeting.txt", timeout=10)
        assert verify(sb, task).success
    with open_sandbox(task) as sb:
        r = verify(sb, task)
    assert not r.success and r.error is None

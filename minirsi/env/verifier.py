"""The protected verifier: S, P and C of one episode (docs/method.md section 1).

After the agent stops, ``verify(sandbox, task)``:

1. ends the agent's jail (every agent process is killed; nothing it left running survives),
2. stages a fresh copy of the task's ``tests/`` (the agent never saw it) and mounts it
   read-only at ``/tests`` in a *new* jail: same work directory as the agent left it, fresh
   ``/tmp``, fresh empty ``/logs/verifier``, no network,
3. runs ``bash /tests/test.sh`` (TB1: ``run-tests.sh``) with ``[verifier] timeout_sec``,
4. reads the outcome::

       S = 1  iff  /logs/verifier/reward.txt holds 1     (the terminal gate; without it,
                   Harbor's reward.json {"reward": 1} counts the same)
       P = #{non-hygiene checks that passed}
       C = #{non-hygiene checks}                          (failed, errored, skipped included)

   ``/logs/verifier`` is created empty by the verifier, so a reward file the agent wrote can
   never count (the agent's jail never had /logs/verifier). A test.sh that times out gives S=0
   and the checks the XML (if any) recorded. TB1 tasks write no reward.txt: S = (run-tests.sh
   exited 0 and every check passed and there was at least one).

Convention for task authors
---------------------------
(The toy suites follow it with ``python3 -I /tests/run_checks.py``, a stdlib runner that writes
the same junit XML, in place of pytest: toy_envs/run_checks.py.) ``tests/test.sh``::

    #!/bin/bash
    cd /app                      # the task's workdir
    pytest -p no:cacheprovider --junitxml=/logs/verifier/junit.xml /tests/test_outputs.py -rA
    status=$?
    kill -9 -1 2>/dev/null       # nothing the tests started (agent programs) outlives them
    rm -rf /logs/verifier/reward.txt
    if [ $status -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi

- Run the ``pytest`` script (``/usr/bin/pytest``), not ``python3 -m pytest`` from the work
  directory: ``-m`` puts the cwd on sys.path, so an agent-planted ``/app/pytest.py`` would run.
- Each test function is one check. Mark bookkeeping checks ``@pytest.mark.hygiene``: the
  verifier loads its own pytest plugin (minirsi/env/sandbox/junit_plugin.py, via
  ``PYTEST_PLUGINS``) that registers the marker and records it in the junit XML as
  ``<property name="minirsi.hygiene" value="1"/>``; no conftest.py is needed. A test whose
  name starts with ``test_hygiene`` counts as hygiene too (for tests run outside minirsi).
- Checks are named ``<file stem>::<test name>`` (``test_outputs::test_greeting_content``);
  outcomes are passed | failed | error | skipped.
- The gate may be stricter than "every check passed" (test.sh decides what it writes), which
  is how a run can pass every executed check and still fail (docs/method.md section 1).
- Residual risk: tests that *execute* agent-written programs run them with the verifier's
  rights, so such a program could write /logs/verifier while pytest runs (e.g. a read-only
  junit.xml or reward.txt). The ``kill -9 -1`` and ``rm -rf`` lines above close the reward
  file; for P, run agent programs through ``subprocess`` with a timeout and never with a
  shell that inherits /logs. Full protection would need a second uid for agent programs.

Call::

    with open_sandbox(task) as sb:
        ...agent acts...
        result = verify(sb, task)    # VerifierResult(success, passed, total, checks, output_tail, error)
"""

from __future__ import annotations

import ast
import functools
import json
import logging
import shutil
import tempfile
import threading
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from minirsi.env.sandbox import Sandbox, SandboxError
from minirsi.env.tasks import Task

logger = logging.getLogger(__name__)

PLUGIN = Path(__file__).parent / "sandbox" / "junit_plugin.py"
# The junit property the plugin writes (same value as junit_plugin.HYGIENE_PROPERTY; not imported
# from there because the plugin imports pytest, which the host side need not have).
HYGIENE_PROPERTY = "minirsi.hygiene"
OUTPUT_TAIL_CHARS = 4000
OUTCOMES = ("passed", "failed", "error", "skipped")


@dataclass
class VerifierResult:
    success: bool
    """S: reward.txt held 1."""
    passed: int
    """P: passed non-hygiene checks."""
    total: int
    """C: all non-hygiene checks."""
    checks: dict[str, str] = field(default_factory=dict)
    """check name -> passed | failed | error | skipped (hygiene checks included)."""
    output_tail: str = ""
    """The last OUTPUT_TAIL_CHARS characters of test.sh's output."""
    error: str | None = None
    """Why the verifier could not judge normally (timeout, no reward file, sandbox failure)."""
    hygiene: tuple[str, ...] = ()
    """Names of the hygiene checks (excluded from P and C)."""


def parse_junit(xml_bytes: bytes) -> tuple[dict[str, str], set[str]]:
    """junit XML -> ({check: outcome}, {hygiene check names}).

    Works for pytest's xunit1 and xunit2 output (``<testsuites>`` or a bare ``<testsuite>``).
    """
    root = ET.fromstring(xml_bytes)
    checks: dict[str, str] = {}
    hygiene: set[str] = set()
    for case in root.iter("testcase"):
        parts = [p for p in (case.get("classname") or "").split(".") if p]
        if not parts:  # a collection error of a whole file, not a check; static_checks fills in
            continue
        if len(parts) > 1 and parts[0] == "tests":  # rootdir above /tests
            parts = parts[1:]
        name = "::".join([*parts, str(case.get("name"))])
        if case.find("error") is not None:
            outcome = "error"
        elif case.find("failure") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        # pytest writes a second <testcase> for a teardown error of a test that passed: worst wins.
        if checks.get(name) in ("error", "failed") and outcome == "passed":
            continue
        checks[name] = outcome
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if props.get(HYGIENE_PROPERTY) == "1" or str(case.get("name")).startswith("test_hygiene"):
            hygiene.add(name)
    return checks, hygiene


def _is_hygiene_decorator(node: ast.expr) -> bool:
    return "hygiene" in ast.unparse(node).split(".")[-1].split("(")[0]


def static_checks(tests_dir: Path) -> dict[str, bool]:
    """The checks a task declares, read from tests/test_*.py without running them.

    name (as in `parse_junit`) -> is hygiene. Each test function or Test* method counts once
    (a parametrized test is one static check; its junit cases share its name before "[").
    Used so that C counts checks that never ran (a collection error, a test.sh that died).
    """
    found: dict[str, bool] = {}
    for path in sorted(tests_dir.glob("test_*.py")):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found.update(_file_checks(path.stem, text))
    return found


_AST_LOCK = threading.Lock()
"""CPython 3.11 keeps the AST constructor's recursion counter per interpreter, not per thread:
two threads parsing at once (the rollout verifies episodes on its sandbox threads) can fail
with "SystemError: AST constructor recursion depth mismatch" (docs/experiments.md,
"Measurements behind the code's defaults"). Every parse in this module holds this lock."""


@functools.lru_cache(maxsize=512)
def _file_checks(stem: str, text: str) -> tuple[tuple[str, bool], ...]:
    """(name, is hygiene) of each test in one file's ``text``; cached, since every episode of a
    task verifies against the same file."""
    with _AST_LOCK:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):  # ValueError: how older Pythons reject a NUL byte
            return ()
        found = []
        for node in tree.body:
            scopes = [(stem, node)]
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                scopes = [(f"{stem}::{node.name}", n) for n in node.body]
            for prefix, fn in scopes:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name.startswith("test"):
                    marked = any(_is_hygiene_decorator(d) for d in fn.decorator_list)
                    found.append((f"{prefix}::{fn.name}", marked or fn.name.startswith("test_hygiene")))
        return tuple(found)


def _reward_from_json(raw: bytes | None) -> bytes | None:
    """Harbor's other reward file: reward.json holding {"reward": <number>, ...}."""
    if raw is None:
        return None
    try:
        value = json.loads(raw).get("reward")
    except (ValueError, AttributeError):
        return b"(unreadable reward.json)"
    return str(value).encode()


def _read_reward(raw: bytes | None) -> tuple[bool, str | None]:
    if raw is None:
        return False, "test.sh wrote no /logs/verifier/reward.txt"
    text = raw.decode(errors="replace").strip()
    try:
        return float(text) == 1.0, None
    except ValueError:
        return False, f"reward.txt holds {text[:40]!r}, not 1 or 0"


def verify(sandbox: Sandbox, task: Task) -> VerifierResult:
    """End the agent, run the task's tests in a fresh jail, and score the episode."""
    stage = Path(tempfile.mkdtemp(prefix="minirsi-tests-"))
    try:
        tests = stage / "tests"
        shutil.copytree(task.tests_dir, tests) if task.tests_dir.is_dir() else tests.mkdir()
        if task.layout == "tb1":
            shutil.copy2(task.test_script, tests / task.test_script.name)
        for path in [stage, *tests.rglob("*")]:  # readable by the sandbox's unprivileged user
            path.chmod(path.stat().st_mode | (0o755 if path.is_dir() else 0o644))
        stage.chmod(0o755)
        env = {**task.verifier_env, "PYTHONPATH": "/opt/minirsi", "PYTEST_PLUGINS": "minirsi_junit",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1"}
        sandbox.stop_agent()
        run = sandbox.run_verifier(tests, task.test_script.name, PLUGIN, env, task.verifier_timeout_sec)
    except SandboxError as e:
        logger.warning("verifier for %s failed: %s", task.task_id, e)
        return VerifierResult(False, 0, 0, {}, "", f"sandbox failed during verification: {e}")
    finally:
        shutil.rmtree(stage, ignore_errors=True)

    errors: list[str] = []
    checks, hygiene = {}, set()
    if "junit.xml" in run.files:
        try:
            checks, hygiene = parse_junit(run.files["junit.xml"])
        except ET.ParseError as e:
            errors.append(f"junit.xml is not valid XML ({e})")
    else:
        errors.append("no /logs/verifier/junit.xml (run pytest with --junitxml=/logs/verifier/junit.xml)")
    missing = 0
    for name, is_hygiene in static_checks(task.tests_dir).items():
        if not any(c == name or c.startswith(name + "[") for c in checks):
            checks[name] = "error"  # declared but never ran: still one of the C checks
            missing += 1
            if is_hygiene:
                hygiene.add(name)
    if missing:
        errors.append(f"{missing} declared check(s) did not run (a collection error, or test.sh stopped early)")
    counted = {name: outcome for name, outcome in checks.items() if name not in hygiene}
    passed = sum(outcome == "passed" for outcome in counted.values())
    if task.layout == "tb1" and "reward.txt" not in run.files:
        success = run.exit_code == 0 and bool(checks) and all(o == "passed" for o in checks.values())
    else:
        raw = run.files.get("reward.txt")
        success, reward_error = _read_reward(raw if raw is not None or "reward.json" not in run.files
                                             else _reward_from_json(run.files["reward.json"]))
        if reward_error:
            errors.append(reward_error)
    if run.timed_out:
        success = False
        errors.insert(0, f"test script timed out after {task.verifier_timeout_sec:.0f}s")
    return VerifierResult(
        success=success,
        passed=passed,
        total=len(counted),
        checks=checks,
        output_tail=run.output[-OUTPUT_TAIL_CHARS:],
        error="; ".join(errors) or None,
        hygiene=tuple(sorted(hygiene)),
    )

"""Run a toy task's checks and write pytest-style junit XML (copied into every task's tests/).

Why not pytest: a toy task's checks are plain functions with plain asserts, and pytest's
start-up inside the sandbox (importing pytest and its plugins: ~0.1 s of CPU, ~0.15 s a run)
was most of the verifier's cost and, with 32 verifiers per rollout step on a 2-core machine,
most of a rollout's time outside generation. This runner needs only the standard library
(~0.03 s). The test files stay valid pytest modules: ``pytest /tests/test_outputs.py`` runs
the same checks with the same outcomes.

What it does, as pytest would for these files::

    python3 -I /tests/run_checks.py /tests/test_outputs.py /logs/verifier/junit.xml

- imports the test file (a failure to import is a collection error: no check runs, exit 2;
  the verifier then counts every declared check as an error);
- calls each module-level function whose name starts with ``test``, in file order; an
  exception raised by a check (an ``AssertionError`` or any other) makes it ``failed``, as in
  pytest, where ``error`` is reserved for fixtures, which these files do not use;
- writes ``<testcase classname="test_outputs" name="test_x">`` with a ``<failure>`` for each
  failed check (hygiene checks are named ``test_hygiene_*``, which minirsi.verifier reads);
- prints one line per check and a pytest-like summary; exits 0 iff every check passed (and
  there was at least one), else 1.

Run it with ``python3 -I`` (isolated mode): neither the working directory (/app, which the
agent wrote) nor PYTHON* variables reach ``sys.path``, so an agent cannot plant a module that
the checks import.
"""

import os
import sys
import time
import xml.etree.ElementTree as ET

# Only what a run needs is imported (no traceback, pathlib, importlib): each module is ~2-4 ms
# of the ~25 ms a run costs, paid once per episode.


def _where(e: BaseException, test_file: str) -> str:
    """The test file's last line in ``e``'s traceback ("line 12"), or ""."""
    tb, line = e.__traceback__, ""
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == test_file:
            line = f"line {tb.tb_lineno}"
        tb = tb.tb_next
    return line


def main(argv: list) -> int:
    if len(argv) != 2:
        print("usage: python3 -I run_checks.py TEST_FILE JUNIT_XML", file=sys.stderr)
        return 2
    test_file, xml_path = argv
    stem = os.path.splitext(os.path.basename(test_file))[0]
    suite = ET.Element("testsuite", name="run_checks")
    root = ET.Element("testsuites")
    root.append(suite)
    module = {"__name__": stem, "__file__": test_file}
    try:
        with open(test_file, encoding="utf-8") as f:
            exec(compile(f.read(), test_file, "exec"), module)  # what importing the module does
    except Exception as e:  # a collection error: nothing ran; the verifier counts the declared checks
        print(f"ERROR collecting {test_file}: {type(e).__name__}: {e} {_where(e, test_file)}")
        ET.ElementTree(root).write(xml_path, encoding="utf-8", xml_declaration=True)
        return 2
    checks = [(name, fn) for name, fn in module.items()
              if name.startswith("test") and callable(fn) and getattr(fn, "__module__", None) == stem]
    failed = 0
    for name, fn in checks:
        case = ET.SubElement(suite, "testcase", classname=stem, name=name)
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # any exception in a check's body is a failed check (as in pytest)
            failed += 1
            what = f"{type(e).__name__}: {e}"
            ET.SubElement(case, "failure", message=what[:500]).text = f"{test_file} {_where(e, test_file)}: {what}"
            print(f"FAILED {stem}::{name} - {what}"[:300])
        else:
            print(f"PASSED {stem}::{name}")
        case.set("time", f"{time.monotonic() - t0:.3f}")
    suite.set("tests", str(len(checks)))
    suite.set("failures", str(failed))
    suite.set("errors", "0")
    suite.set("skipped", "0")
    ET.ElementTree(root).write(xml_path, encoding="utf-8", xml_declaration=True)
    print(f"{failed} failed, {len(checks) - failed} passed")
    return 0 if checks and not failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

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

# Only what a run needs is imported (no traceback, pathlib, importlib, xml.etree): each module
# is ~2-6 ms of a run's ~10-20 ms, paid once per episode. The junit file is written by hand.

# Characters XML 1.0 cannot hold at all (a check's message can quote anything the agent wrote).
_BAD_XML = dict.fromkeys([*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0xFFFE, 0xFFFF], "\ufffd")
_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "\n": "&#10;", "\r": "&#13;", "\t": "&#9;"})


def _xml(text: str, attribute: bool = True) -> str:
    """``text`` as XML character data (or, with ``attribute``, a double-quoted attribute value)."""
    text = text.translate(_BAD_XML)  # (lone surrogates become "?" when the file is written)
    if not attribute:
        return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.translate(_ESCAPES)


def _write_junit(path: str, cases: list, failed: int) -> None:
    """cases: (classname, name, seconds, failure message or None, failure text)."""
    out = ["<?xml version='1.0' encoding='utf-8'?>\n<testsuites>",
           f'<testsuite name="run_checks" tests="{len(cases)}" failures="{failed}" errors="0" skipped="0">']
    for classname, name, seconds, message, text in cases:
        head = f'<testcase classname="{_xml(classname)}" name="{_xml(name)}" time="{seconds:.3f}"'
        if message is None:
            out.append(head + " />")
        else:
            out.append(f'{head}><failure message="{_xml(message)}">{_xml(text, attribute=False)}</failure></testcase>')
    out.append("</testsuite></testsuites>\n")
    with open(path, "w", encoding="utf-8", errors="replace") as f:
        f.write("".join(out))


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
    # A message can hold what no encoding can print (a file name the agent made of non-UTF-8
    # bytes reaches os.listdir as lone surrogates): print it escaped rather than crash.
    sys.stdout.reconfigure(errors="backslashreplace")
    stem = os.path.splitext(os.path.basename(test_file))[0]
    module = {"__name__": stem, "__file__": test_file}
    try:
        with open(test_file, encoding="utf-8") as f:
            exec(compile(f.read(), test_file, "exec"), module)  # what importing the module does
    except Exception as e:  # a collection error: nothing ran; the verifier counts the declared checks
        print(f"ERROR collecting {test_file}: {type(e).__name__}: {e} {_where(e, test_file)}")
        _write_junit(xml_path, [], 0)
        return 2
    checks = [(name, fn) for name, fn in module.items()
              if name.startswith("test") and callable(fn) and getattr(fn, "__module__", None) == stem]
    failed, cases = 0, []
    for name, fn in checks:
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # any exception in a check's body is a failed check (as in pytest)
            failed += 1
            what = f"{type(e).__name__}: {e}"
            cases.append((stem, name, time.monotonic() - t0, what[:500], f"{test_file} {_where(e, test_file)}: {what}"))
            print(f"FAILED {stem}::{name} - {what}"[:300])
        else:
            cases.append((stem, name, time.monotonic() - t0, None, ""))
            print(f"PASSED {stem}::{name}")
    _write_junit(xml_path, cases, failed)
    print(f"{failed} failed, {len(checks) - failed} passed")
    return 0 if checks and not failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``minirsi task``: validate tasks and replay commands in a sandbox.

    minirsi task check DIR... [--backend bwrap|docker] [--jobs N]
        Load every task under each DIR (a task, or a directory of tasks), then for each one run
        the oracle (solution/solve.sh) and an empty run (the agent does nothing) in fresh
        sandboxes, each followed by the verifier. Prints a table; exit 0 only if every task
        loads, every oracle passes (S = 1) and every empty run fails (S = 0).

    minirsi task replay DIR --commands FILE [--backend ...] [--timeout SEC]
        FILE is a JSON list of command strings. Runs them as the agent in a fresh sandbox, then
        the verifier, and prints JSON: success, passed, total, checks, error, output_tail, and
        each command's result.

The oracle gets ``solution/`` uploaded to /tmp/solution (through the shell, in base64 chunks)
and runs ``bash /tmp/solution/solve.sh`` from the workdir (TB1: solution.sh) with the agent's
timeout. Harbor mounts it at /solution; minirsi's root filesystem is read-only, hence /tmp.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from minirsi.sandbox import BACKENDS, Sandbox, SandboxError, open_sandbox
from minirsi.tasks import Task, TaskError, load_tasks
from minirsi.verifier import VerifierResult, verify

logger = logging.getLogger(__name__)
_CHUNK = 48_000  # base64 characters per upload command


def upload(sandbox: Sandbox, files: dict[str, Path], timeout: float = 60.0) -> None:
    """Write host files into the sandbox through its shell: {path inside: host path}."""
    for target, path in sorted(files.items()):
        target = shlex.quote(target)
        data = base64.b64encode(path.read_bytes()).decode()
        r = sandbox.run(f"mkdir -p \"$(dirname {target})\" && : > {target}", timeout)
        for i in range(0, len(data), _CHUNK):
            if r.exit_code == 0:
                r = sandbox.run(f"printf %s '{data[i:i + _CHUNK]}' | base64 -d >> {target}", timeout)
        if r.exit_code != 0:
            raise SandboxError(f"uploading {path} failed: {r.output[-500:]}")
        sandbox.run(f"chmod {oct(path.stat().st_mode & 0o777)[2:]} {target}", timeout)


def run_oracle(task: Task, backend: str = "bwrap") -> VerifierResult:
    solution = task.solution_script
    if not solution.is_file():
        return VerifierResult(False, 0, 0, {}, "", f"no oracle: {solution} is missing")
    root = solution.parent
    files = {f"/tmp/solution/{p.relative_to(root).as_posix()}": p
             for p in (root.rglob("*") if task.layout == "harbor" else [solution]) if p.is_file()}
    with open_sandbox(task, backend=backend) as sb:
        upload(sb, files)
        r = sb.run(f"cd {shlex.quote(task.workdir)} && bash /tmp/solution/{solution.name}", task.agent_timeout_sec)
        result = verify(sb, task)
    if r.timed_out:
        result.error = f"oracle timed out after {task.agent_timeout_sec:.0f}s; {result.error or ''}"
    return result


def run_empty(task: Task, backend: str = "bwrap") -> VerifierResult:
    with open_sandbox(task, backend=backend) as sb:
        return verify(sb, task)


@dataclass
class CheckRow:
    task: Task
    oracle: VerifierResult | None
    empty: VerifierResult | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.oracle is not None and self.oracle.success and self.empty is not None and not self.empty.success


def check_task(task: Task, backend: str) -> CheckRow:
    try:
        return CheckRow(task, run_oracle(task, backend), run_empty(task, backend))
    except (SandboxError, ValueError) as e:
        return CheckRow(task, None, None, str(e))


def _cell(r: VerifierResult | None) -> str:
    return "-" if r is None else f"S={int(r.success)} {r.passed}/{r.total}"


def _check(args: argparse.Namespace) -> int:
    tasks: list[Task] = []
    errors: list[TaskError] = []
    for d in args.dirs:
        try:
            good, bad = load_tasks(d)
        except TaskError as e:
            good, bad = [], [e]
        tasks += good
        errors += bad
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(lambda t: check_task(t, args.backend), tasks))
    width = max([len(t.task_id) for t in tasks] + [4])
    print(f"{'task':<{width}}  {'family':<14} {'difficulty':<10} {'oracle':<12} {'empty':<12} verdict")
    for row in rows:
        verdict = "ok" if row.ok else "FAIL"
        why = row.error or (row.oracle.error if row.oracle and not row.oracle.success else None) \
            or ("the empty run passes" if row.empty and row.empty.success else None)
        print(f"{row.task.task_id:<{width}}  {row.task.family:<14} {row.task.difficulty:<10} "
              f"{_cell(row.oracle):<12} {_cell(row.empty):<12} {verdict}{'  ' + why if why and not row.ok else ''}")
    for e in errors:
        print(f"INVALID  {e}")
    n_ok = sum(r.ok for r in rows)
    print(f"{n_ok}/{len(rows)} tasks ok, {len(errors)} invalid")
    return 0 if n_ok == len(rows) and not errors and (rows or errors) else 1


def _replay(args: argparse.Namespace) -> int:
    from minirsi.tasks import load_task

    try:
        task = load_task(args.dir)
        commands = json.loads(Path(args.commands).read_text())
    except (TaskError, OSError, json.JSONDecodeError) as e:
        print(f"minirsi task replay: {e}", file=sys.stderr)
        return 2
    if not isinstance(commands, list) or not all(isinstance(c, str) for c in commands):
        print(f"minirsi task replay: {args.commands} must hold a JSON list of command strings", file=sys.stderr)
        return 2
    steps = []
    try:
        with open_sandbox(task, backend=args.backend) as sb:
            for command in commands:
                r = sb.run(command, args.timeout)
                steps.append({"command": command, "output": r.output, "exit_code": r.exit_code,
                              "timed_out": r.timed_out, "truncated": r.truncated})
            result = verify(sb, task)
    except SandboxError as e:
        print(json.dumps({"success": False, "error": f"sandbox failed: {e}", "steps": steps}, indent=2))
        return 1
    print(json.dumps({"task_id": task.task_id, "success": result.success, "passed": result.passed,
                      "total": result.total, "checks": result.checks, "error": result.error,
                      "output_tail": result.output_tail, "steps": steps}, indent=2))
    return 0


def cli(argv: list[str] | None = None, command: str = "task") -> int:
    parser = argparse.ArgumentParser(prog=f"minirsi {command}", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("check", help="run every oracle and an empty run; exit 0 if all behave")
    p.add_argument("dirs", nargs="+", help="task directories or directories of tasks")
    p.add_argument("--backend", choices=BACKENDS, default="bwrap")
    p.add_argument("--jobs", type=int, default=2, help="tasks checked in parallel")
    p = sub.add_parser("replay", help="run a JSON list of commands as the agent, then the verifier")
    p.add_argument("dir", help="one task directory")
    p.add_argument("--commands", required=True, help="JSON file: a list of command strings")
    p.add_argument("--backend", choices=BACKENDS, default="bwrap")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per command")
    args = parser.parse_args(argv)
    if getattr(args, "jobs", 1) < 1:
        parser.error("--jobs must be at least 1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return _check(args) if args.action == "check" else _replay(args)


if __name__ == "__main__":
    sys.exit(cli())

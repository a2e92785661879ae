"""``minirsi task``: prepare, validate and replay tasks in a sandbox.

    minirsi task prepare DIR... [-q]
        Build the environment layers of every task with environment/Dockerfile (the local
        backend's `docker build`, with the network; minirsi/env/layers.py). Cached: a second run
        does no work. Prints each failure (the Dockerfile line, the package, the exit status)
        and a summary; exit 0 only if every task is ready.

    minirsi task check DIR... [--backend bwrap|docker] [--jobs N] [-v] [--json] [--no-prepare]
        Load every task under each DIR (a task, or a directory of tasks); on the local backend
        prepare what is missing (--no-prepare: report the command instead); then for each task
        run the oracle (solution/solve.sh) and an empty run (the agent does nothing) in fresh
        sandboxes, each followed by the verifier. Prints a table; under each FAIL, why (the
        oracle's exit status and last lines, test.sh's last lines, the failing checks); -v adds
        whole logs and the image notes; a summary line counts passed / failed / invalid, the
        empty runs that executed every check and failed them all, and the oracles that pass.
        --json prints the same as one JSON object. Exit 0 only if every task loads, every
        oracle passes (S = 1) and every empty run fails (S = 0). An invalid task (task.toml,
        or a Dockerfile line the local backend cannot honour) is reported once, as INVALID.

    minirsi task layers
        List the prepared layers (kind, key, disk, build time; a package index's wheels) and
        their total disk, and the download store the package indexes share.

    minirsi task replay DIR --commands FILE [--backend ...] [--timeout SEC]
        FILE is a JSON list of command strings. Runs them as the agent in a fresh sandbox, then
        the verifier, and prints JSON: success, passed, total, checks, error, output_tail, and
        each command's result.

The oracle gets ``solution/`` uploaded to /tmp/solution (through the shell, in base64 chunks)
and runs ``bash /tmp/solution/solve.sh`` from the workdir (TB1: solution.sh) with the agent's
timeout. Harbor mounts it at /solution; on the base rootfs minirsi's root is read-only, hence /tmp.
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

from minirsi.env.sandbox import BACKENDS, CommandResult, Sandbox, SandboxError, open_sandbox
from minirsi.env.tasks import Task, TaskError, load_tasks
from minirsi.env.verifier import VerifierResult, verify

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


def oracle_run(task: Task, backend: str = "bwrap") -> tuple[VerifierResult, CommandResult | None]:
    """Run the oracle, then the verifier: (verifier result, the oracle command's result)."""
    solution = task.solution_script
    if not solution.is_file():
        return VerifierResult(False, 0, 0, {}, "", f"no oracle: {solution} is missing"), None
    root = solution.parent
    files = {f"/tmp/solution/{p.relative_to(root).as_posix()}": p
             for p in (root.rglob("*") if task.layout == "harbor" else [solution]) if p.is_file()}
    with open_sandbox(task, backend=backend) as sb:
        upload(sb, files)
        r = sb.run(f"cd {shlex.quote(task.workdir)} && bash /tmp/solution/{solution.name}", task.agent_timeout_sec)
        result = verify(sb, task)
    if r.timed_out:
        result.error = f"oracle timed out after {task.agent_timeout_sec:.0f}s; {result.error or ''}"
    return result, r


def run_oracle(task: Task, backend: str = "bwrap") -> VerifierResult:
    return oracle_run(task, backend)[0]


def run_empty(task: Task, backend: str = "bwrap") -> VerifierResult:
    with open_sandbox(task, backend=backend) as sb:
        return verify(sb, task)


@dataclass
class CheckRow:
    task: Task
    oracle: VerifierResult | None
    empty: VerifierResult | None
    error: str | None = None
    oracle_cmd: CommandResult | None = None
    """The oracle command itself (solve.sh): its exit status and output."""
    notes: tuple[str, ...] = ()
    """How the local layer differs from the task's image (Dockerfile FROM mapping)."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.oracle is not None and self.oracle.success and self.empty is not None and not self.empty.success

    @property
    def empty_all_failing(self) -> bool:
        """The empty run executed every declared check and each one failed (none errored,
        none uncollected, none skipped): the verifier works in this environment."""
        r = self.empty
        counted = [o for name, o in r.checks.items() if name not in r.hygiene] if r is not None else []
        return bool(counted) and all(o == "failed" for o in counted) and not r.success

    def reasons(self) -> list[str]:
        """Why the row is a FAIL, one line each (empty when ok)."""
        if self.ok:
            return []
        if self.error:
            return [self.error]
        out = []
        if self.oracle is not None and not self.oracle.success:
            cmd = self.oracle_cmd
            status = "timed out" if cmd is not None and cmd.timed_out else (f"exited {cmd.exit_code}" if cmd else "did not run")
            out.append(f"oracle {status}; verifier: S=0 {self.oracle.passed}/{self.oracle.total}"
                       + (f" ({self.oracle.error})" if self.oracle.error else ""))
            failing = failing_checks(self.oracle)
            if failing:
                out.append(f"failing checks: {', '.join(failing[:12])}" + (" ..." if len(failing) > 12 else ""))
            if cmd is not None and cmd.exit_code != 0:
                out.append("oracle output (last lines):\n" + _indent(_last_lines(cmd.output, TAIL_LINES)))
            out.append("test.sh output (last lines):\n" + _indent(_last_lines(self.oracle.output_tail, TAIL_LINES)))
        if self.empty is not None and self.empty.success:
            out.append(f"the empty run passes (S=1 {self.empty.passed}/{self.empty.total}): the tests do not need the agent")
        return out


TAIL_LINES = 8


def _last_lines(text: str, n: int) -> str:
    lines = text.rstrip("\n").splitlines()
    return "\n".join(lines[-n:]) if lines else "(no output)"


def _indent(text: str) -> str:
    return "\n".join("      " + line for line in text.splitlines())


def failing_checks(result: VerifierResult) -> list[str]:
    return sorted(name for name, outcome in result.checks.items() if outcome != "passed" and name not in result.hygiene)


def check_task(task: Task, backend: str) -> CheckRow:
    try:
        notes = _layer_notes(task, backend)
        oracle, cmd = oracle_run(task, backend)
        return CheckRow(task, oracle, run_empty(task, backend), oracle_cmd=cmd, notes=notes)
    except (SandboxError, ValueError) as e:
        return CheckRow(task, None, None, str(e))


def _layer_notes(task: Task, backend: str) -> tuple[str, ...]:
    """How the local layer differs from the image, and what the task's package index holds."""
    if backend != "bwrap" or not task.uses_layer:
        return ()
    from minirsi.env.dockerfile import parse_dockerfile
    from minirsi.env.prepare import find_prepared
    from minirsi.env.sandbox.bwrap import default_rootfs
    from minirsi.env.wheelhouse import describe

    prepared = find_prepared(task, default_rootfs())
    index = prepared.index_layer if prepared is not None else None
    return (*parse_dockerfile(task.dockerfile).notes,
            *([f"package index: {describe(index)}"] if index is not None else []))


def _cell(r: VerifierResult | None) -> str:
    return "-" if r is None else f"S={int(r.success)} {r.passed}/{r.total}"


def _load_all(dirs: list[str]) -> tuple[list[Task], list[Exception]]:
    tasks: list[Task] = []
    errors: list[Exception] = []
    for d in dirs:
        try:
            good, bad = load_tasks(d)
        except TaskError as e:
            good, bad = [], [e]
        tasks += good
        errors += bad
    return tasks, errors


def prepare_tasks(tasks: list[Task], log=print) -> tuple[list[Task], dict[str, Exception], int]:
    """Prepare the layers of every task with a Dockerfile (bwrap backend).

    Returns (tasks that can run, {task id: DockerfileError or LayerError}, layers built)."""
    from minirsi.env.dockerfile import DockerfileError
    from minirsi.env.layers import LayerError
    from minirsi.env.prepare import prepare
    from minirsi.env.sandbox.bwrap import default_rootfs
    from minirsi.env.wheelhouse import missing_warning

    ready, failed, built = [], {}, 0
    for task in tasks:
        if not task.uses_layer:
            ready.append(task)
            continue
        try:
            prepared, did = prepare(task, default_rootfs(), log=log)
            built += did
            ready.append(task)
            for note in prepared.notes if did else ():  # what differs from the image, said once
                log(f"  note: {note}")
            warning = missing_warning(task, prepared.index_layer) if prepared.index_layer is not None else None
            if warning:  # every time: the task stays without those packages until its files change
                log(f"  {warning}")
        except (DockerfileError, LayerError, OSError) as e:
            failed[task.task_id] = e
    return ready, failed, built


def _prepare(args: argparse.Namespace) -> int:
    import time

    tasks, invalid = _load_all(args.dirs)
    started = time.monotonic()
    ready, failed, built = prepare_tasks(tasks, log=(lambda s: print(s, flush=True)) if not args.quiet else (lambda s: None))
    for task_id, e in failed.items():
        print(f"FAIL     {task_id}: {e}")
    for e in invalid:
        print(f"INVALID  {e}")
    print(f"{len(ready)} ready ({built} layer(s) built in {time.monotonic() - started:.1f}s), "
          f"{len(failed)} failed, {len(invalid)} invalid")
    return 0 if not failed and not invalid else 1


def _unready(tasks: list[Task], prepare_missing: bool) -> tuple[dict[str, str], dict[str, Exception]]:
    """Tasks that cannot run on the local backend: ({task id: why}, {task id: why it is invalid}).

    With `prepare_missing`, missing layers are built first; a failed RUN is the task's FAIL
    reason, a Dockerfile line that cannot be honoured makes the task invalid. Without it, an
    unprepared task's reason is the command that prepares it."""
    from minirsi.env.dockerfile import DockerfileError
    from minirsi.env.prepare import find_prepared
    from minirsi.env.sandbox.bwrap import default_rootfs

    why: dict[str, str] = {}
    invalid: dict[str, Exception] = {}
    if prepare_missing:
        _, failed, _ = prepare_tasks(tasks, log=lambda s: print(s, file=sys.stderr, flush=True))
        for task_id, e in failed.items():
            if isinstance(e, DockerfileError):
                invalid[task_id] = e
            else:
                why[task_id] = str(e)
        return why, invalid
    for t in tasks:
        if not t.uses_layer:
            continue
        try:
            if find_prepared(t, default_rootfs()) is None:
                why[t.task_id] = f"not prepared. Fix: minirsi task prepare {t.path}"
        except DockerfileError as e:
            invalid[t.task_id] = e
    return why, invalid


def _layers(args: argparse.Namespace) -> int:
    from minirsi.env.layers import cache_dir, list_layers
    from minirsi.env.wheelhouse import store_dir

    metas = list_layers()
    for m in metas:
        what = m.get("base") or " ".join(m.get("apt") or m.get("pip") or [])
        if m["kind"] == "index":  # its wheels (what the jail sees; the rest of its disk: the verifier's copies)
            what = (f"{len(m['wheels'])} wheels, {m['index_bytes'] / 2**20:.1f} MiB: "
                    + " ".join(f"{w['name']}=={w['version']}" for w in m["wheels"])
                    + (f"; missing: {' '.join(m['missing'])}" if m["missing"] else ""))
        print(f"{m['kind']:<11} {m['key']}  {m['disk_bytes'] / 2**20:8.1f} MiB  {m['seconds']:7.1f} s  {m['built']}  {what}")
    store = store_dir()
    stored = list(store.glob("*.whl")) if store.is_dir() else []
    print(f"{len(metas)} layer(s) in {cache_dir()}: {sum(m['disk_bytes'] for m in metas) / 2**20:.1f} MiB; "
          f"download store {store}: {len(stored)} wheels, {sum(p.stat().st_size for p in stored) / 2**20:.1f} MiB "
          "(shared with the indexes: hard links)")
    return 0


def _check(args: argparse.Namespace) -> int:
    tasks, errors = _load_all(args.dirs)
    unprepared: dict[str, str] = {}
    if args.backend == "bwrap":
        unprepared, invalid = _unready(tasks, args.prepare)
        errors += list(invalid.values())
        tasks = [t for t in tasks if t.task_id not in invalid]  # an invalid task is reported once
    runnable = [t for t in tasks if t.task_id not in unprepared]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(lambda t: check_task(t, args.backend), runnable))
    rows += [CheckRow(t, None, None, unprepared[t.task_id]) for t in tasks if t.task_id in unprepared]
    n_ok = sum(r.ok for r in rows)
    counts = {"passed": n_ok, "failed": len(rows) - n_ok, "invalid": len(errors),
              "empty_run_all_checks_failing": sum(r.empty_all_failing for r in rows),
              "with_oracle": sum(r.task.solution_script.is_file() for r in rows),
              "oracle_passes": sum(bool(r.oracle and r.oracle.success) for r in rows)}
    summary = (f"{n_ok} passed, {len(rows) - n_ok} failed, {len(errors)} invalid (of {len(rows) + len(errors)} tasks); "
               f"empty run executed every check and all failed: {counts['empty_run_all_checks_failing']}/{len(rows)}; "
               f"oracle passes: {counts['oracle_passes']}/{counts['with_oracle']} with an oracle")
    if args.json:
        print(json.dumps({"tasks": [_row_json(r) for r in rows],
                          "invalid": [{"path": str(getattr(e, "path", "")), "error": str(e)} for e in errors],
                          "summary": counts}, indent=2))
    else:
        _print_table(rows, errors, args.verbose)
        print(summary)
    return 0 if n_ok == len(rows) and not errors and (rows or errors) else 1


def _result_json(r: VerifierResult | None) -> dict | None:
    if r is None:
        return None
    return {"success": r.success, "passed": r.passed, "total": r.total, "failing": failing_checks(r),
            "checks": r.checks, "error": r.error, "output_tail": r.output_tail}


def _row_json(row: CheckRow) -> dict:
    cmd = row.oracle_cmd
    return {"task": row.task.task_id, "path": str(row.task.path), "verdict": "ok" if row.ok else "FAIL",
            "empty_run_all_checks_failing": row.empty_all_failing,
            "reasons": row.reasons(), "error": row.error, "notes": list(row.notes),
            "oracle": _result_json(row.oracle), "empty": _result_json(row.empty),
            "oracle_command": None if cmd is None else {"exit_code": cmd.exit_code, "timed_out": cmd.timed_out,
                                                        "output": cmd.output}}


def _print_table(rows: list[CheckRow], errors: list[Exception], verbose: bool) -> None:
    width = max([len(r.task.task_id) for r in rows] + [4])
    print(f"{'task':<{width}}  {'family':<14} {'difficulty':<10} {'oracle':<12} {'empty':<12} verdict")
    for row in rows:
        print(f"{row.task.task_id:<{width}}  {row.task.family:<14} {row.task.difficulty:<10} "
              f"{_cell(row.oracle):<12} {_cell(row.empty):<12} {'ok' if row.ok else 'FAIL'}")
        for reason in row.reasons():
            print(f"    {reason}")
        if verbose:
            for note in row.notes:
                print(f"    note: {note}")
            if row.oracle_cmd is not None:
                print("    oracle output:\n" + _indent(row.oracle_cmd.output or "(none)"))
            for name, r in (("oracle", row.oracle), ("empty run", row.empty)):
                if r is not None:
                    print(f"    test.sh output ({name}):\n" + _indent(r.output_tail or "(none)"))
    for e in errors:
        print(f"INVALID  {e}")


def _replay(args: argparse.Namespace) -> int:
    from minirsi.env.tasks import load_task

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
    p.add_argument("-v", "--verbose", action="store_true", help="print whole logs (oracle and test.sh output)")
    p.add_argument("--json", action="store_true", help="print a machine-readable report instead of the table")
    p.add_argument("--no-prepare", dest="prepare", action="store_false",
                   help="do not prepare missing environment layers (report the command to run instead)")
    p = sub.add_parser("prepare", help="build the environment layers of tasks with a Dockerfile (needs the network)")
    p.add_argument("dirs", nargs="+", help="task directories or directories of tasks")
    p.add_argument("-q", "--quiet", action="store_true", help="print only failures and the summary")
    p = sub.add_parser("layers", help="list the prepared layers (kind, key, disk, build time) and their total disk")
    p = sub.add_parser("replay", help="run a JSON list of commands as the agent, then the verifier")
    p.add_argument("dir", help="one task directory")
    p.add_argument("--commands", required=True, help="JSON file: a list of command strings")
    p.add_argument("--backend", choices=BACKENDS, default="bwrap")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per command")
    args = parser.parse_args(argv)
    if getattr(args, "jobs", 1) < 1:
        parser.error("--jobs must be at least 1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return {"check": _check, "prepare": _prepare, "layers": _layers, "replay": _replay}[args.action](args)


if __name__ == "__main__":
    sys.exit(cli())

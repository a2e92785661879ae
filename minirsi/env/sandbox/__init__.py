"""Sandboxes: one persistent shell per episode, in a jail the agent cannot leave.

The interface every backend implements (the rollout engine and the verifier use only this)::

    with open_sandbox(task, backend="bwrap") as sb:      # or backend="docker"
        r = sb.run("cd src && export N=3", timeout=10)   # CommandResult
        r = sb.run("echo $N; pwd", timeout=10)           # "3\\n/app/src\\n": state persists
        result = minirsi.env.verifier.verify(sb, task)       # ends the agent, runs tests/test.sh

``CommandResult(output, exit_code, timed_out, truncated)``:

- ``output``: stdout and stderr interleaved as a terminal shows them, decoded as UTF-8 with
  replacement characters for bad bytes. Capped at ``max_output_bytes`` (default 16 KiB):
  the first and last halves are kept around a ``[... N bytes omitted ...]`` marker.
- ``exit_code``: the command's status; ``None`` when it timed out.
- ``timed_out``: the command outlived ``timeout``. Every process the agent started in this
  episode (the command, its children, and anything left in the background) is then killed;
  the shell survives, with its cwd and variables. If the shell itself is what runs forever
  (a builtin loop such as ``while :; do :; done``) the shell is replaced by a new one started in
  the last known cwd, so variables are lost; the output says so.
- A command that ends the shell (``exit``, ``set -e`` then a failure, ``kill -9 -1``) gets
  its output and the shell's status; the next command starts a new shell in the last cwd.

Every command runs with stdin at /dev/null (no interactive programs: a REPL gets EOF).

``SandboxError`` (a RuntimeError) means the sandbox itself failed (it could not start, or
died in a way a new shell cannot repair); the caller records a failed episode.

Backends: ``minirsi.env.sandbox.bwrap`` (bubblewrap, the default, local) and
``minirsi.env.sandbox.docker`` (Docker SDK). The shared shell protocol lives in ``shell.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pathlib import Path

    from minirsi.env.tasks import Task

BACKENDS = ("bwrap", "docker")


class SandboxError(RuntimeError):
    """The sandbox failed (could not start, or died beyond repair)."""


@dataclass(frozen=True)
class CommandResult:
    output: str
    """stdout+stderr, decoded with replacement, head+tail kept when over the cap."""
    exit_code: int | None
    """The command's exit status; None when it timed out."""
    timed_out: bool
    truncated: bool
    """True when output bytes were omitted."""


@dataclass(frozen=True)
class TestRun:
    """What the verifier phase produced: tests/test.sh's output and /logs/verifier's files."""

    output: str
    exit_code: int | None
    timed_out: bool
    files: dict[str, bytes]
    """File name -> contents of every regular file test.sh left in /logs/verifier."""


@runtime_checkable
class Sandbox(Protocol):
    """A persistent shell in a jail. Safe to call from any thread (calls are serialised)."""

    def run(self, command: str, timeout: float) -> CommandResult: ...

    def close(self) -> None: ...

    def __enter__(self) -> "Sandbox": ...

    def __exit__(self, *exc: Any) -> None: ...

    def stop_agent(self) -> None:
        """Kill every agent process; afterwards `run` raises SandboxError."""

    def run_verifier(self, tests_dir: "Path", script: str, plugin: "Path", env: dict[str, str], timeout: float) -> TestRun:
        """Run `bash /tests/<script>` offline with `tests_dir` at /tests (read-only; on a prepared
        layer writable, as Harbor's /tests: pass a copy), the work directory as the agent left
        it, a fresh /tmp and a fresh empty /logs/verifier; the pytest plugin file at
        /opt/minirsi/minirsi_junit.py with PYTEST_PLUGINS=minirsi_junit."""


def open_sandbox(task: "Task", backend: str = "bwrap", **limits: Any) -> Sandbox:
    """Open a sandbox for `task`: a fresh work directory from `environment/`, setup run, shell up.

    limits (all optional): memory_mb (default: the task's, else 2048), pids (256),
    max_output_bytes (16384), file_size_mb (1024), tmp_size_mb (256); bwrap: rootfs
    ($MINIRSI_ROOTFS); docker: image (built from environment/Dockerfile, else
    minirsi-base:bookworm).
    """
    if backend == "bwrap":
        from minirsi.env.sandbox.bwrap import BwrapSandbox

        return BwrapSandbox(task, **limits)
    if backend == "docker":
        from minirsi.env.sandbox.docker import DockerSandbox

        return DockerSandbox(task, **limits)
    raise ValueError(f"unknown sandbox backend {backend!r}; use one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "CommandResult", "Sandbox", "SandboxError", "TestRun", "open_sandbox"]

"""The persistent-shell protocol both backends share.

One long-lived ``bash`` (the *driver*) runs inside the jail with its stdin and stdout on pipes
(bwrap) or on an attached socket (docker). For each command the host writes one line::

    __m_tok=__MINIRSI_<random>__; __m_cmd=$'<the command, every unsafe byte as \\xHH>'

and the driver ``eval``s the command in its own process (so ``cd`` and ``export`` persist) with
stdin at /dev/null, then prints ``\\n<token> <status> <cwd>``. The host reads until that marker:
everything before it is the command's output. The token is fresh per command, so no earlier
output can end a later command. Cost per command: one pipe round trip plus bash reading the line
(no fork), well under a millisecond of overhead beyond what the command itself costs.

A backend supplies the transport (``_spawn``, ``_write``, ``_read``, ``_exit_status``) and the
killing (``_kill_agent_processes``: all but the driver; ``_kill_jail``: everything).
"""

from __future__ import annotations

import abc
import logging
import secrets
import threading
import time
from typing import Any

from minirsi.env.sandbox import CommandResult, SandboxError

logger = logging.getLogger(__name__)

DRIVER = r"""exec 2>&1
cd -- "$MINIRSI_START_DIR" 2>/dev/null || cd -- "$MINIRSI_WORKDIR"
unset MINIRSI_START_DIR MINIRSI_WORKDIR
builtin printf '%s\n' "$1"
shift
while IFS= builtin read -r __m_line; do
  builtin eval "$__m_line"
  builtin eval "$__m_cmd" </dev/null
  __m_rc=$?
  builtin printf '\n%s %d %s\n' "$__m_tok" "$__m_rc" "$PWD"
done
"""
# Seconds a killed command gets to let the driver print its marker before the shell is replaced.
KILL_GRACE_SEC = 1.0
# Seconds between kill rounds while a timed-out command line winds down.
KILL_INTERVAL_SEC = 0.05
# Seconds a fresh jail gets to print its ready line.
START_TIMEOUT_SEC = 30.0
# Respawns allowed per episode before the sandbox counts as broken.
MAX_RESPAWNS = 50


def ansi_c_quote(command: str) -> str:
    """Quote `command` as bash's $'...' so the whole command fits on one line, byte-exact.

    NUL bytes cannot live in a bash string and are dropped.
    """
    out = ["$'"]
    for b in command.encode("utf-8", errors="surrogateescape"):
        if b == 0:
            continue
        if 32 <= b < 127 and b not in (0x27, 0x5C):  # printable ASCII except ' and backslash
            out.append(chr(b))
        else:
            out.append(f"\\x{b:02x}")
    out.append("'")
    return "".join(out)


class OutputCap:
    """Keep the first and last `limit // 2` bytes of a stream and count what lies between."""

    def __init__(self, limit: int):
        self.half = max(1, limit // 2)
        self.head = bytearray()
        self.tail = bytearray()
        self.omitted = 0

    def add(self, data: bytes) -> None:
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        self.tail += data
        if len(self.tail) > self.half:
            drop = len(self.tail) - self.half
            self.omitted += drop
            del self.tail[:drop]

    def text(self) -> tuple[str, bool]:
        head = self.head.decode("utf-8", errors="replace")
        tail = self.tail.decode("utf-8", errors="replace")
        if self.omitted:
            return f"{head}\n[... {self.omitted} bytes omitted ...]\n{tail}", True
        return head + tail, False


class ShellSandbox(abc.ABC):
    """Base class: the command protocol, timeouts, respawn, locking. Backends fill the hooks."""

    def __init__(self, task: Any, max_output_bytes: int = 16384):
        if max_output_bytes < 64:
            raise ValueError(f"max_output_bytes={max_output_bytes} is too small; use at least 64 (default 16384)")
        self.task = task
        self.max_output_bytes = max_output_bytes
        self._lock = threading.RLock()
        self._cwd = task.workdir
        self._pending = bytearray()  # bytes read past the last marker (background output)
        self._alive = False
        self._closed = False
        self._agent_stopped = False
        self._respawns = 0

    # --- hooks ------------------------------------------------------------------------------
    @abc.abstractmethod
    def _spawn(self, start_dir: str, ready: str) -> None:
        """Start a jail whose driver runs `bash -c DRIVER bash <ready>` in `start_dir`."""

    @abc.abstractmethod
    def _write(self, data: bytes) -> None:
        """Send bytes to the driver's stdin."""

    @abc.abstractmethod
    def _read(self, timeout: float) -> bytes | None:
        """Bytes available within `timeout` (b"" if none); None at EOF (the driver is gone)."""

    def _exit_status(self) -> int | None:
        """The driver's exit status once it has ended, if the backend can tell."""
        return None

    def _task_env(self) -> dict[str, str]:
        """The task's ``[environment.env]`` variables (for the agent's shell and the setup)."""
        return dict(getattr(self.task, "agent_env", None) or {})

    def _driver_env(self, start_dir: str) -> dict[str, str]:
        """The environment ``_spawn`` starts ``DRIVER`` with: the task's variables and the two
        directories the driver reads (and unsets) before the agent's first command."""
        return {**self._task_env(), "MINIRSI_START_DIR": start_dir, "MINIRSI_WORKDIR": self.task.workdir}

    def _on_ready(self) -> None:
        """Called once the driver has printed its ready line (e.g. to note its pid)."""

    @abc.abstractmethod
    def _kill_agent_processes(self) -> None:
        """Kill every process in the jail except the driver (and the jail's own init)."""

    @abc.abstractmethod
    def _kill_jail(self) -> None:
        """End the jail and every process in it."""

    @abc.abstractmethod
    def close(self) -> None:
        """End the jail and free everything the sandbox holds (idempotent)."""

    # --- lifecycle ----------------------------------------------------------------------------
    def _start_shell(self) -> None:
        ready = f"__MINIRSI_READY_{secrets.token_hex(8)}__"
        self._spawn(self._cwd, ready)
        self._pending.clear()
        buf = bytearray()
        deadline = time.monotonic() + START_TIMEOUT_SEC
        while ready.encode() not in buf:
            if time.monotonic() > deadline:
                self._kill_jail()
                raise SandboxError(f"the sandbox shell did not start within {START_TIMEOUT_SEC:.0f}s: {bytes(buf[-2000:])!r}")
            chunk = self._read(deadline - time.monotonic())
            if chunk is None:
                self._kill_jail()
                raise SandboxError(f"the sandbox shell failed to start: {buf.decode(errors='replace')[-2000:]}")
            buf += chunk
        rest = buf.split(ready.encode() + b"\n", 1)
        self._pending += rest[1] if len(rest) > 1 else b""
        self._alive = True
        self._on_ready()

    def _respawn(self) -> None:
        self._respawns += 1
        if self._respawns > MAX_RESPAWNS:
            raise SandboxError(f"the shell died {self._respawns} times in one episode; giving up")
        self._kill_jail()
        self._start_shell()

    def __enter__(self) -> "ShellSandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- the command protocol -----------------------------------------------------------------
    def run(self, command: str, timeout: float) -> CommandResult:
        """Run `command` in the episode's shell; see the package docstring for the semantics."""
        if timeout <= 0:
            raise ValueError(f"timeout={timeout} must be positive (seconds)")
        with self._lock:
            if self._closed or self._agent_stopped:
                raise SandboxError("run() after the agent was stopped or the sandbox was closed")
            if not self._alive:
                self._respawn()
            token = f"__MINIRSI_{secrets.token_hex(8)}__"
            line = f"__m_tok={token}; __m_cmd={ansi_c_quote(command)}\n".encode()
            try:
                self._write(line)
            except (OSError, SandboxError):  # the driver died since the last command
                self._alive = False
                self._respawn()
                self._write(line)
            try:
                return self._collect(token.encode(), time.monotonic() + timeout)
            except OSError as e:
                self._alive = False
                raise SandboxError(f"lost the sandbox shell: {type(e).__name__}: {e}") from e

    def _collect(self, token: bytes, deadline: float) -> CommandResult:
        marker = b"\n" + token + b" "
        cap = OutputCap(self.max_output_bytes)
        buf = self._pending
        self._pending = bytearray()
        timed_out = False
        grace_deadline = next_kill = 0.0
        notes: list[str] = []
        while True:
            idx = buf.find(marker)
            if idx >= 0:
                end = buf.find(b"\n", idx + len(marker))
                if end >= 0:
                    cap.add(bytes(buf[:idx]))
                    status, _, cwd = bytes(buf[idx + len(marker):end]).decode(errors="replace").partition(" ")
                    self._cwd = cwd or self._cwd
                    self._pending = bytearray(buf[end + 1:])
                    code = None if timed_out else int(status)
                    return self._result(cap, code, timed_out, notes)
            else:
                keep = len(marker) - 1  # a marker may straddle two reads
                if len(buf) > keep:
                    cap.add(bytes(buf[:-keep]))
                    del buf[:-keep]
            now = time.monotonic()
            if not timed_out and now >= deadline:
                timed_out = True
                grace_deadline = now + KILL_GRACE_SEC
                notes.append("[minirsi: the command timed out; every process it started was killed]")
            if timed_out and now >= next_kill:
                # Kill again and again until the driver prints its marker: the rest of the command
                # line (`sleep 1; sleep 1`) must not start new processes after the timeout.
                self._kill_agent_processes()
                next_kill = time.monotonic() + KILL_INTERVAL_SEC
            if timed_out and now >= grace_deadline:
                # The shell itself is busy (a builtin loop): replace it, keeping the cwd.
                self._kill_jail()
                self._alive = False
                cap.add(bytes(buf))
                notes.append(f"[minirsi: the shell was stuck and was replaced; a new shell starts in {self._cwd}, shell variables were lost]")
                return self._result(cap, None, True, notes)
            chunk = self._read(max(0.0, (min(grace_deadline, next_kill) if timed_out else deadline) - now))
            if chunk is None:  # the driver ended: `exit`, `set -e`, kill -9 -1, out of memory
                cap.add(bytes(buf))
                code = self._exit_status()
                self._kill_jail()
                self._alive = False
                notes.append(f"[minirsi: the shell exited; the next command starts a new shell in {self._cwd}]")
                return self._result(cap, None if timed_out else code, timed_out, notes)
            buf += chunk

    @staticmethod
    def _result(cap: OutputCap, code: int | None, timed_out: bool, notes: list[str]) -> CommandResult:
        text, truncated = cap.text()
        if notes:
            text = text + ("" if not text or text.endswith("\n") else "\n") + "\n".join(notes) + "\n"
        return CommandResult(output=text, exit_code=code, timed_out=timed_out, truncated=truncated)

    def stop_agent(self) -> None:
        """End the agent's jail: no agent process survives into the verifier phase."""
        with self._lock:
            self._agent_stopped = True
            self._alive = False
            self._kill_jail()

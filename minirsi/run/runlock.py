"""One process at a time in a run directory: an flock on ``RUN_DIR/run.lock`` naming its holder.

Two ``minirsi run`` processes on one run directory would corrupt it: a ``--resume`` deletes the
unfinished stage that the live run is writing, both append to ``metrics.jsonl``, both write
``DONE.json``. ``rundir.run_stages`` therefore holds this lock from before it reads the
directory until it returns::

    fd = open(RUN_DIR/run.lock, O_RDWR | O_CREAT)   # not truncated: the holder's record stays
    flock(fd, LOCK_EX | LOCK_NB)                     # refused at once while a live process holds it
    truncate, write {"pid", "host", "argv", "since"} # who holds it, for the next one's message

Why ``flock``: the kernel releases the lock when the holding process ends, however it ends
(SIGKILL, out of memory, a crash), so a lock cannot outlive its holder. What a dead holder leaves
is the file and its record; the next run takes the lock and logs whose it was ("stale: pid N is
gone"). A bare PID file would need a liveness check, which races with PID reuse, and a lock
library adds nothing here (``filelock`` is itself ``flock`` on Linux and records no holder).
The file is never deleted: unlinking a lock file lets two processes lock two different inodes.

The lock belongs to the open file description: the descriptor is close-on-exec (Python's
default), so sandboxes and other programs the run starts do not hold it.

Sharded runs (torchrun, accelerate launch): rank 0 owns the run directory (``rundir``), so rank 0
alone takes the lock; when a second launch's rank 0 is refused, ``rundir._on_main`` raises the
refusal on every rank of that launch. A rank whose launcher died exits (``distributed.init``'s
watchdog), which releases the lock with it.

Limits: the lock is as good as the file system's ``flock``: local file systems and NFSv4 (Linux
maps ``flock`` to byte-range locks there) work; a file system without lock support between two
hosts does not see the other host's lock.

Call::

    with RunLock.acquire(run_dir):      # raises RunDirBusy naming the holder's PID
        ...
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LOCK_NAME = "run.lock"


class RunDirBusy(RuntimeError):
    """Another live process holds the run directory's lock; the message names it."""

    def __init__(self, message: str, holder: dict[str, Any]):
        super().__init__(message)
        self.holder = holder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def _read(fd: int) -> dict[str, Any]:
    """The record in the lock file ({} when empty or not a record)."""
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 65536)
    try:
        rec = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return rec if isinstance(rec, dict) else {}


class RunLock:
    """An exclusive lock on one run directory, held until ``release`` (or the process ends)."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, run_dir: str | Path) -> "RunLock":
        """Lock ``run_dir`` (created when missing). Raises ``RunDirBusy`` naming the holder when
        a live process has it; takes over, with a log line, the record a dead holder left."""
        root = Path(run_dir)
        root.mkdir(parents=True, exist_ok=True)
        path = root / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise RunDirBusy(_busy_message(root, path, holder), holder) from None
        except BaseException:
            os.close(fd)
            raise
        previous = _read(fd)
        if previous.get("pid"):
            where = "" if previous.get("host") in (None, socket.gethostname()) else f" on {previous['host']}"
            logger.warning("%s: taking over the lock of pid %s%s (%s), which is no longer running", path,
                           previous["pid"], where, " ".join(previous.get("argv", [])) or "command unknown")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "argv": list(sys.argv),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        return cls(path, fd)

    def release(self) -> None:
        """Unlock (idempotent). The file stays, with the last holder's record."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _busy_message(root: Path, path: Path, holder: dict[str, Any]) -> str:
    pid, host = holder.get("pid"), holder.get("host")
    if not pid:  # it locked the file a moment ago and has not written its record yet
        who = "a process that is starting right now (no record yet)"
    else:
        here = host in (None, socket.gethostname())
        who = f"pid {pid}" + ("" if here else f" on host {host}")
        if holder.get("argv"):
            who += f" ({' '.join(holder['argv'])}, since {holder.get('since', '?')})"
        if here and not _alive(int(pid)):  # its record, but another process has the lock now
            who = f"a process that is starting right now (the record of pid {pid} is stale)"
    return (f"{root} is in use: {who} holds {path}. Two runs in one directory would corrupt it. Wait for "
            f"that run to end, or stop it (kill {pid or 'PID'}), then `minirsi run --resume {root}`; or pick "
            f"another --out directory.")

"""The local sandbox backend: bubblewrap over a read-only Debian rootfs.

The jail of one episode::

    /              a read-only tmpfs; every top-level entry of $MINIRSI_ROOTFS bound read-only into it
    /proc /dev     fresh (new pid namespace: the agent sees only its own processes)
    /tmp           a fresh tmpfs (tmp_size_mb)
    <workdir>      read-write: a fresh host copy of environment/ (minus Dockerfile and setup)
    /etc/passwd    the rootfs's, plus `agent` (uid 1000, HOME=/tmp)

A task with ``environment/Dockerfile`` runs on its prepared layers (minirsi/env/layers.py) over its
base rootfs (``Prepared.base``: $MINIRSI_ROOTFS, or the Debian 13 one for a debian image that is
Debian 13 today) the way Harbor runs it in one Docker container: the agent, the setup script and
then the verifier are root (uid 0 inside, still the unprivileged host uid outside, with Docker's
default capabilities inside the user namespace only) on one writable root per episode: an
overlay of the layers over the base rootfs whose changes go to the sandbox's own directory and
die with it (overlay_root.py, which mounts the layers idmapped so that the jail's root owns the
image's files). The agent may write anywhere (``/usr/local/bin``, ``/etc``, ``useradd``); /tmp
and the workdir are one mount (``mv /app/x /tmp`` works); the verifier sees every change; the
layers, the rootfs, other episodes and the host see none. The verifier adds /tests (a writable
throwaway copy, as Harbor's), the test tools (read-only, /opt/minirsi-tools) and the offline
stand-ins of verifier_shims.py first on PATH (/opt/minirsi/bin), HOME=/root. What test.sh itself
runs (bash, env, the Python interpreter, its standard library and system site-packages, the
shared libraries, the loader's configuration: ``verifier_pins``) is taken from the pristine
image, not from the episode, so an agent cannot forge the reward by replacing them (what the agent
installed from the task's package index, read-only at /opt/minirsi-index for agent and verifier,
is the verifier's as the index's clean copy: minirsi/env/wheelhouse.py); the agent's
programs that a test executes still run with the verifier's rights (a property of the task). No
agent process survives into the verifier (Harbor keeps them: a server the agent leaves running
is gone here). The disk an episode may fill is bounded only per file (``file_size_mb``).

namespaces: user (uid/gid 1000 inside on the base rootfs, 0 on a layer), pid, net (no interface
but loopback: offline), ipc, uts; ``--die-with-parent`` and ``--new-session``. ``tests/`` and
``solution/`` are never mounted while the agent acts. On a layer ``localhost`` resolves, as in
Docker (an /etc/hosts of the episode's own where the image has none).

Limits, and why they hold. When minirsi runs as root (as in CI), a user namespace would map the
sandbox's uid to host root, and the kernel exempts root from RLIMIT_NPROC, so a fork bomb would
be unbounded. So each sandbox leases a *unique unprivileged host uid* (200000 + k, held by a
lock file) and runs bwrap as that uid (``setpriv``): RLIMIT_NPROC (``pids``) then counts only
this sandbox's processes, and the uid also finds every one of them for the final sweep. The
rootfs may sit under /root (mode 0700), which that uid cannot traverse, so the launch first
enters a private mount namespace (``unshare -m``) and binds the rootfs at a world-readable
mount point there; the host's mounts are untouched. Memory (``memory_mb``): on a layer, where
the host gives root a writable memory cgroup (v1, or v2 with the controller delegated), a cgroup
of the whole jail, as Docker's limit is (a process past it is killed; address space that is only
reserved, as Chromium, V8 and the JVM reserve it, costs nothing); otherwise RLIMIT_AS per process.
File size is RLIMIT_FSIZE, time is the per-command timeout.
Run as a normal user instead, bwrap maps that user's uid and RLIMIT_NPROC counts all of the
user's processes: the limit is set to (the user's current process count + pids).

Call through ``minirsi.env.sandbox.open_sandbox(task, backend="bwrap", **limits)``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from minirsi.env.sandbox import SandboxError, TestRun
from minirsi.env.sandbox.shell import DRIVER, OutputCap, ShellSandbox

logger = logging.getLogger(__name__)

SANDBOX_UID = 1000  # the agent's uid inside the jail
UID_BASE, UID_COUNT = 200000, 60000  # host uids leased to sandboxes when running as root
_ENV_SKIP = {"Dockerfile", ".dockerignore", "docker-compose.yaml", "docker-compose.yml"}
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SHIM_BIN = "/opt/minirsi/bin"
SHIM_SOURCE = Path(__file__).parent / "verifier_shims.py"
SHIMS = ("apt-get", "apt", "curl", "uv", "uvx", "sudo", "pip", "pip3", "pytest")
OVERLAY_ROOT = Path(__file__).parent / "overlay_root.py"
SWEEP_SECONDS = 20.0  # how long the final sweep waits for a killed process to go
HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\tsandbox\n"
# What the verifier takes from the pristine image rather than from the episode (on a layer): what
# test.sh and the stand-ins run (the shell, env, the Python interpreter, its standard library and
# system site-packages, the shared libraries and the loader's configuration), so that an agent
# cannot forge the reward by replacing them. Names test.sh may run bare are pinned in every PATH
# directory (hidden where the image has none).
_PINNED = ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr/lib64", "usr/bin/bash", "usr/bin/dash", "usr/bin/sh",
           "usr/bin/env", "etc/ld.so.preload", "etc/ld.so.cache", "etc/ld.so.conf", "etc/ld.so.conf.d",
           "usr/lib/python3")
_PINNED_NAMES = ("python", "python3", "bash", "sh", "env")


def verifier_pins(layers: list[Path]) -> list[str]:
    """The paths the verifier takes from the pristine image (top layer first, the rootfs last):
    _PINNED, the shared-library directories, and each Python the image has with its library."""
    def find(rel: str) -> Path | None:
        return next((layer / rel for layer in layers if os.path.lexists(layer / rel)), None)

    pins = list(_PINNED)
    for layer in layers:
        pins += [f"usr/lib/{p.name}" for p in (layer / "usr/lib").glob("*-linux-gnu*") if p.is_dir()]
    for d in ("usr/local/sbin", "usr/local/bin", "usr/sbin", "usr/bin"):
        pins += [f"{d}/{name}" for name in _PINNED_NAMES]
    for d in ("usr/local/bin", "usr/bin"):
        for name in ("python3", "python"):
            path = find(f"{d}/{name}")
            while path is not None and path.is_symlink():  # python3 -> python3.11
                target = os.readlink(path)
                path = find(os.path.normpath(os.path.join(d, target))) if not target.startswith("/") else find(target.lstrip("/"))
                if path is not None:
                    pins.append(str(path.relative_to(next(layer for layer in layers if path.is_relative_to(layer)))))
    for version in {Path(p).name for p in pins if Path(p).name.startswith("python3.")}:
        pins += [f"usr/lib/{version}", f"usr/local/lib/{version}"]
    return list(dict.fromkeys(pins))


def _is_whiteout(path: str) -> bool:
    """An overlayfs whiteout (a 0/0 character device): a name the layer deleted."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (st.st_mode & 0o170000) == 0o020000 and st.st_rdev == 0


def default_rootfs() -> Path:
    return Path(os.environ.get("MINIRSI_ROOTFS", Path.home() / ".cache/minirsi/rootfs"))


def _base_dir() -> Path:
    base = Path(os.environ.get("MINIRSI_SANDBOX_TMP", "/tmp/minirsi-sandboxes"))
    (base / ".uids").mkdir(parents=True, exist_ok=True)
    (base / ".rootfs-mnt").mkdir(exist_ok=True)
    os.chmod(base, 0o755)
    return base


def _memory_cgroup_parent() -> tuple[Path, str] | None:
    """Where a sandbox's memory cgroup can be made (root only): (this process's memory cgroup
    directory, "v1" or "v2"), or None (then memory is a per-process address-space limit)."""
    if os.geteuid() != 0:
        return None
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        groups = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:  # "... - cgroup cgroup rw,memory" (v1) or "... - cgroup2 cgroup2 rw" (v2)
        fields = line.split()
        fstype, options = fields[fields.index("-") + 1], fields[-1].split(",")
        mount = Path(fields[4])
        if fstype == "cgroup" and "memory" in options:
            rel = next((g.split(":", 2)[2] for g in groups if "memory" in g.split(":", 2)[1].split(",")), None)
            version = "v1"
        elif fstype == "cgroup2" and "memory" in (mount / "cgroup.controllers").read_text().split():
            rel = next((g.split(":", 2)[2] for g in groups if g.startswith("0::")), None)
            version = "v2"
        else:
            continue
        d = mount / (rel or "/").lstrip("/")
        if version == "v2" and "memory" not in (d / "cgroup.subtree_control").read_text().split():
            continue  # v2 hands the controller to children only when the parent delegates it
        if d.is_dir() and os.access(d, os.W_OK):
            return d, version
    return None


class _MemoryCgroup:
    """A memory cgroup of one sandbox: the whole jail's memory is limited, as Docker's is."""

    def __init__(self, parent: tuple[Path, str], name: str, limit_bytes: int):
        self.path, self.version = parent[0] / f"minirsi-{name}", parent[1]
        self.path.mkdir()
        try:
            if self.version == "v1":
                (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                try:  # no swapping past the limit, where swap accounting is on
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
                except OSError:
                    pass
            else:
                (self.path / "memory.max").write_text(str(limit_bytes))
                (self.path / "memory.swap.max").write_text("0")
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        for _ in range(100):  # empty once the jail's processes are reaped
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)
        logger.warning("could not remove the memory cgroup %s", self.path)


class _UidLease:
    """A host uid no other live sandbox holds (an flock on base/.uids/<uid>)."""

    def __init__(self, base: Path):
        rng = random.SystemRandom()
        for _ in range(1000):
            uid = UID_BASE + rng.randrange(UID_COUNT)
            fd = os.open(base / ".uids" / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise SandboxError("could not lease a free sandbox uid after 1000 tries")

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def remove_stale(base: Path) -> int:
    """Delete sandbox directories left by a harness that was killed (root mode).

    A directory is named ``<uid>-<task>-<random>``; it is stale when no live process holds the
    lease on <uid> (leases are taken before directories are made, and die with their process).
    Returns how many were removed.
    """
    removed = 0
    for d in base.iterdir():
        uid = d.name.split("-", 1)[0]
        if not (d.is_dir() and uid.isdigit() and (base / ".uids" / uid).exists()):
            continue
        fd = os.open(base / ".uids" / uid, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live sandbox holds it
        finally:
            os.close(fd)  # closing also drops the lock if we took it
        shutil.rmtree(d, ignore_errors=True)
        cgroup = _memory_cgroup_parent()
        if cgroup is not None:
            try:
                (cgroup[0] / f"minirsi-{d.name}").rmdir()
            except OSError:
                pass
        removed += 1
    return removed


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...), or None if the
    process is gone. Raw ``os`` calls: this runs hundreds of times a scan, and a Python file
    object costs several times the three system calls."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, 1024)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data.rpartition(b")")[2].split()


def _ppid(pid: int | str) -> int | None:
    """The parent pid of ``pid`` (None if the process is gone)."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields and len(fields) > 1 else None


def _children() -> dict[int, list[int]]:
    """ppid -> child pids, from /proc."""
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            ppid = _ppid(name)
            if ppid is not None:
                out.setdefault(ppid, []).append(int(name))
    return out


def _children_of(ppid: int) -> list[int]:
    """Children of ``ppid``, reading the processes started after it first (a child's pid is
    larger than its parent's unless pids wrapped around; then the rest are read too)."""
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    found: list[int] = []
    for newer in (True, False):
        for pid in pids:
            if (pid > ppid) == newer and _ppid(pid) == ppid:
                found.append(pid)
        if found:
            break
    return found


def _descendants(pid: int) -> set[int]:
    tree, seen, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def _pids_of_uid(uid: int) -> list[int]:
    """Live (not zombie) processes whose owner is `uid`."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid != uid:
                    continue
            except OSError:
                continue
            fields = _stat_fields(name)
            if fields and fields[0] != b"Z":
                pids.append(int(name))
    return pids


def _end_jail(proc: subprocess.Popen, init: int | None = None) -> int:
    """Kill the jail's pid-namespace init (the kernel then kills everything in the namespace)
    and reap bwrap. Killing bwrap itself first would orphan the init as a zombie of host pid 1.
    ``init``: its host pid when known (bwrap's --info-fd), else found among bwrap's children.
    """
    if init is not None:
        # Still bwrap's child? (else its pid may have been reused)
        _kill_all([init] if _ppid(init) == proc.pid else [])
    else:
        _kill_all(_children_of(proc.pid))
    try:
        return proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        _kill_all([proc.pid])
        return proc.wait()


def _kill_all(pids: set[int] | list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class BwrapSandbox(ShellSandbox):
    def __init__(self, task: Any, memory_mb: int | None = None, pids: int = 256, max_output_bytes: int = 16384,
                 file_size_mb: int = 1024, tmp_size_mb: int = 256, rootfs: str | Path | None = None):
        super().__init__(task, max_output_bytes)
        self._proc: subprocess.Popen | None = None
        self._dir: Path | None = None
        self._lease: _UidLease | None = None
        self.rootfs = Path(rootfs) if rootfs else default_rootfs()
        if not (self.rootfs / "usr/bin/bash").exists():
            raise SandboxError(f"no rootfs at {self.rootfs} (usr/bin/bash missing). Fix: run scripts/setup.sh or set MINIRSI_ROOTFS")
        if shutil.which("bwrap") is None:
            raise SandboxError("bwrap is not installed. Fix: apt-get install bubblewrap (scripts/setup.sh does it)")
        self.prepared = self._find_layers(task)
        self.memory_mb = memory_mb or task.memory_mb or 2048
        self.pids, self.file_size_mb, self.tmp_size_mb = pids, file_size_mb, tmp_size_mb
        self._as_root = os.geteuid() == 0
        self._base = _base_dir()
        self._lease = _UidLease(self._base) if self._as_root else None
        self.host_uid = self._lease.uid if self._lease else os.geteuid()
        self._protected: set[int] = set()
        self._init: int | None = None  # host pid of the shell jail's init
        self._info_fd: int | None = None  # read end of bwrap's --info-fd, until the shell is ready
        self._runs = 0
        self._cgroup: _MemoryCgroup | None = None  # on a layer, where this host has one
        try:
            if self._as_root:
                remove_stale(self._base)
            self._dir = Path(tempfile.mkdtemp(prefix=f"{self.host_uid}-{task.task_id[:40]}-", dir=self._base))
            os.chmod(self._dir, 0o755)
            parent = _memory_cgroup_parent() if self.prepared is not None else None
            if parent is not None:
                self._cgroup = _MemoryCgroup(parent, self._dir.name, self.memory_mb << 20)
            self.workdir_host = self._dir / "work"
            self._populate()
            if task.setup_script is not None:
                self._run_setup()
            self._start_shell()
        except BaseException:
            self.close()
            raise

    def _find_layers(self, task: Any) -> Any:
        """The prepared layers of a task with a Dockerfile (None for a task without one, or with
        ``runs_on_base = true``); SandboxError saying which command prepares them."""
        gpus = task.environment.get("gpus", 0)
        if isinstance(gpus, (int, float)) and gpus > 0:
            raise SandboxError(f"task {task.task_id} asks for gpus = {gpus} in task.toml; the local sandbox has no GPU. "
                               "Fix: use --backend docker on a machine with a GPU")
        if not task.uses_layer:
            return None
        from minirsi.env.dockerfile import DockerfileError
        from minirsi.env.prepare import find_prepared

        try:
            prepared = find_prepared(task, self.rootfs)
        except DockerfileError as e:
            raise SandboxError(f"task {task.task_id}: {e}") from e
        if prepared is None:
            raise SandboxError(f"task {task.task_id}: its environment/Dockerfile is not prepared for the local backend. "
                               f"Fix: minirsi task prepare {task.path} (needs the network once), or use --backend docker")
        if os.geteuid() != 0:
            raise SandboxError(f"task {task.task_id}: sandboxes on a prepared layer mount an overlay, which needs root. "
                               "Fix: run as root, or use --backend docker")
        return prepared

    # --- the work directory ------------------------------------------------------------------
    def _populate(self) -> None:
        if self.prepared is not None:
            return self._populate_from_layer()
        env_dir, setup = self.task.environment_dir, self.task.setup_script
        skip = set(_ENV_SKIP) | ({setup.name} if setup is not None and setup.parent == env_dir else set())
        if env_dir.is_dir():
            shutil.copytree(env_dir, self.workdir_host, symlinks=True,
                            ignore=lambda d, names: [n for n in names if Path(d) == env_dir and n in skip])
        else:
            self.workdir_host.mkdir()
        os.chmod(self.workdir_host, 0o755)
        self._write_passwd()
        if self._as_root:
            self._chown_tree(self.workdir_host)

    def _populate_from_layer(self) -> None:
        """A task with a Dockerfile: nothing is copied. The episode's root is an overlay of the
        layers (overlay_root.py) whose changes go to <dir>/upper, made here; the workdir is the
        layer's (its COPY and RUN results), created at the first mount if the layer lacks it."""
        for d in ("upper", "stage"):
            (self._dir / d).mkdir()
        if not any(os.path.lexists(layer / "etc/hosts") for layer in [*self.prepared.lowers(), self.prepared.base]):
            etc = self._dir / "upper" / "u" / "etc"  # merged with the image's /etc
            etc.mkdir(parents=True)
            (etc / "hosts").write_text(HOSTS)
            for path in (etc.parent, etc, etc / "hosts"):
                os.chown(path, self.host_uid, self.host_uid)
        self.workdir_host = self._dir / "upper" / "u" / self.task.workdir.lstrip("/")

    def _write_passwd(self) -> None:
        etc = self.rootfs / "etc"
        passwd = (etc / "passwd").read_text() + f"agent:x:{SANDBOX_UID}:{SANDBOX_UID}:agent:/tmp:/bin/bash\n"
        group = (etc / "group").read_text() + f"agent:x:{SANDBOX_UID}:\n"
        (self._dir / "passwd").write_text(passwd)
        (self._dir / "group").write_text(group)

    def _task_env(self) -> dict[str, str]:
        return {**self._layer_env(), **super()._task_env()}

    def _layer_env(self) -> dict[str, str]:
        """On a layer: the Dockerfile's ENV, and pip and uv pointed at the task's index alone."""
        if self.prepared is None:
            return {}
        from minirsi.env.wheelhouse import index_env

        return {**index_env(self.prepared.index_layer), **self.prepared.env}

    def _chown_tree(self, root: Path) -> None:
        os.chown(root, self.host_uid, self.host_uid, follow_symlinks=False)
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                os.chown(os.path.join(dirpath, name), self.host_uid, self.host_uid, follow_symlinks=False)

    # --- building the command line ------------------------------------------------------------
    def _argv(self, binds: list[str], env: dict[str, str], command: list[str], info_fd: int | None = None,
              verifier: bool = False) -> list[str]:
        """`verifier`: the verifier's jail (on a prepared layer: the test tools on top)."""
        if self.prepared is not None:
            return self._layer_argv(binds, env, command, info_fd, verifier)
        src = str(self._base / ".rootfs-mnt") if self._as_root else str(self.rootfs)
        workdir = self.task.workdir
        top = workdir.split("/")[1]
        args = self._bwrap(SANDBOX_UID, "agent", "/tmp", env, info_fd)
        entries = {e.name: Path(e.path) for e in os.scandir(self.rootfs)}
        for name, path in sorted(entries.items()):
            if name in ("proc", "dev", "sys", "tmp"):
                continue
            if path.is_symlink():
                args += ["--symlink", os.readlink(path), f"/{name}"]
            elif path.is_dir() and any(os.scandir(path)):
                args += ["--ro-bind", f"{src}/{name}", f"/{name}"]
            elif path.is_dir():
                args += ["--dir", f"/{name}"]
            else:
                args += ["--ro-bind", f"{src}/{name}", f"/{name}"]
        if (self.rootfs / top).is_symlink() or ((self.rootfs / top).is_dir() and any(os.scandir(self.rootfs / top))):
            if not (self.rootfs / workdir.lstrip("/")).is_dir():
                raise SandboxError(f"workdir {workdir} lies in the rootfs's /{top}, which is read-only and has no {workdir}. "
                                   "Fix: choose a workdir whose first component is not in the rootfs (e.g. /app)")
        args += ["--proc", "/proc", "--dev", "/dev", "--size", str(self.tmp_size_mb << 20), "--tmpfs", "/tmp",
                 "--ro-bind", str(self._dir / "passwd"), "/etc/passwd", "--ro-bind", str(self._dir / "group"), "/etc/group",
                 "--bind", str(self.workdir_host), workdir, *binds]
        # bwrap's root is a tmpfs the sandbox uid owns: make it read-only (no writes to /x,
        # /home, /opt; no filling memory through it).
        args += ["--remount-ro", "/"]
        args += ["--chdir", workdir, *command]
        limits = self._limits(address_space=True)
        if not self._as_root:
            return ["prlimit", *limits, "--", *args]
        # Private mount namespace: bind the rootfs where the unprivileged uid can reach it.
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"',
                "sh", str(self.rootfs), src, *self._drop(limits), *args]

    def _bwrap(self, uid: int, user: str, home: str, env: dict[str, str], info_fd: int | None) -> list[str]:
        """bwrap's namespaces, identity and environment, common to every jail."""
        args = ["bwrap", "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--uid", str(uid),
                "--gid", str(uid), "--hostname", "sandbox", "--clearenv"]
        if info_fd is not None:  # bwrap writes {"child-pid": <host pid of the namespace's init>}
            args += ["--info-fd", str(info_fd)]
        base_env = {"PATH": PATH, "HOME": home, "USER": user, "LOGNAME": user, "LANG": "C.UTF-8",
                    "TERM": "dumb", "SHELL": "/bin/bash"}
        for k, v in {**base_env, **env}.items():
            args += ["--setenv", k, v]
        return args

    def _limits(self, address_space: bool) -> list[str]:
        """prlimit's options: processes, file size, no core, open files; and RLIMIT_AS
        (``memory_mb`` per process) when `address_space`."""
        memory = [f"--as={self.memory_mb << 20}"] if address_space else []
        return [f"--nproc={self._nproc()}", *memory, f"--fsize={self.file_size_mb << 20}", "--core=0", "--nofile=1024"]

    def _drop(self, limits: list[str]) -> list[str]:
        """prlimit, then setpriv to the sandbox's host uid (root mode)."""
        return ["prlimit", *limits, "--", "setpriv", f"--reuid={self.host_uid}", f"--regid={self.host_uid}",
                "--clear-groups", "--inh-caps=-all", "--"]

    def _layer_argv(self, binds: list[str], env: dict[str, str], command: list[str], info_fd: int | None,
                    verifier: bool) -> list[str]:
        """A jail on prepared layers over their base rootfs (``prepared.base``, not ``self.rootfs``):
        root (uid 0 inside, the sandbox's host uid outside) on the episode's writable root, the same
        for the agent, the setup script and the verifier (as one container is in Harbor); Docker's
        default capabilities, inside the user namespace only."""
        from minirsi.env.layers import DOCKER_CAPS, TOOLS_DIR
        from minirsi.env.wheelhouse import INDEX_DIR, index_dir, verifier_overlays

        workdir, mnt = self.task.workdir, str(self._base / ".rootfs-mnt")
        stack = [*self.prepared.lowers(verifier), self.prepared.base]  # top layer first, the base last
        args = self._bwrap(0, "root", "/root", env, info_fd)
        args += ["--cap-drop", "ALL", *[a for c in DOCKER_CAPS for a in ("--cap-add", c)],
                 "--bind", mnt, "/", "--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/dev/shm", *binds,
                 "--chdir", workdir, *command]
        # memory: the jail's cgroup where there is one (Chromium, V8 and the JVM reserve far more
        # address space than they use), else the per-process address-space limit
        limits = self._limits(address_space=self._cgroup is None)
        mount = [sys.executable, "-I", "-S", str(OVERLAY_ROOT), "--uid", str(self.host_uid),
                 *[a for layer in stack for a in ("--lower", str(layer))],
                 "--stage", str(self._dir / "stage"), "--upper", str(self._dir / "upper"), "--target", mnt,
                 "--workdir", workdir]
        if self._cgroup is not None:
            mount += ["--cgroup", str(self._cgroup.path)]
        index = self.prepared.index_layer
        if index is not None:  # the task's package index, read-only, for the agent and the verifier
            mount += ["--bind", str(index_dir(index)), INDEX_DIR]
        if verifier:  # the mount points of run_verifier's binds
            mount += ["--dir", "/tests", "--dir", "/logs/verifier", "--dir", SHIM_BIN]
            if self.prepared.tools_dir is not None:
                mount += ["--bind", str(self.prepared.tools_dir), TOOLS_DIR]
            pins = verifier_pins(stack)
            mount += [a for pin in pins for a in ("--pin", pin)]
            if index is not None:  # what the agent installed from the index, as clean copies
                for path, root, names in verifier_overlays(index, self._dir / "upper" / "u", pins):
                    if any((layer / path).is_dir() for layer in stack):  # the mount point, in the pinned image
                        mount += ["--overlay", f"/{path}", str(root), ":".join(names)]
        return ["unshare", "-m", "--propagation", "private", *mount, "--", *self._drop(limits), *args]

    def _nproc(self) -> int:
        if self._as_root:
            return self.pids
        return len(_pids_of_uid(os.geteuid())) + self.pids

    # --- the shell transport -------------------------------------------------------------------
    def _spawn(self, start_dir: str, ready: str) -> None:
        env = self._driver_env(start_dir)
        info_r, info_w = os.pipe()
        try:
            argv = self._argv([], env, ["/bin/bash", "--noprofile", "--norc", "-c", DRIVER, "bash", ready], info_fd=info_w)
            self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          close_fds=True, pass_fds=(info_w,), start_new_session=True)
        except BaseException:
            os.close(info_r)
            raise
        finally:
            os.close(info_w)
        self._info_fd = info_r
        os.set_blocking(self._proc.stdout.fileno(), False)

    def _start_shell(self) -> None:
        try:
            super()._start_shell()
        except SandboxError as e:
            if "namespace" in str(e) or "uid map" in str(e) or "setting up uid" in str(e):
                raise SandboxError(f"{e}\nFix: this host forbids unprivileged user namespaces for uid {self.host_uid}; "
                                   "allow them (sysctl kernel.unprivileged_userns_clone=1, or on Ubuntu 24.04 "
                                   "kernel.apparmor_restrict_unprivileged_userns=0) or use --backend docker") from e
            raise

    def _on_ready(self) -> None:
        # The namespace's init from bwrap's info (no /proc scan: with many sandboxes opening
        # at once, full scans cost milliseconds of the interpreter each); the driver is init's
        # only child so far.
        outer = self._proc.pid
        self._init = self._read_info()
        init = [self._init] if self._init is not None else _children_of(outer)
        driver = [c for pid in init for c in _children_of(pid)]
        self._protected = {outer, *init, *driver}

    def _read_info(self) -> int | None:
        """The host pid of the jail's init from the --info-fd JSON (None if it did not come)."""
        fd, self._info_fd = self._info_fd, None
        if fd is None:
            return None
        data, deadline = b"", time.monotonic() + 2.0
        try:
            while b"}" not in data and select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(fd)
        try:
            return int(json.loads(data[: data.index(b"}") + 1])["child-pid"])
        except (ValueError, KeyError, TypeError):
            logger.warning("bwrap --info-fd gave %r; finding the jail's init in /proc instead", data[:200])
            return None

    def _write(self, data: bytes) -> None:
        if self._proc is None or self._proc.stdin is None:
            raise SandboxError("the shell is not running")
        self._proc.stdin.write(data)
        self._proc.stdin.flush()

    def _read(self, timeout: float) -> bytes | None:
        fd = self._proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
        if not ready:
            return b""
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return b""
        return data if data else None

    def _exit_status(self) -> int | None:
        try:
            return self._proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None

    def _kill_agent_processes(self) -> None:
        if self._proc is None:
            return
        for _ in range(200):  # a fork bomb respawns between scans; pids bounds it, rounds end it
            victims = _descendants(self._proc.pid) - self._protected
            if not victims:
                return
            _kill_all(victims)
            time.sleep(0.002)

    def _kill_jail(self) -> None:
        proc, self._proc = self._proc, None
        if self._info_fd is not None:  # the shell never became ready
            os.close(self._info_fd)
            self._info_fd = None
        if proc is not None:
            _end_jail(proc, self._init)
            self._init = None
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except (OSError, ValueError):
                    pass
        self._sweep()

    def _sweep(self) -> None:
        """Kill anything left running as this sandbox's uid (root mode only: the uid is ours)."""
        if not self._as_root:
            return
        # A killed process in uninterruptible sleep (a write to the disk, under load) dies only
        # when that returns: wait for it, up to a deadline, with a growing pause between rounds.
        started, pause = time.monotonic(), 0.002
        while True:
            pids = _pids_of_uid(self.host_uid)
            if not pids:
                return
            if time.monotonic() - started > SWEEP_SECONDS:
                raise SandboxError(f"processes of sandbox uid {self.host_uid} survived {SWEEP_SECONDS:.0f} s of kill "
                                   f"rounds: {sorted(pids)[:10]}")
            _kill_all(pids)
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    # --- one-shot jails: setup and verifier ------------------------------------------------------
    def _oneshot(self, binds: list[str], env: dict[str, str], command: list[str], timeout: float,
                 verifier: bool = False) -> tuple[str, int | None, bool]:
        proc = subprocess.Popen(self._argv(binds, env, command, verifier=verifier), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, close_fds=True, start_new_session=True)
        cap, deadline, timed_out = OutputCap(self.max_output_bytes), time.monotonic() + timeout, False
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
        eof = False
        while not eof:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            exited = proc.poll() is not None  # read what is buffered, then stop
            if select.select([fd], [], [], 0.0 if exited else min(left, 0.05))[0]:
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    eof = True
                cap.add(data)
            elif exited:
                break
        if proc.poll() is None and eof and not timed_out:
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        code = proc.returncode if proc.poll() is not None else _end_jail(proc)
        proc.stdout.close()
        self._sweep()
        text, _ = cap.text()
        return text, (None if timed_out else code), timed_out

    def _run_setup(self) -> None:
        script = self.task.setup_script
        # Bind a copy from our own 0755 staging dir: the sandbox's host uid may not be able to
        # traverse the task's own path (a task under a 0700 directory such as a pytest tmp_path).
        staged = self._dir / "setup.sh"
        shutil.copyfile(script, staged)
        os.chmod(staged, 0o644)
        out, code, timed_out = self._oneshot(["--ro-bind", str(staged), "/tmp/minirsi-setup.sh"], self._task_env(),
                                             ["/bin/bash", "/tmp/minirsi-setup.sh"], self.task.setup_timeout_sec)
        if timed_out or code != 0:
            raise SandboxError(f"task {self.task.task_id}: setup script {script} "
                               f"{'timed out' if timed_out else f'exited {code}'}: {out[-2000:]}")

    def run_verifier(self, tests_dir: Path, script: str, plugin: Path, env: dict[str, str], timeout: float) -> TestRun:
        if self._closed:
            raise SandboxError("run_verifier() after close(): verify the episode before closing its sandbox")
        if not self._agent_stopped:
            self.stop_agent()
        with self._lock:
            self._runs += 1
            logs = self._dir / f"logs-{self._runs}"
            logs.mkdir()
            if self._as_root:
                os.chown(logs, self.host_uid, self.host_uid)
            tests_bind = "--ro-bind"
            if self.prepared is not None:
                # as in Harbor, whose /tests is a writable copy: a test may build into it
                # (`setup.py build_ext --inplace`); tests_dir is verify()'s throwaway copy
                tests_bind = "--bind"
                if self._as_root:
                    for path in [tests_dir, *tests_dir.rglob("*")]:
                        os.chown(path, self.host_uid, self.host_uid, follow_symlinks=False)
            binds = [tests_bind, str(tests_dir), "/tests", "--bind", str(logs), "/logs/verifier",
                     "--ro-bind", str(plugin), "/opt/minirsi/minirsi_junit.py"]
            if self.prepared is not None:
                from minirsi.env.layers import TOOLS_DIR

                binds += self._shim_binds()
                # the verifier's own entries first, then the image's ENV PYTHONPATH (Docker keeps
                # it), then tools test.sh `pip install`ed into the image's Python
                pythonpath = [env.get("PYTHONPATH"), self.prepared.env.get("PYTHONPATH"),
                              TOOLS_DIR if self.prepared.system_tools else None]
                env = {**self._layer_env(), **env, "HOME": "/root", "USER": "root", "LOGNAME": "root",
                       "PATH": f"{SHIM_BIN}:{self.prepared.env.get('PATH', PATH)}",
                       "PYTHONPATH": ":".join(p for p in pythonpath if p is not None)}
            out, code, timed_out = self._oneshot(binds, env, ["/bin/bash", f"/tests/{script}"], timeout,
                                                 verifier=self.prepared is not None)
            files = {p.name: p.read_bytes() for p in logs.iterdir() if p.is_file() and not p.is_symlink()}
            return TestRun(output=out, exit_code=code, timed_out=timed_out, files=files)

    def _shim_binds(self) -> list[str]:
        """The verifier's offline stand-ins for apt-get, curl, uv and uvx (verifier_shims.py)."""
        bin_dir = self._dir / "shims"
        bin_dir.mkdir(exist_ok=True)
        for name in SHIMS:
            (bin_dir / name).write_text(f'#!/bin/sh\nexec /usr/bin/python3 -I /opt/minirsi/verifier_shims.py {name} "$@"\n')
            (bin_dir / name).chmod(0o755)
        return ["--ro-bind", str(bin_dir), SHIM_BIN, "--ro-bind", str(SHIM_SOURCE), "/opt/minirsi/verifier_shims.py"]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._alive = False
            try:
                self._kill_jail()
            finally:
                if self._cgroup is not None:
                    self._cgroup.remove()
                if self._dir is not None:
                    shutil.rmtree(self._dir, ignore_errors=True)
                if self._lease is not None:
                    self._lease.release()

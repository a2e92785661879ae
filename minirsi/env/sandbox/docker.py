"""The Docker sandbox backend (the ``docker`` Python SDK), for tasks that need their image built.

Image, in order: the task's ``[environment] docker_image`` when the engine has it (``docker
load`` it; Harbor's prebuilt images); else ``environment/Dockerfile`` built with no network
(tagged by a hash of environment/, so it is built once per content); else, without a
Dockerfile, the base image ``minirsi-base:bookworm`` (imported from the same rootfs as the
bwrap backend by scripts/dockerd.sh) with ``environment/`` files copied into the workdir. A
Dockerfile is in charge of its own files (as in Terminal-Bench 2). Builds are offline: a FROM
image the engine lacks is replaced by the base image when it is a Debian, Ubuntu or python
image (with a warning saying so, as the bwrap backend's layers do); a build that still needs a
registry or a package mirror fails with one line naming the way out (``docker load`` of the
task's image, or the local backend: ``minirsi task prepare``).

Container: ``network_mode="none"``, ``mem_limit`` (memory_mb), ``pids_limit`` (pids, a cgroup
limit on the whole container), RLIMIT_FSIZE, a fresh tmpfs /tmp, ``no-new-privileges``,
docker-init as pid 1 (reaps orphans) running ``sleep infinity`` as root. The agent's shell is
one ``docker exec`` of the same driver as bwrap (shell.py), as uid 1000, its stdin and stdout
on the exec's attached socket (frames demultiplexed here). Killing: ``pkill -9 -U 1000`` as root
in rounds (every agent process), minus the driver, which carries the ready token in its argv.
Verifier: agent processes killed, then ``tests/`` copied to /tests (root-owned, read-only to
the agent's uid), a fresh /logs/verifier and /tmp, and test.sh run as uid 1000.

Needs a Docker engine: ``bash scripts/dockerd.sh start && eval "$(bash scripts/dockerd.sh env)"``.
Call through ``minirsi.env.sandbox.open_sandbox(task, backend="docker", **limits)``.
"""

from __future__ import annotations

import hashlib
import io
import logging
import select
import shlex
import socket
import struct
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from minirsi.env.sandbox import SandboxError, TestRun
from minirsi.env.sandbox.shell import DRIVER, OutputCap, ShellSandbox

logger = logging.getLogger(__name__)

BASE_IMAGE = "minirsi-base:bookworm"
AGENT = "1000:1000"
_ENV_SKIP = {"Dockerfile", ".dockerignore", "docker-compose.yaml", "docker-compose.yml"}
_BUILD_LOCK = threading.Lock()
# Kill every uid-1000 process except those whose argv holds {keep} (the driver), in rounds
# (a fork bomb refills between scans; pids_limit bounds it). {keep} = '' kills them all.
_KILL_AGENT = """keep=" $([ -n {keep} ] && pgrep -U 1000 -f -- {keep} | tr '\\n' ' ') "
for i in $(seq 1 50); do
  pids=""
  for p in $(pgrep -U 1000); do case "$keep" in *" $p "*) ;; *) pids="$pids $p";; esac; done
  [ -z "$pids" ] && exit 0
  kill -9 $pids 2>/dev/null; sleep 0.02
done
exit 1"""


_NEEDS_NETWORK = ("pull access denied", "failed to resolve", "Temporary failure resolving", "Could not resolve",
                  "dial tcp", "Network is unreachable", "no such host", "manifest unknown", "Failed to fetch",
                  "Could not fetch URL", "Failed to establish a new connection")


def build_failure(task: Any, build_log: Any, message: str) -> str:
    """One line on why an offline build failed, and the way out (no whole build log)."""
    lines = [str(x.get("stream", x.get("error", ""))) for x in build_log or [] if isinstance(x, dict)]
    text = "".join(lines) + "\n" + message
    step = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip().startswith("Step ")), "")
    last = next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), message)
    image = task.environment.get("docker_image")
    if any(marker in text for marker in _NEEDS_NETWORK):
        return (f"building {task.dockerfile} needs a registry or package mirror, and Docker builds here are offline"
                f"{' (at ' + step + ')' if step else ''}. Fix: docker load the task's image"
                f"{' (' + image + ')' if image else ''}, or use the local backend: minirsi task prepare {task.path}")
    return f"building {task.dockerfile} failed{' at ' + step if step else ''}: {last[:300]}"


def client_from_env() -> Any:
    """A docker client for $DOCKER_HOST, or SandboxError saying how to start one."""
    try:
        import docker
    except ImportError as e:
        raise SandboxError("the docker SDK is not installed. Fix: pip install 'minirsi[docker]'") from e
    try:
        client = docker.from_env(timeout=120)
        client.ping()
        return client
    except Exception as e:  # the SDK raises DockerException, requests and socket errors alike
        raise SandboxError(f"no Docker engine answers ({e}). Fix: bash scripts/dockerd.sh start && "
                           'eval "$(bash scripts/dockerd.sh env)"') from e


def _tar(files: dict[str, bytes | Path], mode: int | None = None) -> bytes:
    """An in-memory tar of {archive name: bytes or host file}, owned by root."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, src in sorted(files.items()):
            data = src.read_bytes() if isinstance(src, Path) else src
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = mode if mode is not None else (src.stat().st_mode & 0o777 if isinstance(src, Path) else 0o644)
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _tree(root: Path, skip: set[str]) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*"))
            if p.is_file() and p.relative_to(root).parts[0] not in skip}


class _Demux:
    """Docker's multiplexed attach stream: 8-byte headers (stream, 0, 0, 0, size:uint32 BE)."""

    def __init__(self, sock: socket.socket):
        self.sock, self.raw, self.eof = sock, bytearray(), False

    def read(self, timeout: float) -> bytes | None:
        deadline = time.monotonic() + timeout
        while True:
            out = bytearray()
            while len(self.raw) >= 8:
                size = struct.unpack(">I", self.raw[4:8])[0]
                if len(self.raw) < 8 + size:
                    break
                out += self.raw[8:8 + size]
                del self.raw[:8 + size]
            if out:
                return bytes(out)
            if self.eof:
                return None
            left = deadline - time.monotonic()
            if not select.select([self.sock], [], [], max(0.0, left))[0]:
                return b""
            data = self.sock.recv(1 << 16)
            if not data:
                self.eof = True
            self.raw += data


class DockerSandbox(ShellSandbox):
    def __init__(self, task: Any, memory_mb: int | None = None, pids: int = 256, max_output_bytes: int = 16384,
                 file_size_mb: int = 1024, tmp_size_mb: int = 256, image: str | None = None, client: Any = None):
        super().__init__(task, max_output_bytes)
        self.client = client or client_from_env()
        self.container = None
        self._exec_id: str | None = None
        self._sock: socket.socket | None = None
        self._demux: _Demux | None = None
        self._ready = ""
        self._runs = 0
        try:
            self.image = image or self._image()
            import docker

            self.container = self.client.containers.run(
                self.image, ["sleep", "infinity"], detach=True, init=True, network_mode="none",
                mem_limit=f"{memory_mb or task.memory_mb or 2048}m", pids_limit=pids, hostname="sandbox",
                tmpfs={"/tmp": f"size={tmp_size_mb}m,mode=1777"}, security_opt=["no-new-privileges"],
                ulimits=[docker.types.Ulimit(name="fsize", soft=file_size_mb << 20, hard=file_size_mb << 20),
                         docker.types.Ulimit(name="core", soft=0, hard=0)],
                labels={"minirsi": "sandbox", "minirsi.task": task.task_id})
            self._prepare()
            self._start_shell()
        except BaseException:
            self.close()
            raise

    # --- image and container ----------------------------------------------------------------------
    def _image(self) -> str:
        task = self.task
        import docker

        wanted = task.environment.get("docker_image")
        if isinstance(wanted, str) and wanted:
            try:
                self.client.images.get(wanted)
                return wanted
            except docker.errors.ImageNotFound:
                logger.info("%s: docker_image %s is not in the engine; building environment/Dockerfile", task.task_id, wanted)
        if task.dockerfile is None:
            return BASE_IMAGE
        digest = hashlib.sha256()
        for name, path in _tree(task.environment_dir, set()).items():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
        tag = f"minirsi-task-{task.task_id.lower()[:60]}:{digest.hexdigest()[:16]}"
        with _BUILD_LOCK:  # one build per tag, even from many threads
            try:
                self.client.images.get(tag)
                return tag
            except docker.errors.ImageNotFound:
                pass
            timeout = float(task.environment.get("build_timeout_sec", 600))
            logger.info("building %s from %s", tag, task.dockerfile)
            context = self._offline_context()
            try:
                self.client.images.build(tag=tag, network_mode="none", rm=True, timeout=int(timeout),
                                         **({"fileobj": io.BytesIO(context), "custom_context": True} if context
                                            else {"path": str(task.environment_dir)}))
            except docker.errors.BuildError as e:
                raise SandboxError(build_failure(task, e.build_log, str(e))) from e
        return tag

    def _offline_context(self) -> bytes | None:
        """environment/ as a tar with each FROM the engine lacks replaced by the base image
        (None when every FROM is present). A FROM with no local equivalent is left alone: the
        build then fails with build_failure's one line."""
        import docker

        from minirsi.env.dockerfile import DockerfileError, map_base

        text = self.task.dockerfile.read_text()
        lines = text.splitlines(keepends=True)
        changed = False
        for i, line in enumerate(lines):
            words = line.split()
            if len(words) < 2 or words[0].upper() != "FROM":
                continue
            image = next((w for w in words[1:] if not w.startswith("--")), "")
            try:
                self.client.images.get(image)
                continue
            except docker.errors.ImageNotFound:
                pass
            except docker.errors.APIError:
                continue
            try:
                notes, _, release = map_base(image, i + 1, self.task.dockerfile, line)
                if release != "bookworm":  # the Docker backend's one base image is the Debian 12 rootfs
                    notes = [*notes, f"{image}: Debian 13 in the image, Debian 12 bookworm in {BASE_IMAGE}"]
            except DockerfileError:
                continue
            logger.warning("%s:%d: FROM %s is not in the Docker engine and builds are offline: building on %s instead%s",
                           self.task.dockerfile, i + 1, image, BASE_IMAGE, f" ({'; '.join(notes)})" if notes else "")
            lines[i] = line.replace(image, BASE_IMAGE, 1)
            changed = True
        if not changed:
            return None
        files: dict[str, bytes | Path] = dict(_tree(self.task.environment_dir, set()))
        files["Dockerfile"] = "".join(lines).encode()
        return _tar(files)

    def _root(self, script: str) -> tuple[int, str]:
        code, out = self.container.exec_run(["bash", "-c", script], user="root")
        return code, out.decode(errors="replace")

    def _prepare(self) -> None:
        task, wd = self.task, shlex.quote(self.task.workdir)
        code, out = self._root(
            f"set -e; mkdir -p {wd}; grep -q '^agent:' /etc/passwd || echo 'agent:x:1000:1000:agent:/tmp:/bin/bash' >> /etc/passwd;"
            " grep -q '^agent:' /etc/group || echo 'agent:x:1000:' >> /etc/group")
        if code != 0:
            raise SandboxError(f"preparing the container failed: {out[-1000:]}")
        if task.dockerfile is None and task.environment_dir.is_dir():
            setup = task.setup_script
            skip = set(_ENV_SKIP) | ({setup.name} if setup is not None else set())
            files = _tree(task.environment_dir, skip)
            if files:
                self.container.put_archive(task.workdir, _tar(files))
        self._root(f"chown -R 1000:1000 {wd}")
        if task.setup_script is not None:
            # Not /tmp: put_archive writes beneath the container's tmpfs mount, where bash cannot see it.
            self._root("mkdir -p /opt/minirsi")
            self.container.put_archive("/opt/minirsi", _tar({"setup.sh": task.setup_script}, 0o755))
            out, code, timed_out = self._exec_once(["bash", "/opt/minirsi/setup.sh"], self._task_env(),
                                                   task.setup_timeout_sec)
            self._root("rm -rf /opt/minirsi")
            if timed_out or code != 0:
                raise SandboxError(f"task {task.task_id}: setup script {'timed out' if timed_out else f'exited {code}'}: {out[-2000:]}")

    def _attach(self, command: list[str], env: dict[str, str], stdin: bool) -> tuple[str, socket.socket]:
        api = self.client.api
        exec_id = api.exec_create(self.container.id, command, stdin=stdin, stdout=True, stderr=True, tty=False,
                                  user=AGENT, workdir=self.task.workdir,
                                  environment={"HOME": "/tmp", "USER": "agent", "LANG": "C.UTF-8", "TERM": "dumb", **env})["Id"]
        sock = api.exec_start(exec_id, socket=True)
        raw = getattr(sock, "_sock", sock)
        raw.setblocking(True)
        return exec_id, raw

    def _exec_once(self, command: list[str], env: dict[str, str], timeout: float) -> tuple[str, int | None, bool]:
        exec_id, sock = self._attach(command, env, stdin=False)
        demux, cap, deadline, timed_out = _Demux(sock), OutputCap(self.max_output_bytes), time.monotonic() + timeout, False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            data = demux.read(left)
            if data is None:
                break
            cap.add(data)
        sock.close()
        if timed_out:
            self._root(_KILL_AGENT.format(keep="''"))
        code = self.client.api.exec_inspect(exec_id).get("ExitCode")
        return cap.text()[0], None if timed_out else code, timed_out

    # --- the shell transport ------------------------------------------------------------------------
    def _spawn(self, start_dir: str, ready: str) -> None:
        self._ready = ready
        env = self._driver_env(start_dir)
        self._exec_id, self._sock = self._attach(["bash", "--noprofile", "--norc", "-c", DRIVER, "bash", ready], env, stdin=True)
        self._demux = _Demux(self._sock)

    def _write(self, data: bytes) -> None:
        if self._sock is None:
            raise SandboxError("the shell is not running")
        self._sock.sendall(data)

    def _read(self, timeout: float) -> bytes | None:
        return self._demux.read(timeout)

    def _exit_status(self) -> int | None:
        for _ in range(20):
            info = self.client.api.exec_inspect(self._exec_id)
            if not info.get("Running"):
                return info.get("ExitCode")
            time.sleep(0.05)
        return None

    def _kill_agent_processes(self) -> None:
        # The driver is the uid-1000 process whose argv holds its ready token; every other goes.
        self._root(_KILL_AGENT.format(keep=shlex.quote(self._ready)))

    def _kill_jail(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
        if self.container is not None:
            code, out = self._root(_KILL_AGENT.format(keep="''"))
            if code != 0:
                # A fork bomb that exhausted the pids limit leaves no room for the exec that
                # would kill it. Restarting the container SIGKILLs every process in it and keeps
                # its filesystem (the work directory the verifier must see).
                logger.warning("sandbox %s: in-container kill failed (%s); restarting the container",
                               self.task.task_id, out.strip()[-200:])
                self.container.restart(timeout=0)
                code, out = self._root(_KILL_AGENT.format(keep="''"))
                if code != 0:
                    raise SandboxError(f"agent processes survived 50 kill rounds and a restart: {out[-500:]}")

    # --- verifier ----------------------------------------------------------------------------------
    def run_verifier(self, tests_dir: Path, script: str, plugin: Path, env: dict[str, str], timeout: float) -> TestRun:
        if self._closed:
            raise SandboxError("run_verifier() after close(): verify the episode before closing its sandbox")
        if not self._agent_stopped:
            self.stop_agent()
        with self._lock:
            self._runs += 1
            self._root("rm -rf /tests /logs/verifier /opt/minirsi && mkdir -p /tests /logs/verifier /opt/minirsi"
                       " && chown 1000:1000 /logs/verifier && find /tmp -mindepth 1 -delete")
            self.container.put_archive("/tests", _tar(_tree(tests_dir, set())))
            self.container.put_archive("/opt/minirsi", _tar({"minirsi_junit.py": plugin}, 0o644))
            self._root("chown -R root:root /tests && chmod -R a+rX,go-w /tests")
            out, code, timed_out = self._exec_once(["bash", f"/tests/{script}"], env, timeout)
            self._root(_KILL_AGENT.format(keep="''"))
            files: dict[str, bytes] = {}
            stream, _ = self.container.get_archive("/logs/verifier/.")
            with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                for member in tar.getmembers():
                    if member.isfile() and "/" not in member.name.removeprefix("./").strip("/"):
                        files[Path(member.name).name] = tar.extractfile(member).read()
            return TestRun(output=out, exit_code=code, timed_out=timed_out, files=files)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._alive = False
            if self._sock is not None:
                try:
                    self._sock.close()
                except OSError:
                    pass
            if self.container is not None:
                try:
                    self.container.remove(force=True)
                except Exception as e:  # the engine may already be gone; nothing else to free
                    logger.warning("removing container %s failed: %s", self.container.id[:12], e)

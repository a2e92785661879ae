"""Environment layers: the ``docker build`` of the local backend (overlay layers over one rootfs).

A task with ``environment/Dockerfile`` runs on a *layer*: a directory holding only what its
Dockerfile changed (the overlayfs "upper" of the build), stacked read-only over the shared
base rootfs when a sandbox opens::

    agent jail      /  =  overlay(lowerdir = env.upper : base, upperdir = the episode's)
    verifier jail   /  =  overlay(lowerdir = apt.upper : env.upper : base, the same upperdir)
                    /opt/minirsi-tools  =  pip.upper/opt/minirsi-tools (bind)    read-only

The base (``Prepared.base``) is the rootfs of the FROM image's release (``Dockerfile.release``,
minirsi/env/dockerfile.py ``map_base``): $MINIRSI_ROOTFS (Debian 12 bookworm, scripts/setup.sh) for
most images; for the debian images that are Debian 13 today (trixie, 13*, stable*, latest) a
Debian 13 trixie rootfs, <rootfs>-trixie or $MINIRSI_ROOTFS_TRIXIE, which ``prepare`` builds
the first time a task needs it (``ensure_base``: debootstrap, ~2 min and ~420 MB, the packages
of the bookworm one; built in <dir>.partial and renamed when complete, under an flock).
Every key below includes the identity of the task's base, so layers never mix bases.

The layers themselves are never written while tasks run: an episode's changes go to its own
upper directory (minirsi/env/sandbox/overlay_root.py).

- ``env`` layer, key = sha256(format, the task's base rootfs, every file of environment/): the Dockerfile
  replayed (minirsi/env/dockerfile.py) by ``prepare``: each RUN runs as root with the machine's
  network in a bubblewrap jail whose root is a writable overlay (upper = the layer), the way
  ``docker build`` runs it. Tasks with the same environment/ share one layer.
- the test tools, read from tests/test.sh, installed at preparation so that the standard
  Terminal-Bench 2 test.sh runs offline (its ``apt-get``, ``curl``, ``uv`` and ``uvx`` are
  stand-ins in the verifier jail: minirsi/env/sandbox/verifier_shims.py). Only the verifier's jail
  has them; the agent never sees them.
  ``pip`` layer, key = sha256(format, the task's base rootfs, the pip specs of ``uvx -w`` /
  ``uv pip install``): ``pip install --target /opt/minirsi-tools`` for the base's Python. It does not
  depend on the environment, so every task with the standard test.sh shares one (pytest and
  pytest-json-ctrf: 15 MB). When test.sh installs them with ``pip install`` (into the image's
  Python, in Docker) they are also on the verifier's PYTHONPATH (``Prepared.system_tools``).
  ``apt`` layer (only when test.sh installs packages other than curl), key = sha256(env key,
  the packages), stacked on the env layer; installed with their Recommends, as Docker would.
- ``index`` layer (only when the task names packages in ``pip install`` lines or ``[environment]
  pip_packages``), key = sha256(env key, the specs): the task's package index, wheels for the
  env layer's Python, bound read-only at /opt/minirsi-index for the agent and the verifier
  (minirsi/env/wheelhouse.py).

A layer is built in ``<cache>/<key>.partial-<pid>`` and renamed to ``<cache>/<key>`` when
complete (``meta.json`` inside), under an flock, so a killed preparation leaves nothing that
counts and two preparations of one environment build it once. Disk: a layer holds only its
changes (e.g. two apt packages: a few MB); apt lists and caches are removed at the end.
Preparation needs root (dpkg chowns files to system users; overlayfs upper dirs need it).

A task's layers are found or built together by minirsi/env/prepare.py (``prepare``,
``find_prepared``); this module builds one layer and computes the keys.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from minirsi.env.dockerfile import RELEASES, Dockerfile, DockerfileError, Step, parse_dockerfile

logger = logging.getLogger(__name__)

LAYER_FORMAT = 1
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TOOLS_DIR = "/opt/minirsi-tools"
"""Where the tools layer installs the verifier's pip packages (pip --target)."""
_CONTEXT = "/tmp/.minirsi-context"  # environment/ inside the preparation jail (read-only)
_PIP = "/tmp/.minirsi-pip"  # the host's pip package inside the preparation jail (read-only)
# The sandbox binds files under /opt/minirsi, which a layer's read-only /opt cannot grow at
# mount time: the layer carries the (empty) mount points.
_MOUNT_POINTS = (f"mkdir -p /opt/minirsi/bin {TOOLS_DIR} && "
                 "touch /opt/minirsi/minirsi_junit.py /opt/minirsi/verifier_shims.py")
# RUN is root, as in `docker build`, with Docker's default capabilities minus MKNOD and NET_RAW:
# enough for dpkg and apt's _apt sandbox, not for mount, modules or raw devices (host root's
# CAP_SYS_ADMIN would let a Dockerfile mount the host's disk).
DOCKER_CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID", "CAP_SETUID",
               "CAP_SETPCAP", "CAP_SETFCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_AUDIT_WRITE")
_CA = "/tmp/.minirsi-ca.crt"  # the host's CA bundle inside the preparation jail
_PROXY_VARS = ("http_proxy", "https_proxy", "no_proxy", "all_proxy")
_CLEANUP = ("rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /var/cache/apt/*.bin /root/.cache/pip "
            "2>/dev/null; true")
_PREFIXES = ("sudo", "env", "exec", "command", "time", "nice")
_SHIMMED_APT = {"curl"}  # test.sh installs these; the verifier jail has a stand-in instead
# The packages of every base rootfs (scripts/setup.sh's bookworm one has the same list; a test checks).
ROOTFS_PACKAGES = "python3,python3-pytest,git,procps,tar,gzip,bzip2,xz-utils,zip,unzip,bc,gawk,findutils,diffutils,patch"
MIRROR = "http://deb.debian.org/debian"
BASE_TIMEOUT = 1800.0  # seconds debootstrap may take for a base rootfs
# What a python:* image has and Debian's python3 lacks: pip, a `python` command, the headers C
# extensions build against (a test may `setup.py build_ext`), venv; no EXTERNALLY-MANAGED marker.
_PYTHON_IMAGE = ("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "
                 "python3-dev python3-venv >/dev/null && python3 -m pip install -q --no-cache-dir --ignore-installed pip "
                 "&& ln -sf /usr/bin/python3 /usr/local/bin/python && rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED "
                 "/usr/lib/python3.11/config-3.11-*/libpython3.11*.a")  # static archives: 25 MB no extension needs


class LayerError(RuntimeError):
    """Preparation failed: names the Dockerfile line (or test.sh), the package and the status."""


def cache_dir() -> Path:
    return Path(os.environ.get("MINIRSI_LAYERS", Path.home() / ".cache/minirsi/layers"))


@dataclass(frozen=True)
class Layer:
    key: str
    path: Path

    @property
    def upper(self) -> Path:
        return self.path / "upper"

    @property
    def meta(self) -> dict:
        return json.loads((self.path / "meta.json").read_text())


@dataclass(frozen=True)
class ToolSpec:
    """What tests/test.sh installs at verification time (read from its text)."""

    apt: tuple[str, ...] = ()
    pip: tuple[str, ...] = ()
    system: bool = False
    """test.sh installs pip packages into the environment's Python (``pip install``, ``uv pip
    install``), not only into uvx's throwaway one: every ``python`` it runs afterwards sees them."""

    def __bool__(self) -> bool:
        return bool(self.apt or self.pip)


@dataclass(frozen=True)
class Prepared:
    """The layers of one task, the base rootfs they sit on and what its Dockerfile set."""

    env_layer: Layer
    base: Path
    """The base rootfs below the layers (the bottom lower dir): the Debian 12 rootfs, or the
    Debian 13 one for a debian image that is Debian 13 (base_rootfs)."""
    apt_layer: Layer | None = None
    """test.sh's apt packages, for the verifier only."""
    pip_layer: Layer | None = None
    """test.sh's pip packages in <upper>/opt/minirsi-tools, for the verifier only."""
    env: dict[str, str] = field(default_factory=dict)
    """The Dockerfile's ENV: set for the agent and the verifier."""
    notes: tuple[str, ...] = ()
    system_tools: bool = False
    """The tools are on the verifier's PYTHONPATH (ToolSpec.system): `python -m pytest` after
    `pip install pytest ...` runs the prepared pytest, as the image's Python would in Docker."""
    index_layer: Layer | None = None
    """The task's package index (minirsi/env/wheelhouse.py), for the agent and the verifier; None
    when the task names no package."""

    def lowers(self, verifier: bool = False) -> list[Path]:
        """The layers' upper dirs, top first (``base`` goes below them)."""
        top = [self.apt_layer.upper] if verifier and self.apt_layer is not None else []
        return top + [self.env_layer.upper]

    @property
    def tools_dir(self) -> Path | None:
        """The host directory the verifier sees at /opt/minirsi-tools."""
        return self.pip_layer.upper / TOOLS_DIR.lstrip("/") if self.pip_layer is not None else None


# --- base rootfs -----------------------------------------------------------------------------------
def base_rootfs(release: str, rootfs: Path) -> Path:
    """The base rootfs of a release (Dockerfile.release): ``rootfs`` itself for bookworm (the
    Debian 12 one, $MINIRSI_ROOTFS); for trixie $MINIRSI_ROOTFS_TRIXIE, else the sibling
    ``<rootfs>-trixie`` (~/.cache/minirsi/rootfs-trixie)."""
    if release == "bookworm":
        return rootfs
    override = os.environ.get(f"MINIRSI_ROOTFS_{release.upper()}")
    return Path(override) if override else rootfs.parent / f"{rootfs.name}-{release}"


def _base_ready(path: Path) -> bool:
    """A base rootfs is complete once renamed from .partial; its dpkg status is its identity."""
    return (path / "var/lib/dpkg/status").is_file() and os.path.lexists(path / "usr/bin/bash")


def _debootstrap_argv(release: str, target: Path) -> list[str]:
    return ["debootstrap", "--variant=minbase", f"--include={ROOTFS_PACKAGES}", release, str(target), MIRROR]


def ensure_base(release: str, rootfs: Path, log: Callable[[str], None] = lambda s: None) -> tuple[Path, bool]:
    """The base rootfs of ``release``, built first if missing (network; root): (path, built).

    bookworm's is scripts/setup.sh's and is never built here. Another release's is debootstrapped
    into ``<path>.partial`` and renamed to ``<path>`` when complete, under an flock on
    ``<path>.lock``: a killed build leaves nothing that counts, two preparations build it once."""
    path = base_rootfs(release, rootfs)
    if release == "bookworm" or _base_ready(path):
        return path, False
    by_hand = (f"{shlex.join(_debootstrap_argv(release, Path(f'{path}.partial')))} && "
               f"mv {shlex.quote(f'{path}.partial')} {shlex.quote(str(path))}")
    what = f"the {RELEASES.get(release, release)} base rootfs {path}"
    if shutil.which("debootstrap") is None:
        raise LayerError(f"{what} is missing and debootstrap is not installed. Fix: apt-get install debootstrap "
                         f"(scripts/setup.sh does it) and prepare again, or build it yourself: {by_hand}")
    if os.geteuid() != 0:
        raise LayerError(f"{what} is missing and building it (debootstrap) needs root. Fix: run `minirsi task "
                         f"prepare` as root (sudo), or build it yourself as root: {by_hand}")
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(f"{path}.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        if _base_ready(path):  # another process built it while we waited
            return path, False
        partial = Path(f"{path}.partial")
        subprocess.run(["rm", "-rf", "--one-file-system", str(partial)], check=False)
        log(f"building {what} (debootstrap {release}, ~2 min, ~420 MB)")
        started = time.monotonic()
        try:
            r = subprocess.run(_debootstrap_argv(release, partial), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, timeout=BASE_TIMEOUT)
            out = r.stdout.decode(errors="replace")
            if r.returncode != 0 or not _base_ready(partial):
                raise LayerError(f"building {what}: `{shlex.join(_debootstrap_argv(release, partial))}` exited with "
                                 f"status {r.returncode}; last lines:\n" + "\n".join(out.splitlines()[-15:]))
        except subprocess.TimeoutExpired as e:
            raise LayerError(f"building {what}: debootstrap timed out after {BASE_TIMEOUT:.0f} s") from e
        except BaseException:
            subprocess.run(["rm", "-rf", "--one-file-system", str(partial)], check=False)
            raise
        os.rename(partial, path)
        log(f"  {what}: {_du(path) / 2**20:.0f} MiB, built in {time.monotonic() - started:.1f} s")
        return path, True
    finally:
        os.close(lock_fd)


# --- keys ------------------------------------------------------------------------------------------
def _rootfs_id(rootfs: Path) -> str:
    """Identity of the base rootfs: its dpkg status (changes whenever its packages do)."""
    status = rootfs / "var/lib/dpkg/status"
    st = status.stat()
    return f"{rootfs}:{st.st_size}:{st.st_mtime_ns}"


_KEYS: dict[tuple, str] = {}
"""environment_key's memo, by a stat signature of environment/: every sandbox of a task looks
its layer up, and hashing a large environment/ each time would cost the open."""


def environment_key(task, rootfs: Path) -> str:
    root = task.environment_dir
    signature = (str(root), _rootfs_id(rootfs), tuple(
        (str(p), st.st_size, st.st_mtime_ns, st.st_mode) for p in sorted(root.rglob("*"))
        for st in [p.lstat()]))
    if signature not in _KEYS:
        _KEYS[signature] = _hash_environment(root, rootfs)
    return _KEYS[signature]


def _hash_environment(root: Path, rootfs: Path) -> str:
    h = hashlib.sha256(f"minirsi-layer-{LAYER_FORMAT}\0{_rootfs_id(rootfs)}\0".encode())
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            h.update(f"L{rel}\0{os.readlink(p)}\0".encode())
        elif p.is_file():
            h.update(f"F{rel}\0{p.stat().st_mode & 0o777:o}\0".encode())
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        elif p.is_dir():
            h.update(f"D{rel}\0".encode())
    try:  # a python image's layer holds _PYTHON_IMAGE too
        if parse_dockerfile(root / "Dockerfile").python_image:
            h.update(_PYTHON_IMAGE.encode())
    except (DockerfileError, OSError):
        pass  # reported when the Dockerfile is read for preparation
    return h.hexdigest()[:24]


def apt_key(env_key: str, packages: tuple[str, ...]) -> str:
    # "recommends": layers built before test.sh's packages came with their Recommends are not reused
    return hashlib.sha256(json.dumps([LAYER_FORMAT, "apt", env_key, packages, "recommends"]).encode()).hexdigest()[:24]


def pip_key(rootfs: Path, specs: tuple[str, ...]) -> str:
    return hashlib.sha256(json.dumps([LAYER_FORMAT, "pip", _rootfs_id(rootfs), specs]).encode()).hexdigest()[:24]


def _join_continuations(text: str) -> list[str]:
    return re.sub(r"\\\n", " ", text).splitlines()


def _segments(line: str) -> list[list[str]]:
    """A shell line split at ; && || | into token lists (quotes honoured; comments dropped)."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:
        return []
    out, cur = [], []
    for t in tokens:
        if t and set(t) <= set(";&|<>"):
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    return out + [cur]


def _requirements(tests_dir: Path, name: str) -> list[str]:
    """The specs of a requirements file test.sh names (at /tests/... inside the jail)."""
    path = tests_dir / Path(name).name if name.startswith("/tests/") or "/" not in name else Path("/nonexistent")
    if not path.is_file():
        raise LayerError(f"{tests_dir / 'test.sh'}: --with-requirements {name}: only files in tests/ can be read at "
                         "preparation. Fix: put the file in tests/ and name it /tests/<file>")
    return [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines()
            if ln.split("#", 1)[0].strip() and not ln.lstrip().startswith("-")]


def _uvx_specs(args: list[str], tests_dir: Path) -> list[str]:
    """The pip specs of ``uvx ARGS`` (the same options verifier_shims.tool_run reads)."""
    specs, i = [], 0
    while i < len(args):
        a = args[i]
        if a == "--with-requirements" and i + 1 < len(args):
            specs += _requirements(tests_dir, args[i + 1])
            i += 2
        elif a in ("-w", "--with", "--from") and i + 1 < len(args):
            specs += [s for s in args[i + 1].split(",") if s]
            i += 2
        elif a.startswith(("--with=", "--from=")):
            specs += [s for s in a.split("=", 1)[1].split(",") if s]
            i += 1
        elif a in ("-p", "--python"):
            i += 2
        elif a.startswith("-"):
            i += 1
        else:  # the command: uvx installs it too
            if a in ("pytest", "py.test"):
                specs.append("pytest")
            break
    return specs


def read_tool_spec(test_sh: Path) -> ToolSpec:
    """Apt packages and pip specs that test.sh installs (``apt-get install``, ``uvx -w``,
    ``uv run --with``, ``uv pip install``, ``pip install``); pytest when it runs it via uvx."""
    apt: list[str] = []
    pip: list[str] = []
    system = False
    for line in _join_continuations(test_sh.read_text(errors="replace")):
        for seg in _segments(line):
            while seg and (re.match(r"[A-Za-z_][A-Za-z0-9_]*=", seg[0]) or seg[0] in _PREFIXES):
                seg = seg[1:]  # X=1 cmd, sudo cmd, env cmd, ...: the command is what follows
            if not seg:
                continue
            cmd, rest = os.path.basename(seg[0]), seg[1:]
            if cmd in ("apt-get", "apt") and "install" in rest:
                apt += [t for t in rest[rest.index("install") + 1:] if not t.startswith("-") and t not in _SHIMMED_APT]
            elif cmd == "uvx":
                pip += _uvx_specs(rest, test_sh.parent)
            elif cmd == "uv" and (rest[:1] == ["run"] or rest[:2] == ["tool", "run"]):
                pip += _uvx_specs(rest[1:] if rest[:1] == ["run"] else rest[2:], test_sh.parent)
            elif (cmd == "uv" and rest[:2] == ["pip", "install"]) or (cmd in ("pip", "pip3") and rest[:1] == ["install"]):
                pip += [t for t in rest[2 if cmd == "uv" else 1:] if not t.startswith("-")]
                system = True
    named = {re.split(r"[=<>!~\[ ;]", s, maxsplit=1)[0].lower() for s in pip if s != "pytest"}
    if "pytest" in named:  # a bare "pytest" (uvx's command) next to a pinned one would conflict
        pip = [s for s in pip if s != "pytest"]
    return ToolSpec(tuple(sorted(set(apt))), tuple(sorted(set(pip))), system and bool(pip))


# --- lookup ----------------------------------------------------------------------------------------
def _layer(key: str) -> Layer | None:
    path = cache_dir() / key
    return Layer(key, path) if (path / "meta.json").is_file() else None


def _dockerfile(task) -> Dockerfile:
    return parse_dockerfile(task.dockerfile)


# --- building --------------------------------------------------------------------------------------
def _host_pip() -> Path:
    """The host's pip package: pure Python, run by the layer's python3 at preparation (the
    Debian rootfs has no pip of its own)."""
    try:
        import pip
    except ImportError as e:
        raise LayerError("preparing a layer runs the host's pip inside it, and this Python has none. "
                         "Fix: python3 -m ensurepip (or apt-get install python3-pip)") from e
    return Path(pip.__file__).parent


def _stage_pip_bin(stage: Path) -> Path:
    """pip / pip3 commands for the preparation jail (after the layer's own on PATH)."""
    bin_dir = stage / "pipbin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ("pip", "pip3"):
        (bin_dir / name).write_text(f'#!/bin/sh\nPYTHONPATH={_PIP}${{PYTHONPATH:+:$PYTHONPATH}} exec python3 -m pip "$@"\n')
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _host_ca_bundle() -> Path | None:
    for candidate in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"), os.environ.get("REQUESTS_CA_BUNDLE"),
                      "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate).resolve()
    return None


def _jail_argv(lowers: list[Path], upper: Path, work: Path, merged: Path, context: Path | None, pipbin: Path,
               env: dict[str, str], script: str, extra_binds: list[str] = ()) -> list[str]:
    """Root in a private mount namespace: a writable overlay at `merged`, then bwrap into it
    (`extra_binds`: more bwrap bind options, e.g. the package index's download directory)."""
    binds = ["--ro-bind", str(_host_pip()), f"{_PIP}/pip", "--ro-bind", str(pipbin), f"{_PIP}/bin", *extra_binds]
    if context is not None and context.is_dir():
        binds += ["--ro-bind", str(context), _CONTEXT]
    if Path("/etc/resolv.conf").exists():
        binds += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
    full_env = {"PATH": PATH, "HOME": "/root", "DEBIAN_FRONTEND": "noninteractive", "LANG": "C.UTF-8",
                "PIP_BREAK_SYSTEM_PACKAGES": "1", "PIP_ROOT_USER_ACTION": "ignore", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    # The machine's network settings, as `docker build` gets them: its proxy and its CA bundle
    # (a TLS-intercepting proxy's CA is in the host's bundle, not in the Debian rootfs).
    full_env.update({k: v for k, v in os.environ.items() if k.lower() in _PROXY_VARS})
    bundle = _host_ca_bundle()
    if bundle is not None:
        binds += ["--ro-bind", str(bundle), _CA]
        full_env.update({k: _CA for k in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")})
    full_env.update(env)
    full_env["PATH"] = full_env["PATH"] + f":{_PIP}/bin"
    setenv = [a for k, v in full_env.items() for a in ("--setenv", k, v)]
    mount = 'mount -t overlay overlay -o "lowerdir=$1,upperdir=$2,workdir=$3" "$4" && shift 4 && exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh",
            ":".join(str(p) for p in lowers), str(upper), str(work), str(merged),
            "bwrap", "--bind", str(merged), "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", *binds,
            "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", *[a for c in DOCKER_CAPS for a in ("--cap-add", c)], "--clearenv",
            *setenv, "--chdir", "/", "/bin/sh", "-c", "chmod 1777 /tmp\n" + script]


def _why(output: str) -> str:
    """The package a failed apt/pip command names, if any."""
    for pattern in (r"Unable to locate package (\S+)", r"Package '?([^' ]+)'? has no installation candidate",
                    r"No matching distribution found for (\S+)", r"satisfies the requirement (\S+)",
                    r"Could not find a version .*? (\S+)$"):
        m = re.search(pattern, output, re.M)
        if m:
            return f"package {m.group(1)!r} not found; "
    return ""


def _copy_script(step: Step, context: Path, where: str) -> str:
    """Shell lines that COPY/ADD a step's sources from the bound context to its destination."""
    dest, chown, *sources = step.args
    lines, targets = [], []
    many = len(sources) > 1 or dest.endswith("/")
    for src in sources:
        if re.match(r"https?://", src):
            if step.kind != "add":
                raise DockerfileError(where, step.lineno, step.text, "COPY cannot fetch a URL", "use ADD or RUN curl")
            target = dest.rstrip("/") + "/" + src.rstrip("/").rsplit("/", 1)[-1] if many else dest
            lines.append(f"mkdir -p {shlex.quote(os.path.dirname(target))} && python3 -c 'import sys, urllib.request; "
                         f"urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' {shlex.quote(src)} {shlex.quote(target)}")
            targets.append(target)
            continue
        rel = os.path.normpath(src.lstrip("/"))
        if rel.startswith(".."):
            raise DockerfileError(where, step.lineno, step.text, f"source {src!r} lies outside environment/",
                                  "keep every COPY source inside environment/")
        matches = sorted(context.glob(rel)) if rel != "." else [context]
        if not matches:
            raise DockerfileError(where, step.lineno, step.text, f"source {src!r} is not in {context}",
                                  "add the file to environment/ or fix the path")
        for m in matches:
            inside = shlex.quote(_CONTEXT if m == context else f"{_CONTEXT}/{m.relative_to(context).as_posix()}")
            d = shlex.quote(dest.rstrip("/") or "/")
            if m.is_dir():
                lines.append(f"mkdir -p {d} && cp -a {inside}/. {d}/")
                targets.append(dest)
            elif step.kind == "add" and tarfile.is_tarfile(m):
                lines.append(f"mkdir -p {d} && tar -xf {inside} -C {d}")
                targets.append(dest)
            elif many:
                lines.append(f"mkdir -p {d} && cp -a {inside} {d}/")
                targets.append(f"{dest.rstrip('/')}/{m.name}")
            else:
                lines.append(f"if [ -d {d} ]; then cp -a {inside} {d}/; else mkdir -p \"$(dirname {d})\" && cp -a {inside} {d}; fi")
                targets.append(dest)
    if chown:
        lines += [f"chown -R {shlex.quote(chown)} {shlex.quote(t)}" for t in targets]
    return "set -e\n" + "\n".join(lines)


def _du(path: Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total


def _remove_stale_partials(cache: Path) -> None:
    """Delete ``<key>.partial-<pid>`` directories whose preparation died (its pid is gone)."""
    for d in cache.glob("*.partial-*"):
        pid = d.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            subprocess.run(["rm", "-rf", "--one-file-system", str(d)], check=False)


def _build(key: str, lowers: list[Path], steps: list[tuple[str, str, dict[str, str], str]], context: Path | None,
           timeout: float, meta: dict, log: Callable[[str], None], binds: list[str] = (),
           finish: Callable[[Path], dict] | None = None) -> Layer:
    """Build a layer: run each (label, script, env, cwd) as root over `lowers`; atomic rename.

    `label` names the step in errors (``Dockerfile:12: RUN apt-get ...``); `binds`: more bwrap
    bind options for every step; `finish(partial layer directory)`, called after the last step
    and before the rename, returns more fields for meta.json."""
    if os.geteuid() != 0:
        raise LayerError("preparing a layer needs root (dpkg sets file owners; overlayfs upper directories need "
                         "it). Fix: run `minirsi task prepare` as root (sudo), or use --backend docker")
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(cache / f"{key}.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _layer(key)
        if done is not None:  # another process built it while we waited
            return done
        _remove_stale_partials(cache)
        part = cache / f"{key}.partial-{os.getpid()}"
        shutil.rmtree(part, ignore_errors=True)
        for sub in ("upper", "work", "merged"):
            (part / sub).mkdir(parents=True)
        pipbin = _stage_pip_bin(part)
        started, deadline = time.monotonic(), time.monotonic() + timeout
        log_path = part / "build.log"
        try:
            for label, script, env, cwd in steps:
                log(f"  {label}")
                argv = _jail_argv(lowers, part / "upper", part / "work", part / "merged", context, pipbin, env,
                                  f"cd {shlex.quote(cwd)} || exit 1\n{script}", binds)
                left = deadline - time.monotonic()
                try:
                    r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       timeout=max(1.0, left))
                except subprocess.TimeoutExpired as e:
                    out = (e.output or b"").decode(errors="replace")
                    raise LayerError(f"{label}: timed out (build_timeout_sec = {timeout:.0f}); last lines:\n"
                                     + "\n".join(out.splitlines()[-15:])) from e
                out = r.stdout.decode(errors="replace")
                with open(log_path, "a") as f:
                    f.write(f"### {label}\n{out}\n")
                if r.returncode != 0:
                    raise LayerError(f"{label}: {_why(out)}exited with status {r.returncode}; last lines:\n"
                                     + "\n".join(out.splitlines()[-15:]))
            shutil.rmtree(part / "work", ignore_errors=True)
            shutil.rmtree(part / "pipbin", ignore_errors=True)
            (part / "merged").rmdir()
            meta = {**meta, **(finish(part) if finish is not None else {}), "key": key, "format": LAYER_FORMAT,
                    "seconds": round(time.monotonic() - started, 2), "disk_bytes": _du(part / "upper"),
                    "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            (part / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            os.rename(part, cache / key)
            log(f"  layer {key}: {meta['disk_bytes'] / 2**20:.1f} MiB, built in {meta['seconds']:.1f} s")
        except BaseException:
            subprocess.run(["rm", "-rf", "--one-file-system", str(part)], check=False)
            raise
        return Layer(key, cache / key)
    finally:
        os.close(lock_fd)


def _env_steps(df: Dockerfile, context: Path) -> list[tuple[str, str, dict[str, str], str]]:
    where = df.path
    steps = []
    if df.python_image:
        steps.append((f"{where}: FROM {df.base}: pip, `python`, Python.h and venv as in the image", _PYTHON_IMAGE,
                      {"PYTHONPATH": _PIP}, "/"))
    for step in df.steps:
        label = f"{where}:{step.lineno}: {step.text.strip()[:100]}"
        env = dict(step.env)
        if step.kind == "workdir":
            steps.append((label, f"mkdir -p {shlex.quote(step.args[0])}", env, "/"))
        elif step.kind == "run":
            steps.append((label, step.args[0], env, step.workdir))
        else:
            steps.append((label, _copy_script(step, context, str(where)), env, "/"))
    steps.append((f"{where}: clean apt lists and caches; mount points for the verifier", f"{_CLEANUP}\n{_MOUNT_POINTS}",
                  {}, "/"))
    return steps


def _apt_steps(where: Path, packages: tuple[str, ...]) -> list[tuple[str, str, dict[str, str], str]]:
    pkgs = " ".join(shlex.quote(p) for p in packages)
    # with their Recommends, as test.sh's `apt-get install -y gcc` gets them in Docker (libc6-dev)
    return [(f"{where}: apt-get install {pkgs}",
             f"apt-get update -qq && apt-get install -y -qq {pkgs}", {}, "/"),
            (f"{where}: clean apt lists and caches", _CLEANUP, {}, "/")]


def _pip_steps(where: Path, specs: tuple[str, ...]) -> list[tuple[str, str, dict[str, str], str]]:
    pkgs = " ".join(shlex.quote(p) for p in specs)
    return [(f"{where}: test tools {pkgs}",
             f"python3 -m pip install -q --no-cache-dir --target {TOOLS_DIR} {pkgs}", {"PYTHONPATH": _PIP}, "/")]


def list_layers() -> list[dict]:
    """meta.json of every prepared layer in the cache (kind, key, disk_bytes, seconds, built...)."""
    root = cache_dir()
    return [json.loads((d / "meta.json").read_text()) for d in sorted(root.iterdir())
            if (d / "meta.json").is_file()] if root.is_dir() else []

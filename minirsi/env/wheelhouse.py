"""A package index inside the offline jail: each task's wheelhouse, gathered at preparation.

Terminal-Bench 2 agents, oracles and tests ``pip install`` packages while they run (TB2's
machines have the internet; largest-eigenval's solve.sh begins with ``pip install
eigenpy==3.10.3``). The local jail has no network, so ``minirsi task prepare`` gathers, once,
the packages a task names, and the jail gets them as a read-only local index.

What the index holds (``read_index_specs``): the specs of every ``pip install``, ``pip3
install``, ``python[3] -m pip install``, ``uv pip install`` and ``uv add`` command in the task's
files: every shell line of ``solution/`` and ``tests/`` (solve.sh, test.sh; in a Python file the
string literals of a line that mentions pip, ``sys.executable`` read as ``python``), the code of
instruction.md (inline code and fenced blocks), and requirements files those commands name
with ``-r`` (looked up by name in solution/, tests/ and environment/); plus the packages the
task lists in ``task.toml``::

    [environment]
    pip_packages = ["requests==2.32.5", "scipy"]     # minirsi's; Harbor ignores it

Pinned versions are kept; each command is resolved as one group, with all its dependencies, and
the index is the union of the groups (``pip wheel`` in the jail of the environment layer, so
for the image's own Python, ABI and platform: minirsi/env/sandbox/index_build.py). It is *not* the
public index: an agent asking for anything else gets pip's normal "No matching distribution
found" error, at once (no network retries).

Layer (``index``), key = sha256(format, the environment layer's key, the groups)::

    <cache>/<key>/upper/opt/minirsi-index/*.whl      the index (bound read-only in the jail)
    <cache>/<key>/upper/opt/minirsi-site/<n>/        wheel n installed (pip --target): the verifier's copy
    <cache>/wheels/*.whl                              the download store, shared by every task

Downloads are shared: every wheel a preparation gathers goes into the store, and the next
preparation's pip finds it in its wheel directory (a link to each stored wheel) and takes it
instead of downloading it ("File was already downloaded"); only the index pages are fetched
again, to resolve. (pip's HTTP cache cannot do this where a proxy strips PyPI's Cache-Control
headers, as on the machine this was written on; and pip prefers an index file to a find-links
one of the same version.) A package that PyPI has only as an sdist is built again for each
task. Preparing a task again finds its layer and runs nothing. A spec that
cannot be found (or built) is left out with a warning naming it (``Layer.meta["missing"]``); an
index that cannot be reached fails the preparation, so that no outage is cached. Where to
download from: PyPI, or the host's ``PIP_INDEX_URL`` / ``PIP_EXTRA_INDEX_URL`` /
``PIP_TRUSTED_HOST`` (a mirror), passed to the preparation's pip as the host's proxy settings
are.

Inside the jail (agent, oracle, setup script and verifier alike) the index is read-only at
``/opt/minirsi-index``, and ``pip``, ``pip3``, ``python -m pip`` and ``uv pip`` use it without
flags (``index_env``: PIP_NO_INDEX, PIP_FIND_LINKS, UV_OFFLINE, UV_FIND_LINKS; a task on a
layer without packages gets only PIP_NO_INDEX and UV_OFFLINE, so that pip and uv fail at once
instead of retrying the network). Nothing downloads while tasks run.

The verifier: it takes the Python library directories from the pristine image
(minirsi/env/sandbox/bwrap.py ``verifier_pins``), so that an agent cannot plant a ``.pth`` that
forges the reward; that would also hide what the agent legitimately installed (the oracle's
eigenpy). So for every distribution the episode installed into a pinned site-packages directory
that the index holds (found by its ``<name>-<version>.dist-info`` directory), the verifier sees
that directory as the pristine one with the index's clean copy of the distribution on top
(``verifier_overlays``; a read-only overlay, minirsi/env/sandbox/overlay_root.py ``--overlay``).
Departures from Docker, where the verifier sees the agent's site-packages as they are: what the
agent installed from anywhere else, or changed in an installed package, is not seen; a package
the agent upgraded shows the new version's files over the image's old ones (a file only the old
version had stays); a package it uninstalled is still there. The Docker backend has none of this
(its network and index are the engine's).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import parse_wheel_filename

from minirsi.env.layers import (_CONTEXT, _PIP, _PREFIXES, LAYER_FORMAT, Layer, LayerError, _build, _join_continuations,
                            _layer, _segments, cache_dir)

INDEX_DIR = "/opt/minirsi-index"
"""Where the jail sees the task's index (read-only)."""
SITE_DIR = "/opt/minirsi-site"  # the verifier's clean copies, in the layer only (never mounted whole)
_DOWNLOADS = "/tmp/.minirsi-wheels"  # pip's wheel directory in the preparation jail: the store, linked
_REPORT = "/opt/minirsi-index-report.json"
_DRIVER = Path(__file__).parent / "sandbox" / "index_build.py"
# The host's mirror settings for the preparation's pip (not its retries: pip names a connection
# error only when it retries, which is how index_build.py tells an outage from a missing package)
_MIRROR_VARS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST")
# install options that take a value (pip install, uv pip install, uv add): the value is not a spec
_VALUE_OPTIONS = frozenset(
    "-c --constraint -e --editable -t --target --platform --python-version --implementation --abi --root --prefix "
    "--src --upgrade-strategy --progress-bar --root-user-action --report -i --index-url --extra-index-url -f "
    "--find-links --log --log-file --proxy --retries --timeout --exists-action --trusted-host --cert --client-cert "
    "--cache-dir --python -p --global-option --config-settings -C --no-binary --only-binary --keyring-provider "
    "--use-feature --use-deprecated --index --default-index --index-strategy --group --optional --extra --package "
    "--tag --branch --rev --marker -m --bounds --script --directory --project --config-file --link-mode --resolution "
    "--prerelease --exclude-newer --upgrade-package -P --reinstall-package --no-build-package --no-binary-package "
    "--python-platform --torch-backend --overrides --build-constraints".split())
_STRING = re.compile(r"""(?:[rbuRBU]{0,2})("[^"\\]*(?:\\.[^"\\]*)*"|'[^'\\]*(?:\\.[^'\\]*)*')""")
_CODE = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", re.S)
_MAX_BYTES = 1 << 20  # larger files in solution/ or tests/ are data, not scripts


# --- reading what a task installs ---------------------------------------------------------------------
def _install_args(tokens: list[str]) -> list[str] | None:
    """The arguments after ``install`` / ``add`` if `tokens` is a pip or uv install command."""
    while tokens and (re.match(r"[A-Za-z_][A-Za-z0-9_]*=", tokens[0]) or tokens[0] in _PREFIXES):
        prefix, tokens = tokens[0], tokens[1:]  # X=1 cmd, sudo -E cmd, nice -n 10 cmd: the command follows
        while prefix in _PREFIXES and tokens and (tokens[0].startswith("-") or tokens[0].isdigit()):
            tokens = tokens[1:]
    if not tokens:
        return None
    cmd = os.path.basename(tokens[0])
    if re.fullmatch(r"pip3?(\.\d+)?", cmd) and tokens[1:2] == ["install"]:
        return tokens[2:]
    if re.fullmatch(r"python3?(\.\d+)?", cmd):  # python3 [-u ...] -m pip install
        rest = tokens[1:]
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            rest = rest[1:]
        if rest[:2] in (["-m", "pip"], ["-m", "pip3"]) and rest[2:3] == ["install"]:
            return rest[3:]
    if cmd == "uv" and tokens[1:3] == ["pip", "install"]:
        return tokens[3:]
    if cmd == "uv" and tokens[1:2] == ["add"]:
        return tokens[2:]
    return None


def _spec(token: str) -> str | None:
    """A normalised requirement (``numpy==2.3.0``, ``grpcio[protobuf]>=1.7``) or None for a
    path, a URL, a shell variable or anything else pip would not look up in an index."""
    if not token or "$" in token or "`" in token or "/" in token or token.startswith(".") or token.endswith(
            (".whl", ".zip", ".tar.gz", ".tgz")):
        return None
    try:
        req = Requirement(token)
    except InvalidRequirement:
        return None
    return None if req.url else str(req)


def _requirements_file(name: str, task) -> list[str]:
    """The specs of a requirements file an install command names (-r), found by its name in
    solution/, tests/ or environment/ (the command runs where those files are copied)."""
    for d in (task.path / "solution", task.tests_dir, task.environment_dir):
        path = d / Path(name).name
        if path.is_file():
            lines = [ln.split(" #", 1)[0].strip() for ln in path.read_text(errors="replace").splitlines()]
            return [s for s in (_spec(ln) for ln in lines if ln and not ln.startswith(("#", "-"))) if s]
    return []


def _group(args: list[str], task) -> tuple[str, ...]:
    """The specs of one install command's arguments (options and their values skipped)."""
    specs, i = [], 0
    while i < len(args):
        a = args[i]
        if a in ("-r", "--requirement", "--requirements") and i + 1 < len(args):
            specs += _requirements_file(args[i + 1], task)
            i += 2
        elif a in _VALUE_OPTIONS:
            i += 2
        elif a.startswith("-"):
            i += 1
        else:
            spec = _spec(a)
            if spec:
                specs.append(spec)
            i += 1
    return tuple(sorted(set(specs)))


def _groups_in_lines(lines: list[str], task) -> set[tuple[str, ...]]:
    groups = set()
    for line in lines:
        for seg in _segments(line):
            args = _install_args(seg)
            group = _group(args, task) if args is not None else ()
            if group:
                groups.add(group)
    return groups


def _python_lines(text: str) -> list[str]:
    """A Python file's lines that mention pip, as shell text: their string literals joined
    (``subprocess.run([sys.executable, "-m", "pip", "install", "x"])`` -> ``python -m pip install x``)."""
    out = []
    for line in text.splitlines():
        if "pip" not in line:
            continue
        strings = [m.group(1)[1:-1] for m in _STRING.finditer(line)]
        out.append(("python " if "sys.executable" in line else "") + " ".join(strings))
    return out


def _files(task) -> list[Path]:
    return sorted(p for d in (task.path / "solution", task.tests_dir) if d.is_dir() for p in d.rglob("*")
                  if p.is_file() and not p.is_symlink() and p.stat().st_size <= _MAX_BYTES)


_SPECS: dict[tuple, tuple[tuple[str, ...], ...]] = {}
"""read_index_specs' memo, by a stat signature of the files it reads (every sandbox of a task
looks its index up)."""


def read_index_specs(task) -> tuple[tuple[str, ...], ...]:
    """The groups of specs the task's index must hold, sorted: one per install command found in
    solution/, tests/ and instruction.md, and one for ``[environment] pip_packages``."""
    files = _files(task)
    signature = (str(task.path), task.instruction, tuple(task.environment.get("pip_packages") or ()),
                 tuple((str(p), st.st_size, st.st_mtime_ns) for p in files for st in [p.stat()]))
    if signature in _SPECS:
        return _SPECS[signature]
    groups: set[tuple[str, ...]] = set()
    for path in files:
        try:
            text = path.read_bytes().decode()
        except UnicodeDecodeError:
            continue  # a binary file
        lines = _python_lines(text) if path.suffix == ".py" else _join_continuations(text)
        groups |= _groups_in_lines(lines, task)
    code = [m.group(1) or m.group(2) for m in _CODE.finditer(task.instruction)]
    groups |= _groups_in_lines([ln for block in code for ln in _join_continuations(block)], task)
    listed = tuple(sorted({str(Requirement(s)) for s in task.environment.get("pip_packages") or ()}))
    if listed:
        groups.add(listed)
    _SPECS[signature] = tuple(sorted(groups))
    return _SPECS[signature]


# --- the layer --------------------------------------------------------------------------------------
def index_key(env_key: str, groups: tuple[tuple[str, ...], ...]) -> str:
    return hashlib.sha256(json.dumps([LAYER_FORMAT, "index", env_key, groups]).encode()).hexdigest()[:24]


def store_dir() -> Path:
    """The download store shared by every task's index: <layer cache>/wheels."""
    return cache_dir() / "wheels"


def _link_all(src: Path, dst: Path) -> None:
    """Hard-link (else copy) every wheel of `src` missing from `dst`; each appears whole (a
    temporary name, then a rename), so that a concurrent preparation never reads half a file."""
    dst.mkdir(parents=True, exist_ok=True)
    for wheel in src.glob("*.whl"):
        if (dst / wheel.name).exists():
            continue
        tmp = dst / f".{wheel.name}.{os.getpid()}.tmp"
        try:
            os.link(wheel, tmp)
        except OSError:
            shutil.copyfile(wheel, tmp)
        os.replace(tmp, dst / wheel.name)


def index_env(index: Layer | None) -> dict[str, str]:
    """The variables that point pip and uv at the task's index and at nothing else."""
    env = {"PIP_NO_INDEX": "1", "UV_OFFLINE": "1"}  # uv has no --no-index variable; offline, it reads find-links
    if index is not None:
        env.update({"PIP_FIND_LINKS": INDEX_DIR, "UV_FIND_LINKS": INDEX_DIR})
    return env


def index_dir(index: Layer) -> Path:
    """The host directory the jail sees at /opt/minirsi-index."""
    return index.upper / INDEX_DIR.lstrip("/")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _finish(part: Path, downloads: Path, store: Path) -> dict:
    """After the build: what was downloaded into the store; what the index holds, for meta.json."""
    _link_all(downloads, store)
    report_path = part / "upper" / _REPORT.lstrip("/")
    report = json.loads(report_path.read_text())
    report_path.unlink()
    index = part / "upper" / INDEX_DIR.lstrip("/")
    for wheel in index.glob("*.whl"):  # the index's wheels become links to the store's (one copy on disk)
        stored = store / wheel.name
        if stored.is_file() and _sha256(stored) == _sha256(wheel):
            tmp = index / f".{wheel.name}.tmp"
            os.link(stored, tmp)
            os.replace(tmp, wheel)
    site = part / "upper" / SITE_DIR.lstrip("/")
    wheels = []
    for name, n in sorted(report["site"].items()):
        dist, version, _, _ = parse_wheel_filename(name)
        dist_infos = sorted(p.name for p in (site / str(n)).glob("*.dist-info"))
        wheels.append({"file": name, "name": str(dist), "version": str(version), "site": n, "dist_info": dist_infos,
                       "bytes": (index / name).stat().st_size})
    return {"wheels": wheels, "missing": report["missing"], "index_bytes": sum(w["bytes"] for w in wheels)}


def prepare_index(task, env_layer: Layer, rootfs: Path, timeout: float,
                  log: Callable[[str], None] = lambda s: None) -> tuple[Layer | None, bool]:
    """The task's index (None if it names no package), built if missing: (layer, built)."""
    groups = read_index_specs(task)
    if not groups:
        return None, False
    key = index_key(env_layer.key, groups)
    layer = _layer(key)
    if layer is not None:
        return layer, False
    specs = sorted({s for g in groups for s in g})
    log(f"{task.task_id}: preparing package index {key} ({' '.join(specs)})")
    store = store_dir()
    context = Path(tempfile.mkdtemp(prefix="minirsi-index-"))
    # pip's wheel directory: the store's wheels, linked (same filesystem); named like a partial
    # layer so that a killed preparation's is removed with its partial layer
    downloads = cache_dir() / f"{key}.partial-downloads-{os.getpid()}"
    try:
        shutil.rmtree(downloads, ignore_errors=True)
        _link_all(store, downloads)
        shutil.copyfile(_DRIVER, context / "index_build.py")
        (context / "groups.json").write_text(json.dumps(groups))
        for p in (context, context / "index_build.py", context / "groups.json"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        script = (f"python3 {_CONTEXT}/index_build.py {_CONTEXT}/groups.json {_DOWNLOADS} {INDEX_DIR} {SITE_DIR} "
                  f"{_REPORT}")
        env = {"PYTHONPATH": _PIP, "PIP_NO_CACHE_DIR": "1",
               **{k: os.environ[k] for k in _MIRROR_VARS if os.environ.get(k)}}
        try:
            layer = _build(key, [env_layer.upper, rootfs], [(f"{task.task_id}: package index: pip wheel "
                                                              f"{shlex.join(specs)[:200]}", script, env, "/")],
                           context, timeout, {"kind": "index", "groups": groups, "env_layer": env_layer.key,
                                              "base_rootfs": str(rootfs)}, log,
                           binds=["--bind", str(downloads), _DOWNLOADS],
                           finish=lambda part: _finish(part, downloads, store))
        except LayerError as e:
            raise LayerError(f"{e}\nFix: check the network (or PIP_INDEX_URL) and prepare again; nothing was cached"
                             if "could not reach the package index" in str(e) else str(e)) from e
    finally:
        shutil.rmtree(context, ignore_errors=True)
        shutil.rmtree(downloads, ignore_errors=True)
    return layer, True


def describe(index: Layer) -> str:
    """One line for `task layers` / `task check -v`: wheels, size, what is missing."""
    meta = index.meta
    names = ", ".join(f"{w['name']} {w['version']}" for w in meta["wheels"])
    missing = f"; missing: {', '.join(meta['missing'])}" if meta["missing"] else ""
    return f"{len(meta['wheels'])} wheel(s), {meta['index_bytes'] / 2**20:.1f} MiB at {INDEX_DIR}: {names}{missing}"


def missing_warning(task, index: Layer) -> str | None:
    """The warning a preparation prints for specs the index lacks (None when it has them all)."""
    missing = index.meta["missing"]
    if not missing:
        return None
    return (f"warning: {task.task_id}: not in its package index (pip in the jail will say 'No matching "
            f"distribution'): " + "; ".join(f"{spec} ({why})" for spec, why in missing.items()))


# --- what the verifier sees ---------------------------------------------------------------------------
def verifier_overlays(index: Layer, episode_upper: Path, pinned: list[str]) -> list[tuple[str, Path, list[str]]]:
    """(site-packages path, the layer's site directory, wheel subdirectories) for each pinned
    site-packages directory into which the episode installed distributions the index holds.

    ``episode_upper``: the episode's changes (the overlay's upper directory); ``pinned``: the
    paths the verifier takes from the pristine image (relative). A distribution is found by
    its dist-info directory, which pip and uv name after the wheel's."""
    by_dist_info = {d: str(w["site"]) for w in index.meta["wheels"] for d in w["dist_info"]}
    out = []
    for site in sorted({p.parent for p in episode_upper.glob("usr/*lib/python3*/*-packages/*.dist-info")} |
                       {p.parent for p in episode_upper.glob("usr/local/lib/python3*/*-packages/*.dist-info")}):
        rel = site.relative_to(episode_upper).as_posix()
        if not any(rel == p or rel.startswith(p.rstrip("/") + "/") for p in pinned):
            continue  # the verifier sees this directory as the episode left it
        wheels = sorted({by_dist_info[d.name] for d in site.glob("*.dist-info") if d.name in by_dist_info}, key=int)
        if wheels:
            out.append((rel, index.upper / SITE_DIR.lstrip("/"), wheels))
    return out

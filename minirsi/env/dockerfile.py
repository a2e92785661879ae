"""Read a task's ``environment/Dockerfile`` into the steps the local backend can replay.

The bubblewrap backend has no image registry: every task runs on a base root filesystem,
``~/.cache/minirsi/rootfs`` (Debian 12 bookworm, Python 3.11), or for the images that are
Debian 13 today ``~/.cache/minirsi/rootfs-trixie`` (Debian 13 trixie, Python 3.13; built by
``minirsi task prepare`` when a task first needs it: minirsi/env/layers.py ``base_rootfs``). A
Dockerfile is replayed on top of it (minirsi/env/layers.py) instruction by instruction, as
``docker build`` would:

=============  ===========================================================================
instruction    what the local backend does
=============  ===========================================================================
FROM           ``debian:trixie``, ``debian:13*``, ``debian:stable*``, ``debian:latest`` and
               ``debian`` map to the Debian 13 rootfs (``Dockerfile.release`` "trixie");
               every other ``debian:*``, ``ubuntu:*``, ``python:*``, ``minirsi-base:*`` (any
               registry prefix, e.g. ``ghcr.io/.../t-bench/ubuntu-24-04``) to the Debian 12
               one; the versions that differ are listed in ``Dockerfile.notes`` (Ubuntu
               24.04 -> Debian 12, Python 3.13 -> 3.11). A ``python:*`` image also gets
               ``pip`` and ``python``.
               Any other image, a second FROM (multi-stage) or a CUDA image is an error.
WORKDIR        created; the last one is the task's workdir unless task.toml sets one
ENV, ARG       substituted (``$X``, ``${X}``, ``${X:-default}``) as Docker does; ENV also
               reaches the agent's shell and the verifier
COPY, ADD      from ``environment/`` to their destination (``--chown`` honoured); ADD
               unpacks a local tar archive and fetches a URL (at preparation)
RUN            ``/bin/sh -c`` as root in the layer, with the network, at preparation
USER           only ``root`` / ``0`` (the agent is always uid 1000 in the jail)
CMD, ENTRYPOINT, EXPOSE, LABEL, VOLUME, HEALTHCHECK, STOPSIGNAL, MAINTAINER, SHELL (bash/sh):
               ignored, as Harbor ignores them (it runs its own command in the container)
=============  ===========================================================================

``COPY --from``, ``RUN --mount``, ``ONBUILD`` and services (``docker-compose.yaml``) cannot be
honoured: ``DockerfileError`` names the file, the line and the way out (``--backend docker``).

Call::

    df = parse_dockerfile(task.dockerfile)    # Dockerfile(steps, env, workdir, notes, base, release)
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

BASE_DESCRIPTION = "Debian 12 bookworm, Python 3.11; Debian 13 trixie for debian:trixie/13/stable/latest"
RELEASES = {"bookworm": "Debian 12 bookworm", "trixie": "Debian 13 trixie"}
"""The base rootfs releases: Dockerfile.release -> what it is."""
# The debian tags that are Debian 13 today (stable and latest since August 2025): trixie, 13,
# 13.0, 13-slim, 13.1-slim, stable, stable-slim, stable-20250811, latest (also a missing tag).
_TRIXIE_TAG = re.compile(r"(trixie|13|13\.\d+|stable|latest)([.-]|$)")
_IGNORED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "VOLUME", "HEALTHCHECK", "STOPSIGNAL", "MAINTAINER"}
_DISTROS = ("debian", "ubuntu", "python", "buildpack-deps", "minirsi-base")  # minirsi-base: the rootfs itself
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?([-+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


class DockerfileError(ValueError):
    """A Dockerfile line the local backend cannot honour: names the file, line and the fix."""

    def __init__(self, path: Path | str, lineno: int, text: str, problem: str, fix: str):
        self.path, self.lineno = Path(path), lineno
        super().__init__(f"{path}:{lineno}: {text.strip()[:120]!r}: {problem}. Fix: {fix}")


@dataclass(frozen=True)
class Step:
    """One action of the preparation, in Dockerfile order."""

    lineno: int
    text: str
    """The instruction as written (continuations joined), for error messages."""
    kind: str
    """run | copy | workdir"""
    args: tuple[str, ...]
    """run: (shell command,); copy: (dest, chown, *sources) with dest absolute; workdir: (path,)"""
    env: tuple[tuple[str, str], ...] = ()
    """The ENV/ARG variables in force at this step."""
    workdir: str = "/"
    """WORKDIR in force (RUN's cwd, relative COPY destinations already resolved)."""


@dataclass
class Dockerfile:
    path: Path
    base: str
    """The FROM image as written."""
    steps: list[Step] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """ENV at the end (ARG excluded): set in the agent's shell and the verifier."""
    workdir: str | None = None
    """The last WORKDIR, or None."""
    notes: list[str] = field(default_factory=list)
    """How the local layer differs from the image (version differences, ignored lines)."""
    python_image: bool = False
    """FROM python:*: the layer gets pip and a ``python`` command as the image has."""
    release: str = "bookworm"
    """The base rootfs the layer sits on (a key of RELEASES): "trixie" for the debian images
    that are Debian 13 (map_base), else "bookworm"."""


_HEREDOC = re.compile(r"<<(-?)[\"']?([A-Za-z_][A-Za-z0-9_]*)[\"']?")


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction) with ``\\`` continuations joined, comments dropped, and
    BuildKit heredocs (``RUN <<EOF ... EOF``) kept with their body, newlines included, so that
    ``/bin/sh -c`` runs them as written."""
    out, buf, start = [], "", 0
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].rstrip()
        i += 1
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):  # comment lines inside a continuation are dropped
            continue
        if not buf:
            start = i
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        instruction = buf + line
        for m in _HEREDOC.finditer(instruction):  # each heredoc's body runs up to its terminator
            body = []
            while i < len(lines) and (lines[i].strip() if m.group(1) else lines[i]) != m.group(2):
                body.append(lines[i])
                i += 1
            i += 1
            instruction += "\n" + "\n".join(body + [m.group(2)])
        out.append((start, instruction))
        buf = ""
    if buf.strip():
        out.append((start, buf))
    return out


def substitute(value: str, env: dict[str, str]) -> str:
    """Docker's variable substitution: $X, ${X}, ${X:-default}, ${X:+alt}; unknown -> ''."""
    def repl(m: re.Match) -> str:
        have = env.get(m.group(1) or m.group(4), "")
        if m.group(2) == "-":
            return have or (m.group(3) or "")
        if m.group(2) == "+":
            return (m.group(3) or "") if have else ""
        return have
    return _VAR.sub(repl, value)


def _words(rest: str) -> list[str]:
    """JSON array form or whitespace-split (quotes honoured) form."""
    rest = rest.strip()
    if rest.startswith("["):
        try:
            value = json.loads(rest)
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return value
        except json.JSONDecodeError:
            pass
    return shlex.split(rest, posix=True)


def _pairs(rest: str, lineno: int, path: Path, text: str) -> list[tuple[str, str]]:
    """ENV/ARG arguments: K=V pairs, or the legacy ``ENV K the value``."""
    words = shlex.split(rest, posix=True)
    if words and "=" not in words[0]:
        if len(words) == 1:  # ARG NAME without a default
            return [(words[0], "")]
        return [(words[0], rest.strip().split(None, 1)[1])]
    pairs = []
    for w in words:
        if "=" not in w:
            raise DockerfileError(path, lineno, text, f"{w!r} is not NAME=value", "write NAME=value pairs")
        k, v = w.split("=", 1)
        pairs.append((k, v))
    return pairs


def map_base(image: str, lineno: int, path: Path, text: str) -> tuple[list[str], bool, str]:
    """FROM image -> (notes on what differs, is a python image, base release: "bookworm" or
    "trixie"); DockerfileError if unmapped. ``debian`` images that are Debian 13 today (trixie,
    13*, stable*, latest, no tag) map to the trixie rootfs; everything else to bookworm."""
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "latest")
    last = name.rsplit("/", 1)[-1].lower()
    if "cuda" in image.lower() or "nvidia" in image.lower():
        raise DockerfileError(path, lineno, text, "GPU images cannot run in the local sandbox (no GPU in the jail)",
                              "use --backend docker on a machine with a GPU")
    if not any(last.startswith(d) for d in _DISTROS):
        raise DockerfileError(path, lineno, text, f"image {image!r} has no local equivalent (only Debian, Ubuntu and "
                              f"python images map to the base rootfs, {BASE_DESCRIPTION})",
                              "use --backend docker with the image loaded (docker load), or base the Dockerfile on "
                              "debian:bookworm / ubuntu / python")
    notes = []
    python = last.startswith("python")
    m = re.search(r"python[-_]?(\d+)[.-](\d+)", last) or re.match(r"(\d+)\.(\d+)", tag)
    if python and m and (m.group(1), m.group(2)) != ("3", "11"):
        notes.append(f"{image}: Python {m.group(1)}.{m.group(2)} in the image, Python 3.11 in the local layer")
    release = "bookworm"
    if last.startswith("ubuntu"):
        notes.append(f"{image}: Ubuntu in the image, Debian 12 bookworm in the local layer (package versions differ)")
    elif last == "debian" and _TRIXIE_TAG.match(tag):
        release = "trixie"  # stable/latest are Debian 13 trixie since August 2025: so is the local layer
    elif last.startswith("debian") and not re.match(r"(bookworm|12)([.-]|$)", tag):
        notes.append(f"{image}: Debian {tag} in the image, Debian 12 bookworm in the local layer")
    return notes, python, release


def parse_dockerfile(path: Path | str, build_args: dict[str, str] | None = None) -> Dockerfile:
    """Parse ``path`` into steps; raise DockerfileError on the first line that cannot be honoured."""
    path = Path(path)
    text = path.read_text()
    compose = [p for p in path.parent.glob("docker-compose.y*ml")]
    if compose:
        raise DockerfileError(compose[0], 1, compose[0].name, "services (docker-compose) cannot run in the local sandbox",
                              "use --backend docker, or fold the service into the task's own processes")
    variables: dict[str, str] = dict(build_args or {})
    env: dict[str, str] = {}
    df: Dockerfile | None = None
    workdir = "/"
    for lineno, line in logical_lines(text):
        op, _, rest = line.strip().partition(" ")
        op = op.upper()
        if df is None and op not in ("FROM", "ARG"):
            raise DockerfileError(path, lineno, line, f"{op} before FROM", "start the Dockerfile with FROM")
        if op == "FROM":
            if df is not None:
                raise DockerfileError(path, lineno, line, "a second FROM (multi-stage build) cannot be replayed on one layer",
                                      "use --backend docker, or merge the stages into one")
            words = [w for w in rest.split() if not w.startswith("--platform")]
            image = substitute(words[0], variables) if words else ""
            notes, python, release = map_base(image, lineno, path, line)
            df = Dockerfile(path=path, base=image, notes=notes, python_image=python, release=release)
            continue
        if op == "ARG":
            for k, v in _pairs(rest, lineno, path, line):
                variables.setdefault(k, substitute(v, {**variables, **env}))
            continue
        if op == "ENV":  # every value sees the variables as they were before this line (Docker's rule)
            scope = {**variables, **env}
            env.update({k: substitute(v, scope) for k, v in _pairs(rest, lineno, path, line)})
            continue
        scope = {**variables, **env}
        snapshot = tuple(sorted(scope.items()))
        if op == "WORKDIR":
            target = substitute(rest.strip().strip('"'), scope)
            workdir = target if target.startswith("/") else str(Path(workdir) / target)
            df.workdir = workdir
            df.steps.append(Step(lineno, line, "workdir", (workdir,), snapshot, workdir))
        elif op == "RUN":
            if rest.lstrip().startswith("--"):
                raise DockerfileError(path, lineno, line, "RUN flags (--mount, --network, --security) cannot be honoured",
                                      "drop the flag (preparation already has the network), or use --backend docker")
            words = _words(rest) if rest.strip().startswith("[") else None
            command = shlex.join(words) if words else rest.strip()
            if command.startswith("<<") and "\n" in command:  # RUN <<EOF: the body is the script
                command = command.split("\n", 1)[1].rsplit("\n", 1)[0]
            df.steps.append(Step(lineno, line, "run", (command,), snapshot, workdir))
        elif op in ("COPY", "ADD"):
            words = _words(substitute(rest, scope))
            chown = ""
            while words and words[0].startswith("--"):
                flag = words.pop(0)
                if flag.startswith("--from"):
                    raise DockerfileError(path, lineno, line, "COPY --from (multi-stage build) cannot be replayed",
                                          "use --backend docker, or copy the file from environment/")
                if flag.startswith("--chown="):
                    chown = flag.split("=", 1)[1]
                # --chmod, --link: harmless to ignore (--chmod is applied by the source mode)
            if len(words) < 2:
                raise DockerfileError(path, lineno, line, f"{op} needs a source and a destination", f"write {op} <src> <dest>")
            *sources, dest = words
            dest_abs = dest if dest.startswith("/") else str(Path(workdir) / dest) + ("/" if dest.endswith("/") else "")
            kind = "add" if op == "ADD" else "copy"
            df.steps.append(Step(lineno, line, kind, (dest_abs, chown, *sources), snapshot, workdir))
        elif op == "USER":
            if substitute(rest.strip(), scope).split(":")[0] not in ("root", "0"):
                raise DockerfileError(path, lineno, line, "the local backend always runs the agent as uid 1000 and "
                                      "preparation as root; another USER cannot be honoured",
                                      "drop the USER line or use --backend docker")
        elif op == "SHELL":
            if not any(s in rest for s in ("bash", "/bin/sh")):
                raise DockerfileError(path, lineno, line, "only sh/bash shells exist in the layer", "drop the SHELL line")
            df.notes.append(f"line {lineno}: SHELL ignored (RUN uses /bin/sh -c)")
        elif op == "ONBUILD":
            raise DockerfileError(path, lineno, line, "ONBUILD cannot be honoured", "drop it")
        elif op in _IGNORED:
            continue
        else:
            raise DockerfileError(path, lineno, line, f"unknown instruction {op}", "check the spelling")
    if df is None:
        raise DockerfileError(path, 1, text[:80], "no FROM line", "start the Dockerfile with FROM debian:bookworm")
    df.env = env
    return df

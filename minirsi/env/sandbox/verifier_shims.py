"""Offline stand-ins for the commands a Terminal-Bench 2 test.sh runs, inside the verifier jail.

The standard test.sh (unchanged)::

    apt-get update && apt-get install -y curl
    curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh
    source $HOME/.local/bin/env
    uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA

needs the network four times. The verifier jail has none, so ``/opt/minirsi/bin`` (first on
its PATH) holds these stand-ins, which resolve to what ``minirsi task prepare`` installed in the
task's tools layer (minirsi/env/layers.py: apt packages into the layer, pip packages into
/opt/minirsi-tools). What each accepts, and what it refuses (exit status, message on stderr):

- ``apt-get`` / ``apt``: ``update``, ``clean``, ``autoremove`` succeed doing nothing;
  ``install PKG...`` succeeds if every PKG is installed in the layer (or is ``curl``, which is
  this stand-in), else exits 100 naming the package. Anything else exits 100.
- ``curl``: a ``https://astral.sh/uv[/VERSION]/install.sh`` URL returns an installer that
  writes ``$HOME/.local/bin/env`` (and uv/uvx links there). Any other URL runs the layer's
  own curl if it has one (offline, so it fails as real curl would), else exits 7.
- ``uvx ARGS`` = ``uv tool run ARGS`` = ``uv run ARGS``: options ``-p/--python V`` (noted on
  stderr when V is not the layer's Python), ``-w/--with SPEC[,SPEC]``, ``--from SPEC``, and
  flags without a value (``-q``, ``--isolated``, ``--no-project``...). Every SPEC must be
  installed in /opt/minirsi-tools (name, and version when pinned with ==), else exit 2. The
  command ``pytest`` runs that pytest with the layer's /usr/bin/python3 (``-P``: the work
  directory is not on sys.path, so an agent's ``pytest.py`` cannot stand in for it);
  ``python``/``python3`` and console scripts of the tools run with the tools on sys.path.
- ``uv pip install SPEC...``: succeeds if every SPEC is prepared (as above), else exit 2.
  ``uv venv [DIR]``: makes DIR/bin/activate (it keeps the stand-ins on PATH).
  ``uv --version``. Other ``uv`` commands (``sync``, ``add``, ``init``...) exit 2.
- ``sudo [-E] [-n] [-H] CMD ARGS``: runs CMD (the verifier is already root in its jail); other
  sudo options exit 1.
- ``pip`` / ``pip3 install SPEC...`` (a test.sh that installs its test tools with pip): succeeds
  if every SPEC is prepared, else exits 1; other pip commands run the layer's own pip. As in
  Docker, where they land in the image's Python, such a test.sh's tools are on the verifier's
  PYTHONPATH (``python -m pytest --ctrf ...`` runs the prepared pytest and its plugins).
- ``pytest ARGS``: the prepared pytest when test.sh's tools include one, else the layer's own.

Run as ``python3 -I verifier_shims.py <command> ARGS``; stdlib only (it runs on the layer's
Python, never imports minirsi).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

TOOLS = "/opt/minirsi-tools"
SHIM_BIN = "/opt/minirsi/bin"
PYTHON = "/usr/bin/python3"
UV_VERSION = "0.9.5"
INSTALLER = f"""#!/bin/sh
# minirsi offline stand-in for the uv installer: uv and uvx resolve to the prepared test tools.
mkdir -p "$HOME/.local/bin"
cat > "$HOME/.local/bin/env" <<'MINIRSI_EOF'
case ":$PATH:" in *":{SHIM_BIN}:"*) ;; *) export PATH="{SHIM_BIN}:$PATH" ;; esac
MINIRSI_EOF
ln -sf {SHIM_BIN}/uv "$HOME/.local/bin/uv"
ln -sf {SHIM_BIN}/uvx "$HOME/.local/bin/uvx"
echo "everything's installed! (minirsi offline stand-in for uv {UV_VERSION})"
"""
_UV_URL = re.compile(r"^https?://astral\.sh/uv/(?:[0-9][\w.]*/)?install\.sh$")


def _say(tool: str, message: str) -> None:
    print(f"{tool} (minirsi offline stand-in): {message}", file=sys.stderr)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _installed_tools() -> dict[str, str]:
    """Normalised distribution name -> version, from /opt/minirsi-tools/*.dist-info."""
    out = {}
    if os.path.isdir(TOOLS):
        for entry in os.listdir(TOOLS):
            m = re.fullmatch(r"(.+)-([^-]+)\.dist-info", entry)
            if m:
                out[_norm(m.group(1))] = m.group(2)
    return out


def missing_specs(specs: list[str]) -> list[str]:
    """The specs the tools layer does not satisfy (name; version too when pinned with ==)."""
    have = _installed_tools()
    missing = []
    for spec in specs:
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*(?:==\s*([^,;\s]+))?", spec)
        if not m:
            missing.append(spec)
            continue
        name, version = _norm(m.group(1)), m.group(3)
        if name not in have or (version is not None and have[name] != version):
            missing.append(spec)
    return missing


def _package_installed(name: str) -> bool:
    name = re.split(r"[=:]", name, maxsplit=1)[0]
    r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", name], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    return r.returncode == 0 and r.stdout.decode().endswith("installed") and b"not-installed" not in r.stdout


def apt_get(args: list[str]) -> int:
    words = [a for a in args if not a.startswith("-")]
    action = words[0] if words else ""
    if action in ("update", "clean", "autoclean", "autoremove"):
        _say("apt-get", f"'{action}' skipped (no network in the verifier; packages were installed at preparation)")
        return 0
    if action == "install":
        missing = [p for p in words[1:] if p not in ("curl",) and not _package_installed(p)]
        if missing:
            print(f"E: minirsi offline stand-in: package(s) {' '.join(missing)} not in the prepared layer and the "
                  "verifier has no network. Fix: run `minirsi task prepare` on this task", file=sys.stderr)
            return 100
        _say("apt-get", f"{' '.join(words[1:]) or 'nothing'}: already installed at preparation")
        return 0
    print(f"E: minirsi offline stand-in: apt-get {action or '(no command)'} is not supported in the verifier "
          "(update, install, clean, autoremove are)", file=sys.stderr)
    return 100


def curl(args: list[str]) -> int:
    urls = [a for a in args if re.match(r"https?://", a)]
    output = None
    for i, a in enumerate(args):
        if a in ("-o", "--output") and i + 1 < len(args):
            output = args[i + 1]
    if len(urls) == 1 and _UV_URL.match(urls[0]):
        if output:
            with open(output, "w") as f:
                f.write(INSTALLER)
        else:
            sys.stdout.write(INSTALLER)
        return 0
    for d in ("/usr/bin", "/usr/local/bin", "/bin"):
        real = os.path.join(d, "curl")
        if os.access(real, os.X_OK):
            os.execv(real, [real, *args])
    _say("curl", f"no network in the verifier; only the uv installer URL is served (asked for {' '.join(urls) or 'no URL'})")
    return 7


def _python_note(requested: str | None) -> None:
    have = f"{sys.version_info.major}.{sys.version_info.minor}"
    m = re.search(r"(\d+)\.(\d+)", requested or "")
    if m and f"{m.group(1)}.{m.group(2)}" != have:
        _say("uv", f"Python {requested} requested; the prepared layer runs Python {sys.version.split()[0]}")


def _env_with_tools() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = TOOLS + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _run_pytest(args: list[str]) -> None:
    """Replace this process by the prepared pytest (the tools first on sys.path, not the cwd)."""
    launch = f"import sys; sys.path.insert(0, {TOOLS!r}); import pytest; sys.exit(pytest.console_main())"
    # no cache provider: /tests is read-only here (in Harbor it is writable)
    os.execve(PYTHON, [PYTHON, "-P", "-s", "-c", launch, "-p", "no:cacheprovider", *args], _env_with_tools())


def _real(name: str) -> str | None:
    """`name` on PATH, skipping the stand-ins."""
    for d in os.environ.get("PATH", "").split(":"):
        path = os.path.join(d, name)
        if d and d != SHIM_BIN and os.access(path, os.X_OK) and not os.path.isdir(path):
            return path
    return None


def pytest_(args: list[str]) -> int:
    if "pytest" in _installed_tools():
        _run_pytest(args)
    real = _real("pytest")
    if real is None:
        _say("pytest", "no pytest in the layer and none prepared. Fix: run `minirsi task prepare` on this task")
        return 127
    os.execv(real, [real, *args])
    return 0  # not reached


def pip(args: list[str], tool: str) -> int:
    if args[:1] == ["install"]:
        specs = [a for a in args[1:] if not a.startswith("-")]
        missing = missing_specs(specs)
        if missing:
            _say(tool, f"install {', '.join(missing)}: not prepared and the verifier has no network. "
                       "Fix: run `minirsi task prepare` on this task")
            return 1
        _say(tool, f"{' '.join(specs)}: prepared at preparation")
        return 0
    real = _real(tool)
    if real is None:
        _say(tool, f"no {tool} in the layer")
        return 127
    os.execv(real, [real, *args])
    return 0  # not reached


def tool_run(args: list[str], tool: str = "uvx") -> int:
    """uvx / uv tool run / uv run: check the specs, then run the command on the prepared tools."""
    specs, python, i = [], None, 0
    while i < len(args):
        a = args[i]
        if a in ("-w", "--with", "--from") and i + 1 < len(args):
            specs += [s for s in args[i + 1].split(",") if s]
            i += 2
        elif a == "--with-requirements" and i + 1 < len(args):
            with open(args[i + 1]) as f:
                specs += [ln.split("#", 1)[0].strip() for ln in f
                          if ln.split("#", 1)[0].strip() and not ln.lstrip().startswith("-")]
            i += 2
        elif a.startswith(("--with=", "--from=")):
            specs += [s for s in a.split("=", 1)[1].split(",") if s]
            i += 1
        elif a in ("-p", "--python") and i + 1 < len(args):
            python = args[i + 1]
            i += 2
        elif a.startswith("--python="):
            python = a.split("=", 1)[1]
            i += 1
        elif a == "--":
            i += 1
            break
        elif a.startswith("-"):
            i += 1
        else:
            break
    command, rest = (args[i], args[i + 1:]) if i < len(args) else (None, [])
    if command is None:
        _say(tool, "no command given")
        return 2
    if command in ("pytest", "py.test") and not any(_norm(re.split(r"[=<>!~\[ ]", s)[0]) == "pytest" for s in specs):
        specs.append("pytest")
    missing = missing_specs(specs)
    if missing:
        _say(tool, f"{', '.join(missing)} not prepared in {TOOLS} and the verifier has no network. "
                   "Fix: run `minirsi task prepare` on this task")
        return 2
    _python_note(python)
    env = _env_with_tools()
    if command in ("pytest", "py.test"):
        _run_pytest(rest)
    if command in ("python", "python3"):
        os.execve(PYTHON, [PYTHON, *rest], env)
    script = os.path.join(TOOLS, "bin", command)
    if os.access(script, os.X_OK):
        os.execve(PYTHON, [PYTHON, "-P", "-s", script, *rest], env)
    _say(tool, f"command {command!r} is not among the prepared tools (pytest, python, or a console script in {TOOLS}/bin)")
    return 2


def uv(args: list[str]) -> int:
    words = [a for a in args if not a.startswith("-")]
    if "--version" in args[:1] or args[:1] == ["version"]:
        print(f"uv {UV_VERSION} (minirsi offline stand-in)")
        return 0
    if args[:1] == ["run"]:
        return tool_run(args[1:], "uv run")
    if args[:2] == ["tool", "run"]:
        return tool_run(args[2:], "uv tool run")
    if args[:2] == ["pip", "install"]:
        specs = [a for a in args[2:] if not a.startswith("-")]
        missing = missing_specs(specs)
        if missing:
            _say("uv", f"pip install {', '.join(missing)}: not prepared and the verifier has no network. "
                       "Fix: run `minirsi task prepare` on this task")
            return 2
        return 0
    if args[:1] == ["venv"]:
        target = words[1] if len(words) > 1 else ".venv"
        os.makedirs(os.path.join(target, "bin"), exist_ok=True)
        with open(os.path.join(target, "bin", "activate"), "w") as f:
            f.write(f'export VIRTUAL_ENV="{os.path.abspath(target)}"\n'
                    f'case ":$PATH:" in *":{SHIM_BIN}:"*) ;; *) export PATH="{SHIM_BIN}:$PATH" ;; esac\n'
                    f'export PYTHONPATH="{TOOLS}${{PYTHONPATH:+:$PYTHONPATH}}"\n')
        return 0
    _say("uv", f"'uv {' '.join(args[:2])}' is not supported offline (run, tool run, pip install, venv, --version are)")
    return 2


def sudo(args: list[str]) -> int:
    while args and args[0] in ("-E", "-n", "-H", "--preserve-env", "--non-interactive"):
        args = args[1:]
    if not args or args[0].startswith("-"):
        _say("sudo", f"only `sudo [-E] [-n] [-H] CMD ...` is supported (got {' '.join(args) or 'nothing'})")
        return 1
    try:
        os.execvp(args[0], args)
    except OSError as e:
        _say("sudo", f"{args[0]}: {e.strerror}")
        return 127
    return 0  # not reached: execvp replaces this process


def main(argv: list[str]) -> int:
    if not argv:
        return 2
    tool, args = argv[0], argv[1:]
    if tool in ("apt-get", "apt"):
        return apt_get(args)
    if tool == "curl":
        return curl(args)
    if tool == "uvx":
        if args[:1] == ["--version"]:
            print(f"uvx {UV_VERSION} (minirsi offline stand-in)")
            return 0
        return tool_run(args)
    if tool == "uv":
        return uv(args)
    if tool == "sudo":
        return sudo(args)
    if tool in ("pip", "pip3"):
        return pip(args, tool)
    if tool == "pytest":
        return pytest_(args)
    _say(tool, "unknown stand-in")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Build a task's package index inside its preparation jail (minirsi/env/wheelhouse.py calls it).

Run by the environment layer's own ``python3``, with the network, on an overlay of the layer
(so pip resolves for the image's Python version, ABI and platform), as::

    python3 index_build.py GROUPS.json DOWNLOADS OUT SITE REPORT.json

- GROUPS.json: a list of groups, each the specs of one install command (``["eigenpy==3.10.3"]``).
- For each group, online: ``python3 -m pip wheel --wheel-dir DOWNLOADS SPEC...``: the specs and
  all their dependencies as wheels (an sdist is built into a wheel here, so that the offline
  jail never has to build one). DOWNLOADS starts with a link to every wheel of the shared
  download store, and pip takes a wheel already in its wheel directory instead of downloading
  it ("File was already downloaded"): only the index pages are fetched again.
- Then, offline: ``pip wheel --no-index --find-links DOWNLOADS --wheel-dir OUT SPEC...`` puts
  exactly that group's wheels in OUT, the index, and proves that the group installs from it.
- A group that fails is retried spec by spec; a spec that still fails is recorded in REPORT
  with pip's own error lines (the preparation goes on: the index just lacks it). A failure to
  reach the index (a connection error, a timeout, a proxy or TLS error) exits 3 instead:
  nothing may be cached from a network outage.
- Every wheel in OUT is then installed with ``pip install --no-deps --no-index --target
  SITE/<n>`` (n = its position in sorted order): the clean copies the verifier's Python sees
  when the agent installed that distribution (minirsi/env/sandbox/bwrap.py).
- REPORT.json: ``{"missing": {spec: error}, "site": {wheel file: n}}``.

Standard library only (the jail's Python has nothing else; pip comes from PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

# pip's messages when the index cannot be reached (urllib3 / requests / ssl), not when a
# package is missing from it
NETWORK = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|ConnectTimeout"
                     r"|ReadTimeout|ProxyError|SSLError|Network is unreachable|Connection refused")


def pip(*args: str) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", "pip", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    sys.stdout.write(r.stdout)
    sys.stdout.flush()
    return r.returncode, r.stdout


def wheel(specs: list[str], downloads: str, out: str) -> str | None:
    """None once every spec and its dependencies are wheels in `out`, else pip's error."""
    print(f"### pip wheel {' '.join(specs)}", flush=True)
    code, text = pip("wheel", "--wheel-dir", downloads, *specs)
    if code == 0:
        code, text = pip("wheel", "--no-index", "--find-links", downloads, "--wheel-dir", out, *specs)
        if code == 0:
            return None
    network = NETWORK.search(text)
    if network:
        print(f"minirsi index: pip could not reach the package index ({network.group(0)}) while resolving "
              f"{' '.join(specs)}; nothing is cached", flush=True)
        sys.exit(3)
    errors = [line for line in text.splitlines() if line.startswith("ERROR:")]
    return " ".join(errors[-2:]) if errors else f"pip wheel exited with status {code}"


def main(groups_file: str, downloads: str, out: str, site: str, report: str) -> None:
    with open(groups_file) as f:
        groups = json.load(f)
    os.makedirs(out, exist_ok=True)
    missing: dict[str, str] = {}
    for group in groups:
        error = wheel(group, downloads, out)
        if error is None:
            continue
        if len(group) == 1:
            missing[group[0]] = error
            continue
        for spec in group:  # which of them is missing (the others still go in)
            error = wheel([spec], downloads, out)
            if error is not None:
                missing[spec] = error
    files = sorted(f for f in os.listdir(out) if f.endswith(".whl"))
    for n, name in enumerate(files):
        code, _ = pip("install", "--no-deps", "--no-index", "--no-cache-dir", "--target", os.path.join(site, str(n)),
                      os.path.join(out, name))
        if code != 0:
            sys.exit(f"minirsi index: installing {name} for the verifier failed (status {code})")
    with open(report, "w") as f:
        json.dump({"missing": missing, "site": {name: n for n, name in enumerate(files)}}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:6])

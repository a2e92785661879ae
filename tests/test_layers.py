"""Environment layers (minirsi/env/layers.py), the Dockerfile reader (minirsi/env/dockerfile.py) and the
verifier's offline stand-ins (minirsi/env/sandbox/verifier_shims.py).

The fast tests read Dockerfiles and test.sh files and call the stand-ins on the host. The slow
ones prepare the Terminal-Bench 2 shaped fixture tests/fixtures/tasks/tb2/word-stats (two
Debian packages and one pip package from the network, plus pytest and pytest-json-ctrf for
the verifier) into a private layer cache, then play episodes on it (among them, package
indexes of wheels built here and served by a local HTTP index: no network); and tb2/trixie-release
(FROM debian:trixie) on the Debian 13 base rootfs, which its preparation debootstraps the first
time on a machine (~2 min, ~420 MB, kept in ~/.cache/minirsi/rootfs-trixie).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tarfile
import threading
import time
import zipfile
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from minirsi.env.dockerfile import DockerfileError, map_base, parse_dockerfile, substitute
from minirsi.env.layers import ROOTFS_PACKAGES, LayerError, ToolSpec, base_rootfs, ensure_base, read_tool_spec
from minirsi.env.prepare import find_prepared, prepare
from minirsi.env.sandbox import SandboxError, open_sandbox
from minirsi.env.sandbox import verifier_shims as shims
from minirsi.env.sandbox.bwrap import default_rootfs
from minirsi.env.task_cli import check_task, cli
from minirsi.env.tasks import load_task
from minirsi.env.verifier import verify

FIXTURES = Path(__file__).parent / "fixtures" / "tasks"
WORD_STATS = FIXTURES / "tb2" / "word-stats"
TRIXIE = FIXTURES / "tb2" / "trixie-release"


def _dockerfile(tmp_path: Path, text: str) -> Path:
    env = tmp_path / "environment"
    env.mkdir(parents=True, exist_ok=True)
    (env / "Dockerfile").write_text(text)
    return env / "Dockerfile"


# --- the Dockerfile reader ---------------------------------------------------------------------------
def test_fixture_dockerfile_steps_env_and_notes():
    df = parse_dockerfile(WORD_STATS / "environment" / "Dockerfile")
    assert [s.kind for s in df.steps] == ["run", "run", "workdir", "copy", "copy"]
    assert df.workdir == "/app" and df.env == {"REPORT_PATH": "/app/report.json"} and df.python_image
    assert df.steps[0].lineno == 4 and "tree" in df.steps[0].args[0]  # continuation lines joined
    assert df.steps[4].args[:1] == ("/app/",)  # COPY x ./ resolved against WORKDIR
    assert df.notes == ["python:3.13-slim-bookworm: Python 3.13 in the image, Python 3.11 in the local layer"]


@pytest.mark.parametrize("image, release, differs", [
    ("debian:bookworm", "bookworm", False), ("debian:12.5-slim", "bookworm", False),
    ("debian:bookworm-20250520", "bookworm", False), ("debian:12", "bookworm", False),
    # the images that are Debian 13 today (stable/latest since August 2025): the Debian 13 base
    ("debian:trixie", "trixie", False), ("debian:trixie-20250811-slim", "trixie", False), ("debian:13", "trixie", False),
    ("debian:13.0-slim", "trixie", False), ("debian:13.1", "trixie", False), ("debian:stable", "trixie", False),
    ("debian:stable-slim", "trixie", False), ("debian:latest", "trixie", False), ("debian", "trixie", False),
    ("docker.io/library/debian:stable-slim", "trixie", False),
    # older and newer Debians stay on bookworm, with a note
    ("debian:bullseye", "bookworm", True), ("debian:11-slim", "bookworm", True), ("debian:testing", "bookworm", True),
    ("debian:sid", "bookworm", True), ("debian:130", "bookworm", True),
])
def test_debian_tags_map_to_their_release(tmp_path, image, release, differs):
    df = parse_dockerfile(_dockerfile(tmp_path, f"FROM {image}\n"))
    assert (df.release, bool(df.notes)) == (release, differs)
    assert all("Debian 12 bookworm in the local layer" in n for n in df.notes)
    assert map_base(image, 1, tmp_path / "Dockerfile", f"FROM {image}")[2] == release


@pytest.mark.parametrize("image", ["ubuntu:24.04", "python:3.13-slim", "python:3.13-slim-trixie", "minirsi-base:bookworm",
                                   "ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624"])
def test_ubuntu_and_python_images_stay_on_bookworm(tmp_path, image):
    # python images get the python-image step, written for bookworm's Python 3.11
    assert parse_dockerfile(_dockerfile(tmp_path, f"FROM {image}\n")).release == "bookworm"


def test_base_rootfs_is_a_sibling_or_the_override(tmp_path, monkeypatch):
    monkeypatch.delenv("MINIRSI_ROOTFS_TRIXIE", raising=False)
    rootfs = tmp_path / "rootfs"
    assert base_rootfs("bookworm", rootfs) == rootfs and base_rootfs("trixie", rootfs) == tmp_path / "rootfs-trixie"
    monkeypatch.setenv("MINIRSI_ROOTFS_TRIXIE", str(tmp_path / "elsewhere"))
    assert base_rootfs("trixie", rootfs) == tmp_path / "elsewhere" and base_rootfs("bookworm", rootfs) == rootfs


def test_setup_sh_builds_the_same_packages_as_the_trixie_base():
    setup = (Path(__file__).parents[1] / "scripts" / "setup.sh").read_text()
    assert f"--include={ROOTFS_PACKAGES} " in setup


def test_a_missing_trixie_base_is_unprepared_and_without_debootstrap_named(tmp_path, monkeypatch):
    import minirsi.env.layers as layers_mod

    monkeypatch.setenv("MINIRSI_ROOTFS_TRIXIE", str(tmp_path / "rootfs-trixie"))
    monkeypatch.setenv("MINIRSI_LAYERS", str(tmp_path / "layers"))
    task = load_task(TRIXIE)
    assert find_prepared(task, default_rootfs()) is None  # no base, no layer: nothing is built or hashed
    monkeypatch.setattr(layers_mod.shutil, "which", lambda name: None)
    with pytest.raises(LayerError, match=r"Debian 13 trixie base rootfs .*debootstrap is not installed(.|\n)*"
                                         r"debootstrap --variant=minbase --include=python3,.* trixie \S+/rootfs-trixie"
                                         r"\.partial http://deb.debian.org/debian"):
        prepare(task, default_rootfs())
    assert not (tmp_path / "rootfs-trixie").exists() and not (tmp_path / "layers").exists()
    assert ensure_base("bookworm", tmp_path / "rootfs") == (tmp_path / "rootfs", False)  # setup.sh's, never built here


def test_the_trixie_base_is_built_once_atomically(tmp_path, monkeypatch):
    """Two preparations at once run debootstrap once (flock); it builds into <dir>.partial, renamed
    when complete; a failed one leaves nothing and names the command."""
    import threading

    import minirsi.env.layers as layers_mod

    runs = tmp_path / "runs"
    fake = ('echo run >> "$0"; sleep 0.3; [ -n "$FAIL" ] && { echo "E: Failed getting release file"; exit 1; }; '
            'mkdir -p "$1/var/lib/dpkg" "$1/usr/bin" && touch "$1/var/lib/dpkg/status" "$1/usr/bin/bash"')
    monkeypatch.setattr(layers_mod, "_debootstrap_argv", lambda release, target: ["sh", "-c", fake, str(runs), str(target)])
    monkeypatch.setattr(layers_mod.shutil, "which", lambda name: "/usr/sbin/" + name)
    monkeypatch.setattr(layers_mod.os, "geteuid", lambda: 0)
    monkeypatch.delenv("MINIRSI_ROOTFS_TRIXIE", raising=False)
    monkeypatch.setenv("FAIL", "1")
    with pytest.raises(LayerError, match=r"building the Debian 13 trixie base rootfs .*rootfs-trixie: `sh -c .*` exited "
                                         r"with status 1; last lines:\nE: Failed getting release file"):
        ensure_base("trixie", tmp_path / "rootfs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rootfs-trixie.lock", "runs"]
    monkeypatch.delenv("FAIL")
    results = []
    threads = [threading.Thread(target=lambda: results.append(ensure_base("trixie", tmp_path / "rootfs")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    base = tmp_path / "rootfs-trixie"
    assert sorted(results) == [(base, False), (base, True)] and runs.read_text() == "run\nrun\n"  # 1 failed, 1 built
    assert not (tmp_path / "rootfs-trixie.partial").exists() and ensure_base("trixie", tmp_path / "rootfs") == (base, False)


def test_a_failed_run_on_a_differing_base_says_the_base_differs(tmp_path, monkeypatch):
    import minirsi.env.prepare as prepare_mod

    def failing_build(key, lowers, steps, context, timeout, meta, log):
        raise LayerError("Dockerfile:3: RUN apt-get source pmars: exited with status 100; last lines:\nE: no")
    monkeypatch.setattr(prepare_mod, "_build", failing_build)
    monkeypatch.setattr(prepare_mod, "_layer", lambda key: None)
    rootfs = tmp_path / "rootfs"
    (rootfs / "var/lib/dpkg").mkdir(parents=True)
    (rootfs / "var/lib/dpkg/status").write_text("Package: x\n")
    older = _variant(tmp_path, "bullseye", "FROM debian:bullseye\nWORKDIR /app\nRUN apt-get source pmars\n")
    with pytest.raises(LayerError, match=r"exited with status 100(.|\n)*\(base differs: debian:bullseye: Debian "
                                         r"bullseye in the image, Debian 12 bookworm in the local layer\)"):
        prepare(load_task(older), rootfs)
    same = _variant(tmp_path, "bookworm", "FROM debian:bookworm\nWORKDIR /app\nRUN apt-get source pmars\n")
    with pytest.raises(LayerError) as caught:
        prepare(load_task(same), rootfs)
    assert "base differs" not in str(caught.value)


def test_env_arg_substitution_and_legacy_env(tmp_path):
    df = parse_dockerfile(_dockerfile(tmp_path, "ARG V=1.2\nFROM ubuntu:24.04\nENV A=x\nENV B=\"$A/y\" A=z\nENV C the ${B:-no} z\n"
                                                "ENV D=${MISSING:-dflt} E=${A:+alt}\nWORKDIR /srv/$A\nRUN echo $V\n"))
    assert df.env == {"A": "z", "B": "x/y", "C": "the x/y z", "D": "dflt", "E": "alt"}
    assert df.workdir == "/srv/z"
    assert "Ubuntu" in df.notes[0]
    assert substitute("${A}-$B", {"A": "1"}) == "1-"


def test_heredoc_run_keeps_its_body(tmp_path):
    df = parse_dockerfile(_dockerfile(tmp_path, "FROM debian:bookworm\nRUN <<EOF\nset -e\necho a > /x\n\nEOF\n"
                                                "RUN cat > /y <<-'END'\n\tplain $HOME\n\tEND\nWORKDIR /app\n"))
    assert [(s.lineno, s.kind) for s in df.steps] == [(2, "run"), (7, "run"), (10, "workdir")]
    assert df.steps[0].args[0] == "set -e\necho a > /x\n"  # RUN <<EOF: the body is the script
    assert df.steps[1].args[0] == "cat > /y <<-'END'\n\tplain $HOME\nEND"


@pytest.mark.parametrize("text, line, words", [
    ("FROM debian:bookworm AS build\nRUN make\nFROM debian:bookworm\n", 3, "multi-stage"),
    ("FROM debian:bookworm\nCOPY --from=build /x /y\n", 2, "COPY --from"),
    ("FROM debian:bookworm\nRUN --mount=type=cache,target=/c make\n", 2, "RUN flags"),
    ("FROM nvidia/cuda:12.2.0-runtime-ubuntu22.04\n", 1, "GPU"),
    ("FROM alpine:3.19\n", 1, "no local equivalent"),
    ("FROM debian:bookworm\nUSER app\n", 2, "USER"),
    ("RUN echo\n", 1, "before FROM"),
    ("FROM debian:bookworm\nFROBNICATE x\n", 2, "unknown instruction"),
])
def test_lines_that_cannot_be_honoured_name_the_line(tmp_path, text, line, words):
    path = _dockerfile(tmp_path, text)
    with pytest.raises(DockerfileError) as info:
        parse_dockerfile(path)
    assert info.value.lineno == line and words in str(info.value) and "Fix:" in str(info.value)
    assert f"{path}:{line}:" in str(info.value)


def test_services_are_refused(tmp_path):
    _dockerfile(tmp_path, "FROM debian:bookworm\n")
    (tmp_path / "environment" / "docker-compose.yaml").write_text("services: {db: {image: postgres}}\n")
    with pytest.raises(DockerfileError, match="services"):
        parse_dockerfile(tmp_path / "environment" / "Dockerfile")


# --- reading test.sh -------------------------------------------------------------------------------
def test_tool_spec_of_the_standard_test_sh():
    assert read_tool_spec(WORD_STATS / "tests" / "test.sh") == ToolSpec((), ("pytest-json-ctrf==0.3.5", "pytest==8.4.1"))


def test_tool_spec_variants(tmp_path):
    sh = tmp_path / "test.sh"
    sh.write_text("apt-get update && apt-get install -y curl jq=1.6 && apt install -y --no-install-recommends tree\n"
                  "uvx -p 3.13 --with numpy==2.1.0,scipy -w pytest==8.4.1 pytest /tests/test_outputs.py\n"
                  "uv pip install requests==2.32.3 # comment pandas\n"
                  "X=1 uv run --with=httpx pytest -q\nsudo apt-get install -y sqlite3\n")
    spec = read_tool_spec(sh)
    assert spec.apt == ("jq=1.6", "sqlite3", "tree")  # curl is the stand-in's
    assert spec.pip == ("httpx", "numpy==2.1.0", "pytest==8.4.1", "requests==2.32.3", "scipy")  # one pytest


def test_pip_installed_tools_are_the_system_pythons(tmp_path):
    sh = tmp_path / "test.sh"
    sh.write_text("pip install pytest==8.4.1 pytest-json-ctrf==0.3.5 --break-system-packages\n"
                  "python -m pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA\n")
    assert read_tool_spec(sh) == ToolSpec((), ("pytest-json-ctrf==0.3.5", "pytest==8.4.1"), system=True)
    assert not read_tool_spec(WORD_STATS / "tests" / "test.sh").system  # uvx: a throwaway environment


def test_with_requirements_is_read_from_tests(tmp_path):
    (tmp_path / "requirements.txt").write_text("# test deps\nnumpy==2.1.0  # pinned\n-r other.txt\nhttpx\n")
    (tmp_path / "test.sh").write_text("uvx --with-requirements /tests/requirements.txt pytest /tests\n")
    assert read_tool_spec(tmp_path / "test.sh").pip == ("httpx", "numpy==2.1.0", "pytest")
    (tmp_path / "test.sh").write_text("uvx --with-requirements /etc/reqs.txt pytest /tests\n")
    with pytest.raises(LayerError, match="only files in tests/"):
        read_tool_spec(tmp_path / "test.sh")


def test_a_gpu_task_is_refused_on_the_local_backend(tmp_path):
    shutil.copytree(FIXTURES / "good" / "hello", tmp_path / "t")
    toml = tmp_path / "t" / "task.toml"
    toml.write_text(toml.read_text() + "gpus = 1\n")
    with pytest.raises(SandboxError, match="gpus = 1 .*no GPU.*--backend docker"):
        open_sandbox(load_task(tmp_path / "t"))


# --- the stand-ins, called on the host ---------------------------------------------------------------
@pytest.fixture
def tools_dir(tmp_path, monkeypatch):
    for dist in ("pytest-8.4.1.dist-info", "pytest_json_ctrf-0.3.5.dist-info"):
        (tmp_path / dist).mkdir()
    monkeypatch.setattr(shims, "TOOLS", str(tmp_path))
    return tmp_path


def test_specs_are_matched_by_name_and_pinned_version(tools_dir):
    assert shims.missing_specs(["pytest==8.4.1", "pytest-json-ctrf==0.3.5", "Pytest_JSON.ctrf", "pytest[extra]"]) == []
    assert shims.missing_specs(["pytest==9.0.0", "numpy", "pytest==8.4.1"]) == ["pytest==9.0.0", "numpy"]


def test_uvx_refuses_what_was_not_prepared(tools_dir, capsys):
    assert shims.main(["uvx", "-p", "3.13", "-w", "numpy==2.0", "pytest", "/tests"]) == 2
    assert "numpy==2.0 not prepared" in capsys.readouterr().err
    assert shims.main(["uvx", "-w", "pytest==8.4.1", "black", "."]) == 2
    assert "not among the prepared tools" in capsys.readouterr().err
    assert shims.main(["uv", "sync"]) == 2 and shims.main(["uv", "pip", "install", "numpy"]) == 2
    assert shims.main(["uv", "pip", "install", "pytest==8.4.1"]) == 0


def test_pip_stand_in_accepts_only_prepared_specs(tools_dir, capsys):
    assert shims.main(["pip", "install", "-q", "pytest==8.4.1"]) == 0
    assert shims.main(["pip3", "install", "requests"]) == 1
    assert "requests: not prepared" in capsys.readouterr().err


def test_curl_serves_only_the_uv_installer(tmp_path, capsys, monkeypatch):
    assert shims.main(["curl", "-LsSf", "https://astral.sh/uv/0.9.5/install.sh"]) == 0
    installer = capsys.readouterr().out
    assert ".local/bin/env" in installer and shims.SHIM_BIN in installer
    assert shims.main(["curl", "-LsSf", "https://astral.sh/uv/install.sh", "-o", str(tmp_path / "i.sh")]) == 0
    assert (tmp_path / "i.sh").read_text() == installer
    monkeypatch.setattr(shims.os, "access", lambda *a: False)  # no real curl to fall back on
    assert shims.main(["curl", "-fsSL", "https://example.com/x.tar.gz"]) == 7
    assert "only the uv installer" in capsys.readouterr().err


def test_sudo_stand_in_runs_the_command(monkeypatch):
    ran = []
    monkeypatch.setattr(shims.os, "execvp", lambda f, a: ran.append(a) or 0)
    assert shims.main(["sudo", "-E", "apt-get", "update"]) == 0 and ran == [["apt-get", "update"]]
    assert shims.main(["sudo", "-u", "nobody", "id"]) == 1


def test_apt_get_stand_in(capsys, monkeypatch):
    monkeypatch.setattr(shims, "_package_installed", lambda name: name == "jq")
    assert shims.main(["apt-get", "update"]) == 0
    assert shims.main(["apt-get", "install", "-y", "curl", "jq"]) == 0
    assert shims.main(["apt-get", "install", "-y", "gcc"]) == 100
    assert "gcc" in capsys.readouterr().err
    assert shims.main(["apt-get", "dist-upgrade"]) == 100


# --- preparation, cache and episodes (network: Debian mirror and PyPI) -----------------------------------
@pytest.fixture(scope="module")
def layers(tmp_path_factory):
    """A private layer cache with word-stats prepared once; yields (task, seconds of the first
    preparation, seconds of the second)."""
    if os.geteuid() != 0:
        pytest.skip("environment layers need root (preparation and the overlay mount)")
    cache = tmp_path_factory.mktemp("layers")
    old = os.environ.get("MINIRSI_LAYERS")
    os.environ["MINIRSI_LAYERS"] = str(cache)
    task = load_task(WORD_STATS)
    t0 = time.monotonic()
    _, built = prepare(task, default_rootfs())
    t1 = time.monotonic()
    _, built_again = prepare(task, default_rootfs())
    t2 = time.monotonic()
    assert built and not built_again
    yield task, cache, t1 - t0, t2 - t1
    if old is None:
        del os.environ["MINIRSI_LAYERS"]
    else:
        os.environ["MINIRSI_LAYERS"] = old


def _variant(tmp_path: Path, name: str, dockerfile: str) -> Path:
    """A copy of word-stats with another Dockerfile."""
    d = tmp_path / name
    shutil.copytree(WORD_STATS, d)
    (d / "environment" / "Dockerfile").write_text(dockerfile)
    return d


def _prepared_variant(tmp_path: Path, name: str, tests: dict[str, str]):
    """word-stats (its environment) with other files in tests/, loaded and prepared: (task, prepared, built)."""
    d = _variant(tmp_path, name, (WORD_STATS / "environment" / "Dockerfile").read_text())
    for file, text in tests.items():
        (d / "tests" / file).write_text(text)
    task = load_task(d)
    return (task, *prepare(task, default_rootfs()))


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        for name in sorted(dirnames + filenames):
            st = os.lstat(os.path.join(dirpath, name))
            h.update(f"{dirpath}/{name}:{st.st_mode}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


@pytest.mark.slow
def test_second_preparation_does_no_work(layers):
    task, cache, first, second = layers
    assert second < 1.0 < first  # the second one only hashes environment/ and test.sh
    prepared = find_prepared(task, default_rootfs())
    assert prepared is not None and prepared.pip_layer is not None and prepared.apt_layer is None
    meta = prepared.env_layer.meta
    assert meta["workdir"] == "/app" and meta["disk_bytes"] < 100 << 20  # a diff, not a rootfs copy (~400 MB)
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == sorted(
        [prepared.env_layer.key, prepared.pip_layer.key])


@pytest.mark.slow
def test_oracle_passes_and_empty_run_fails_on_the_layer(layers):
    row = check_task(layers[0], "bwrap")
    assert row.ok, row.reasons()
    assert (row.oracle.passed, row.oracle.total) == (5, 5) and (row.empty.passed, row.empty.total) == (0, 5)
    assert row.empty.checks["test_outputs::test_word_count[a.txt-6]"] == "failed"  # parametrised cases all ran
    assert "Python 3.13 requested" in row.oracle.output_tail


@pytest.mark.slow
def test_agent_sees_the_image_but_not_the_tests_or_tools(layers):
    task = layers[0]
    with open_sandbox(task) as sb:
        r = sb.run("pwd; ls; echo $REPORT_PATH; jq --version; tree --version | cut -c1-9; python -c 'import six; print(six.__version__)';"
                   " ls -A /opt/minirsi-tools /tests 2>&1 | grep -c 'No such'; wc -c < /opt/minirsi/verifier_shims.py; id -u",
                   timeout=20)
    lines = r.output.split("\n")
    assert lines[:2] == ["/app", "count_hint.txt"] and lines[2] == "data"
    # /opt/minirsi-tools is an empty mount point for the agent; /tests is absent
    assert lines[3:9] == ["/app/report.json", "jq-1.6", "tree v2.1", "1.16.0", "1", "0"] and lines[9] == "0", r.output  # root, as in Docker


@pytest.mark.slow
def test_the_episode_root_is_writable_private_and_thrown_away(layers):
    # as in a Docker container: root writes anywhere, but only into this episode's copy; the
    # layers, the rootfs, a concurrent episode and the next one see none of it
    task, cache = layers[0], layers[1]
    before = (_tree_digest(cache), _tree_digest(default_rootfs()))
    attack = ("for f in /usr/bin/jq /usr/local/lib/python3.11/dist-packages/six.py /etc/passwd /opt/minirsi/bin/x /newdir; do"
              " (echo pwned > $f) 2>/dev/null && echo WROTE $f; done; rm -f /usr/bin/tree && echo REMOVED;"
              " echo mine > /app/data/a.txt; mv /app/data/a.txt /tmp/a.txt && cat /tmp/a.txt")
    with open_sandbox(task) as a, open_sandbox(task) as b:
        ra = a.run(attack, timeout=20)
        rb = b.run("cat /app/data/a.txt; tree --version | cut -c1-4; jq --version; ls /newdir 2>&1 | grep -c 'No such'", timeout=10)
    assert ra.output.count("WROTE") == 5 and "REMOVED" in ra.output and ra.output.endswith("mine\n"), ra.output
    assert rb.output == "the quick brown fox\njumps over\ntree\njq-1.6\n1\n", rb.output
    with open_sandbox(task) as c:
        rc = c.run("cat /app/data/a.txt; tree --version | cut -c1-4; grep -c pwned /etc/passwd", timeout=10)
    assert rc.output == "the quick brown fox\njumps over\ntree\n0\n", rc.output
    assert (_tree_digest(cache), _tree_digest(default_rootfs())) == before


@pytest.mark.slow
def test_the_episode_root_is_like_a_containers(layers):
    # localhost resolves, /dev/shm is shared memory for all, a compiled extension finds Python.h,
    # a file moves between the workdir and /tmp (one mount), the jail's root owns the image and
    # can write a file of another group (root:shadow)
    probe = ("getent hosts localhost >/dev/null && echo resolves; stat -c %a /dev/shm; ls /usr/include/python3*/Python.h | wc -l;"
             " echo x > /app/f && mv /app/f /tmp/f && echo moved; stat -c %u /usr/bin/jq; echo x >> /etc/gshadow && echo shadow")
    with open_sandbox(layers[0]) as sb:
        r = sb.run(probe, timeout=20)
    assert r.output == "resolves\n1777\n1\nmoved\n0\nshadow\n", r.output


@pytest.mark.slow
def test_memory_is_a_cgroup_of_the_whole_jail_where_the_host_has_one(layers):
    # Chromium, V8 and the JVM reserve far more address space than they use: a per-process
    # address-space limit kills them at start, Docker's cgroup limit does not
    from minirsi.env.sandbox.bwrap import _memory_cgroup_parent

    if _memory_cgroup_parent() is None:
        pytest.skip("this host gives no writable memory cgroup (the address-space limit stands)")
    reserve = "python3 -c 'import mmap; m = mmap.mmap(-1, 16 << 30, flags=mmap.MAP_PRIVATE, prot=0); print(\"reserved\")'"
    with open_sandbox(layers[0], memory_mb=256) as sb:
        cgroup = sb._cgroup.path
        limit = (cgroup / ("memory.limit_in_bytes" if sb._cgroup.version == "v1" else "memory.max")).read_text()
        r = sb.run(f"{reserve}; ulimit -v; python3 -c 'x = bytearray(512 << 20)'; echo status $?", timeout=30)
    lines = r.output.splitlines()  # (bash reports the kill in between)
    assert lines[:2] == ["reserved", "unlimited"] and lines[-1] == "status 137" and int(limit) == 256 << 20, r.output
    assert not cgroup.exists()  # removed with the sandbox


@pytest.mark.slow
def test_the_verifier_sees_the_agents_changes_anywhere_but_not_its_runtime(layers, tmp_path):
    # the agent's files outside the workdir reach the verifier (as in Harbor's one container);
    # what test.sh itself runs (bash, python and its libraries, the loader) is the image's
    task_dir = tmp_path / "outside"
    shutil.copytree(WORD_STATS, task_dir)
    (task_dir / "tests" / "test.sh").write_text(
        "#!/bin/bash\ncat /usr/local/bin/tool /etc/tool.conf /tmp/moved\npython3 -c 'print(\"py\", 6 * 7)'\n"
        "env printf 'env-ok\\n'; ls -l /bin | cut -c1; id -u\necho 1 > /logs/verifier/reward.txt\n")
    task = load_task(task_dir)  # same environment/ and tool spec: the same layers
    before = (_tree_digest(layers[1]), _tree_digest(default_rootfs()))
    tamper = ("echo tool > /usr/local/bin/tool; echo conf > /etc/tool.conf; echo moved > /app/m; mv /app/m /tmp/moved; "
              "printf '#!/bin/sh\\necho FORGED\\n' > /usr/bin/python3.11; cp /usr/bin/python3.11 /usr/local/bin/python3; "
              "chmod +x /usr/local/bin/python3; rm /usr/bin/env; echo /tmp/evil.so > /etc/ld.so.preload; "
              "rm /bin && mkdir /bin && cp /usr/bin/dash /bin/bash; echo 'import os; os._exit(0)' > /usr/lib/python3.11/site.py; echo done")
    with open_sandbox(task) as sb:
        assert sb.run(tamper, timeout=20).output.endswith("done\n")
        r = verify(sb, task)
    lines = r.output_tail.split("\n")
    assert r.success and lines[:7] == ["tool", "conf", "moved", "py 42", "env-ok", "l", "0"], r.output_tail
    assert "FORGED" not in r.output_tail and "evil" not in r.output_tail
    assert (_tree_digest(layers[1]), _tree_digest(default_rootfs())) == before


@pytest.mark.slow
def test_an_agent_that_breaks_python_cannot_forge_the_reward(layers):
    task = layers[0]  # word-stats, not solved: every check must run and fail
    forge = ("for f in /usr/lib/python3.11/dist-packages /usr/local/lib/python3.11/dist-packages /usr/lib/python3/dist-packages; do"
             " mkdir -p $f; echo 'import os; os._exit(0)' > $f/zz_forge.pth; done;"
             " printf '#!/bin/sh\\nexit 0\\n' > /usr/local/bin/pytest; chmod +x /usr/local/bin/pytest;"
             " rm -rf /opt && ln -s /etc /opt; rm -rf /usr/lib/python3; ln -s /etc /usr/lib/python3; echo done")
    # host paths the symlinks name, were they followed outside the jail by the (host root) mounter
    assert not Path("/etc/minirsi-tools").exists() and not Path("/etc/minirsi_junit.py").exists()
    before = _tree_digest(layers[1])
    with open_sandbox(task) as sb:
        assert sb.run(forge, timeout=20).output.endswith("done\n")
        r = verify(sb, task)
    assert not r.success and (r.passed, r.total) == (0, 5), r.output_tail
    assert _tree_digest(layers[1]) == before
    assert not Path("/etc/minirsi-tools").exists() and not Path("/etc/minirsi_junit.py").exists()


@pytest.mark.slow
def test_verifier_is_root_in_its_jail_but_cannot_write_layers(layers, tmp_path):
    task_dir = tmp_path / "probe"
    shutil.copytree(WORD_STATS, task_dir)
    (task_dir / "tests" / "test.sh").write_text(
        "#!/bin/bash\nid -u\nfor f in /usr/bin/jq /opt/minirsi-tools/x /etc/hostname; do (echo x > $f) 2>/dev/null && echo WROTE $f; done\n"
        "ls /sys/class/net 2>/dev/null | grep -v lo; getent hosts pypi.org || echo no-dns\necho 1 > /logs/verifier/reward.txt\n")
    before = _tree_digest(layers[1])
    task = load_task(task_dir)  # same environment/ and tool spec: the same layers
    with open_sandbox(task) as sb:
        r = verify(sb, task)
    assert r.success and r.output_tail.split("\n")[0] == "0"
    assert "WROTE /usr/bin/jq" in r.output_tail  # the episode's copy of the image is writable
    assert "no-dns" in r.output_tail
    assert _tree_digest(layers[1]) == before


@pytest.mark.slow
def test_verifier_root_is_writable_throwaway_and_chroot_works(layers, tmp_path):
    # tests/fixtures/verifier-root/test.sh writes /server and /jail/x and chroots into /jail, as
    # root; it fails if a previous episode's /server or /jail is still there
    task_dir = tmp_path / "writable-root"
    shutil.copytree(WORD_STATS, task_dir)
    shutil.copy(FIXTURES.parent / "verifier-root" / "test.sh", task_dir / "tests" / "test.sh")
    task = load_task(task_dir)
    host = [p for p in (Path("/server"), Path("/jail")) if not p.exists()]
    digests = (_tree_digest(layers[1]), _tree_digest(default_rootfs()))
    for _ in range(2):  # the second episode starts clean
        with open_sandbox(task) as sb:
            r = verify(sb, task)
        assert r.success and "chroot-ok" in r.output_tail, r.output_tail
    with open_sandbox(task) as sb:  # a new episode: nothing of the verifier's is left
        seen = sb.run("ls -d /server /jail 2>&1 | grep -c 'No such'", timeout=10)
    assert seen.output == "2\n", seen.output
    assert (_tree_digest(layers[1]), _tree_digest(default_rootfs())) == digests
    assert not any(p.exists() for p in host)


@pytest.mark.slow
def test_prepare_cli_names_the_failing_line_and_package(tmp_path, capsys, layers):
    bad = _variant(tmp_path, "bad-apt", "FROM debian:bookworm\nWORKDIR /app\n"
                   "RUN apt-get update -qq && apt-get install -y -qq no-such-package-xyz\n")
    multi = _variant(tmp_path, "multi", "FROM python:3.12 AS b\nRUN true\nFROM debian:bookworm\n")
    assert cli(["prepare", "-q", str(bad), str(multi)]) == 1
    out = capsys.readouterr().out
    assert "Dockerfile:3: RUN apt-get update" in out and "'no-such-package-xyz' not found" in out
    assert "exited with status 100" in out
    assert "Dockerfile:3: 'FROM debian:bookworm': a second FROM (multi-stage build)" in out
    assert "0 ready" in out and "2 failed" in out
    assert not any(p.name.startswith(layers[0].task_id) or ".partial" in p.name for p in layers[1].iterdir())
    with pytest.raises(LayerError):  # the API raises what the CLI prints
        prepare(load_task(bad), default_rootfs())


@pytest.mark.slow
def test_a_run_line_cannot_mount_or_reach_the_host(tmp_path, layers):
    d = _variant(tmp_path, "escape", "FROM debian:bookworm\nWORKDIR /app\n"
                 "RUN mount -t tmpfs x /mnt && echo MOUNTED; mknod /tmp/d b 8 0 && echo MKNOD; "
                 "ls /work /root/.cache 2>&1 | head -3; echo done > /app/probe.txt\n")
    prepare(load_task(d), default_rootfs())
    layer = find_prepared(load_task(d), default_rootfs()).env_layer
    log = (layer.path / "build.log").read_text()
    assert "\nMOUNTED\n" not in log and "\nMKNOD\n" not in log and "permission denied" in log
    assert "Operation not permitted" in log and "No such file" in log
    assert (layer.upper / "app/probe.txt").read_text() == "done\n"


@pytest.mark.slow
def test_check_json_and_unprepared_task(layers, tmp_path, capsys, monkeypatch):
    assert cli(["check", "--json", str(WORD_STATS)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"] == {"passed": 1, "failed": 0, "invalid": 0, "empty_run_all_checks_failing": 1,
                                 "with_oracle": 1, "oracle_passes": 1}
    assert report["tasks"][0]["oracle"]["failing"] == [] and len(report["tasks"][0]["empty"]["failing"]) == 5
    assert cli(["layers"]) == 0
    listing = capsys.readouterr().out
    assert find_prepared(layers[0], default_rootfs()).env_layer.key in listing and " layer(s) in " in listing
    monkeypatch.setenv("MINIRSI_LAYERS", str(tmp_path / "empty-cache"))
    assert cli(["check", "--no-prepare", str(WORD_STATS)]) == 1
    assert f"Fix: minirsi task prepare {WORD_STATS}" in capsys.readouterr().out
    with pytest.raises(SandboxError, match="not prepared"):
        open_sandbox(load_task(WORD_STATS))


@pytest.mark.slow
def test_check_reports_a_bad_line_once_as_invalid_and_a_failed_run_as_fail(tmp_path, capsys, layers):
    twofrom = _variant(tmp_path, "twofrom", "FROM debian:bookworm AS a\nFROM debian:bookworm\n")
    failing = _variant(tmp_path, "failing-run", "FROM debian:bookworm\nWORKDIR /app\nRUN echo broken; exit 7\n")
    assert cli(["check", str(twofrom), str(failing), str(WORD_STATS)]) == 1
    out = capsys.readouterr().out
    assert out.count("twofrom") == 1 and "INVALID" in out and "Dockerfile:2:" in out
    assert "failing-run" in out and "Dockerfile:3: RUN echo broken; exit 7: exited with status 7" in out
    assert "broken" in out  # the RUN's last lines
    assert "1 passed, 1 failed, 1 invalid (of 3 tasks)" in out


@pytest.mark.slow
def test_a_pip_style_test_sh_runs_the_prepared_pytest(tmp_path, layers):
    # same environment layer; pytest==8.4.1 alone is a new tools layer
    task, _, _ = _prepared_variant(tmp_path, "pip-style", {"test.sh": (
        "#!/bin/bash\nset -e\npip install pytest==8.4.1\ncd /app\nset +e\npytest /tests/test_outputs.py -rA\n"
        "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")})
    row = check_task(task, "bwrap")
    assert row.ok, row.reasons()
    assert "pytest-8.4.1" in row.oracle.output_tail and (row.empty.passed, row.empty.total) == (0, 5)


@pytest.mark.slow
def test_python_m_pytest_after_pip_install_runs_the_prepared_tools(tmp_path, layers):
    # Docker: `pip install` puts pytest and its plugin in the image's Python, so `python -m pytest
    # --ctrf` works; here the same two specs as the standard test.sh (no new tools layer)
    task, prepared, _ = _prepared_variant(tmp_path, "python-m", {"test.sh": (
        "#!/bin/bash\npip install pytest==8.4.1 pytest-json-ctrf==0.3.5 --break-system-packages\ncd /app\n"
        "python -m pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA\n"
        "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n")})
    # the tools layer is word-stats' (the standard pair); the package index is new (test.sh's pip line)
    assert prepared.pip_layer == find_prepared(layers[0], default_rootfs()).pip_layer and prepared.system_tools
    assert [w["name"] for w in prepared.index_layer.meta["wheels"]][-2:] == ["pytest", "pytest-json-ctrf"]
    row = check_task(task, "bwrap")
    assert row.ok, row.reasons()
    assert "pytest-8.4.1" in row.oracle.output_tail and row.empty_all_failing


@pytest.mark.slow
def test_tests_can_build_into_tests_but_not_into_the_task(tmp_path, layers):
    # Harbor's /tests is a writable copy (a test may `setup.py build_ext --inplace` there)
    task, _, _ = _prepared_variant(tmp_path, "writable-tests", {"test_outputs.py": (
        "from pathlib import Path\n\n\ndef test_build_into_tests():\n"
        "    Path('/tests/build/out.txt').parent.mkdir()\n    Path('/tests/build/out.txt').write_text('x')\n")})
    with open_sandbox(task) as sb:
        r = verify(sb, task)
    assert r.success and (r.passed, r.total) == (1, 1), r.output_tail
    assert not (task.tests_dir / "build").exists()  # the task's own tests/ is untouched


@pytest.mark.slow
def test_test_sh_apt_packages_come_with_their_recommends(tmp_path, layers):
    # Docker's `apt-get install -y gcc` brings libc6-dev (a Recommends); here wget's ca-certificates
    sh = (WORD_STATS / "tests" / "test.sh").read_text().replace("apt-get install -y curl", "apt-get install -y curl wget")
    task, prepared, built = _prepared_variant(tmp_path, "recommends", {"test.sh": sh, "test_outputs.py": (
        "import subprocess\n\n\ndef test_recommended_package_is_there():\n"
        "    assert subprocess.run(['dpkg', '-s', 'ca-certificates'], capture_output=True).returncode == 0\n")})
    assert built and prepared.apt_layer is not None
    with open_sandbox(task) as sb:
        r = verify(sb, task)
    assert r.success and (r.passed, r.total) == (1, 1), r.output_tail


@pytest.mark.slow
def test_a_workdir_missing_from_the_layer_is_created(tmp_path, layers):
    d = _variant(tmp_path, "nowd", "FROM debian:bookworm\nWORKDIR /app\n")
    toml = d / "task.toml"
    toml.write_text(toml.read_text() + 'workdir = "/usr/share/proj"\n')
    task = load_task(d)
    prepare(task, default_rootfs())
    with open_sandbox(task) as sb:  # as Docker creates a WORKDIR
        r = sb.run("pwd; touch x && ls", timeout=10)
    assert r.output == "/usr/share/proj\nx\n", r.output


@pytest.mark.slow
def test_copy_and_add_land_where_docker_puts_them(tmp_path, layers):
    d = _variant(tmp_path, "copies", "FROM debian:bookworm\nWORKDIR /app\nCOPY data/*.txt /glob/\nCOPY . /ctx\n"
                 "COPY count_hint.txt /renamed.txt\nCOPY [\"data\", \"/json form/\"]\nADD pack.tar /unpacked/\n"
                 "COPY --chown=1234:1234 data/a.txt rel/\n")
    with tarfile.open(d / "environment" / "pack.tar", "w") as tar:
        tar.add(d / "environment" / "count_hint.txt", arcname="inner/hint.txt")
    task = load_task(d)
    prepare(task, default_rootfs())
    up = find_prepared(task, default_rootfs()).env_layer.upper
    assert sorted(p.name for p in (up / "glob").iterdir()) == ["a.txt", "b.txt", "c.txt"]
    assert (up / "ctx/data/a.txt").is_file() and (up / "ctx/Dockerfile").is_file()  # the whole context, as docker
    assert (up / "renamed.txt").read_text().startswith("Tip:")
    assert (up / "json form/c.txt").is_file() and (up / "unpacked/inner/hint.txt").is_file()
    assert (up / "app/rel/a.txt").stat().st_uid == 1234  # relative to WORKDIR, chowned


@pytest.mark.slow
def test_test_sh_apt_packages_are_for_the_verifier_only(tmp_path, layers):
    d = _variant(tmp_path, "apt-tools", (WORD_STATS / "environment" / "Dockerfile").read_text())
    sh = d / "tests" / "test.sh"
    sh.write_text(sh.read_text().replace("apt-get install -y curl", "apt-get install -y curl sqlite3"))
    (d / "tests" / "test_outputs.py").write_text(
        "import subprocess\n\n\ndef test_sqlite3_is_there():\n"
        "    assert subprocess.run(['sqlite3', '--version'], capture_output=True).returncode == 0\n")
    task = load_task(d)
    prepared, built = prepare(task, default_rootfs())  # the environment layer is reused: only sqlite3 is new
    assert built and prepared.apt_layer is not None and prepared.env_layer.key == find_prepared(
        layers[0], default_rootfs()).env_layer.key
    with open_sandbox(task) as sb:
        assert sb.run("command -v sqlite3 || echo absent", timeout=10).output == "absent\n"  # not the agent's
        r = verify(sb, task)
    assert r.success and (r.passed, r.total) == (1, 1), r.output_tail


@pytest.mark.slow
def test_the_images_pythonpath_reaches_the_verifier(tmp_path, layers):
    # ENV PYTHONPATH=/opt/lib:$PYTHONPATH in the Dockerfile: Docker's test.sh sees it (the verifier
    # keeps its own plugin entry first)
    d = _variant(tmp_path, "pythonpath", "FROM debian:bookworm\nWORKDIR /app\nENV PYTHONPATH=/opt/lib:$PYTHONPATH\n")
    (d / "tests" / "test_outputs.py").write_text(
        "import os\n\n\ndef test_image_pythonpath():\n"
        "    parts = os.environ['PYTHONPATH'].split(':')\n"
        "    assert '/opt/lib' in parts and parts.index('/opt/minirsi') < parts.index('/opt/lib')\n")
    task = load_task(d)
    prepare(task, default_rootfs())
    with open_sandbox(task) as sb:
        assert sb.run("echo $PYTHONPATH", timeout=10).output == "/opt/lib:\n"  # the agent's, as in the image
        r = verify(sb, task)
    assert r.success and (r.passed, r.total) == (1, 1), r.output_tail


@pytest.mark.slow
def test_a_trixie_image_runs_on_the_debian_13_base(tmp_path, monkeypatch):
    """FROM debian:trixie: the layer sits on the Debian 13 rootfs (built here the first time on a
    machine); its RUN checks the release, and the oracle and the verifier see Debian 13 and
    Python 3.13 (the pip tools layer is installed for that Python)."""
    if os.geteuid() != 0:
        pytest.skip("environment layers need root (preparation and the overlay mount)")
    monkeypatch.setenv("MINIRSI_LAYERS", str(tmp_path / "layers"))
    task = load_task(TRIXIE)
    prepared, built = prepare(task, default_rootfs())
    base = base_rootfs("trixie", default_rootfs())
    assert built and prepared.base == base != default_rootfs() and not prepared.notes
    assert 'VERSION_ID="13"' in (base / "etc/os-release").read_text()
    assert prepared.env_layer.meta["base_rootfs"] == str(base) and prepared.pip_layer.meta["base_rootfs"] == str(base)
    assert find_prepared(task, default_rootfs()) == prepared
    with open_sandbox(task) as sb:
        assert sb.prepared.base == base
        r = sb.run(". /etc/os-release; echo $VERSION_CODENAME; pwd; ls", timeout=20)
    assert r.output.split("\n")[:3] == ["trixie", "/app", "format.txt"]
    row = check_task(task, "bwrap")
    assert row.ok, row.reasons()
    assert (row.oracle.passed, row.oracle.total) == (2, 2) and (row.empty.passed, row.empty.total) == (0, 2)
    assert row.empty_all_failing and not row.notes


# --- the package index (minirsi/env/wheelhouse.py), from a local index of wheels built here ------------------
def _wheel(project_dir: Path, name: str, version: str, code: str, requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel (a zip with METADATA, WHEEL and RECORD), written into `project_dir`:
    a PEP 503 project page once served as a directory listing."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {f"{dist}/__init__.py": code.encode(),
             f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                  + "".join(f"Requires-Dist: {r}\n" for r in requires)).encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: minirsi-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    digest = {p: base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode() for p, data in files.items()}
    files[f"{info}/RECORD"] = ("".join(f"{p},sha256={digest[p]},{len(data)}\n" for p, data in files.items())
                               + f"{info}/RECORD,,\n").encode()
    project_dir.mkdir(parents=True, exist_ok=True)
    path = project_dir / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, data in files.items():
            z.writestr(p, data)
    return path


@pytest.fixture
def probe_index(tmp_path, monkeypatch):
    """A local package index (http.server over a directory) holding minirsi-probe 1.0, which
    requires minirsi-probe-dep; PIP_INDEX_URL points the preparation at it. Yields the list of
    request paths it serves."""
    root = tmp_path / "pypi"
    _wheel(root / "simple" / "minirsi-probe", "minirsi-probe", "1.0", "VALUE = 42\n", ("minirsi-probe-dep",))
    _wheel(root / "simple" / "minirsi-probe-dep", "minirsi-probe-dep", "1.0", "WORD = 'dep'\n")
    served: list[str] = []

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, format, *args):
            served.append(self.path)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple/")
    yield served
    server.shutdown()


PROBE_TESTS = ("def test_the_probe_is_installed():\n    import minirsi_probe\n    assert minirsi_probe.VALUE == 42\n\n\n"
               "def test_its_dependency_came_with_it():\n    from minirsi_probe_dep import WORD\n    assert WORD == 'dep'\n")


def _index_task(tmp_path: Path, name: str, solve: str):
    """word-stats' environment (its layer is the module's) with this solve.sh and tests that import the probe."""
    d = _variant(tmp_path, name, (WORD_STATS / "environment" / "Dockerfile").read_text())
    (d / "solution" / "solve.sh").write_text(f"#!/bin/bash\nset -e\n{solve}")
    (d / "tests" / "test_outputs.py").write_text(PROBE_TESTS)
    return load_task(d)


@pytest.mark.slow
def test_a_package_only_the_prepared_index_holds_installs_offline(tmp_path, layers, probe_index, capsys):
    task = _index_task(tmp_path, "probe", "pip install minirsi-probe==1.0\n")
    prepared, built = prepare(task, default_rootfs())
    meta = prepared.index_layer.meta
    assert built and [(w["name"], w["version"]) for w in meta["wheels"]] == [("minirsi-probe", "1.0"),
                                                                           ("minirsi-probe-dep", "1.0")]
    assert not meta["missing"] and sorted(p for p in probe_index if p.endswith(".whl")) == [
        "/simple/minirsi-probe-dep/minirsi_probe_dep-1.0-py3-none-any.whl",
        "/simple/minirsi-probe/minirsi_probe-1.0-py3-none-any.whl"]
    probe_index.clear()
    # the oracle installs it offline and the verifier imports it; the empty run fails both checks
    assert cli(["check", "-v", "--json", str(task.path)]) == 0
    row = json.loads(capsys.readouterr().out)["tasks"][0]
    assert (row["oracle"]["passed"], row["oracle"]["total"], row["empty"]["passed"]) == (2, 2, 0)
    assert "Processing /opt/minirsi-index/minirsi_probe-1.0-py3-none-any.whl" in row["oracle_command"]["output"]
    assert any(n.startswith("package index: 2 wheel(s)") and "minirsi-probe 1.0" in n for n in row["notes"])
    assert probe_index == []  # nothing was fetched while the task ran
    # preparing again runs nothing; another task's index with the same package downloads no wheel
    assert prepare(task, default_rootfs())[1] is False and probe_index == []
    other = _index_task(tmp_path, "probe-unpinned", "pip install minirsi-probe\n")
    other_prepared, built = prepare(other, default_rootfs())
    assert built and other_prepared.index_layer.key != prepared.index_layer.key
    assert "/simple/minirsi-probe/" in probe_index and not any(p.endswith(".whl") for p in probe_index)
    assert "File was already downloaded" in (other_prepared.index_layer.path / "build.log").read_text()


@pytest.mark.slow
def test_uv_pip_installs_from_the_index_too(tmp_path, layers, probe_index):
    # an image with uv (pip install uv): `uv pip install` finds the index without flags
    task = _index_task(tmp_path, "probe-uv", "uv pip install --system minirsi-probe==1.0\n")
    (task.environment_dir / "Dockerfile").write_text("FROM python:3.13-slim-bookworm\nWORKDIR /app\n"
                                                     "RUN pip install uv==0.9.5\n")
    task = load_task(task.path)
    prepare(task, default_rootfs())
    row = check_task(task, "bwrap")
    assert row.ok and (row.oracle.passed, row.oracle.total) == (2, 2), row.reasons()
    with open_sandbox(task) as sb:
        r = sb.run("uv pip install --system requests 2>&1", timeout=60)
    assert "network was disabled" in r.output and r.exit_code != 0, r.output  # uv's own error, at once


@pytest.mark.slow
def test_an_unlisted_package_gets_pips_own_error_and_the_index_is_read_only(tmp_path, layers, probe_index):
    task = _index_task(tmp_path, "probe-ro", "pip install minirsi-probe==1.0\n")
    index = prepare(task, default_rootfs())[0].index_layer
    before = _tree_digest(index.path)
    attack = ("touch /opt/minirsi-index/x; rm /opt/minirsi-index/minirsi_probe-1.0-py3-none-any.whl;"
              " mount -o remount,rw /opt/minirsi-index; ls /opt/minirsi-index")
    with open_sandbox(task) as sb:
        r = sb.run(f"pip install requests 2>&1 | tail -2; {attack} 2>&1", timeout=120)
        (task.tests_dir / "test.sh").write_text(f"#!/bin/bash\n{attack} 2>&1\necho 1 > /logs/verifier/reward.txt\n")
        v = verify(sb, task)
    assert "ERROR: No matching distribution found for requests" in r.output, r.output  # pip's own, at once
    for out in (r.output, v.output_tail):
        assert out.count("Read-only file system") == 2 and "minirsi_probe-1.0-py3-none-any.whl" in out, out
        assert "\nx\n" not in out  # nothing was written, nothing removed, no remount
    assert _tree_digest(index.path) == before


@pytest.mark.slow
def test_the_verifier_sees_the_indexs_copy_not_the_agents_changes_to_it(tmp_path, layers, probe_index):
    # the agent installs the probe, then rewrites it and plants a .pth that would end every
    # Python at start with status 0: the verifier imports the index's clean copy, runs no .pth
    task = _index_task(tmp_path, "probe-forge", "pip install minirsi-probe==1.0\n")
    prepare(task, default_rootfs())
    site = "/usr/local/lib/python3.11/dist-packages"
    tamper = (f"pip install -q minirsi-probe==1.0 && echo 'VALUE = 0' > {site}/minirsi_probe/__init__.py &&"
              f" echo 'import os; os._exit(0)' > {site}/zz_forge.pth && mkdir {site}/forged-1.0.dist-info && echo done")
    with open_sandbox(task) as sb:
        assert sb.run(tamper, timeout=120).output.endswith("done\n")
        assert sb.run("python3 -c 'import minirsi_probe; print(minirsi_probe.VALUE)'; echo $?", timeout=30).output == "0\n"
        r = verify(sb, task)
    assert r.success and (r.passed, r.total) == (2, 2), r.output_tail


@pytest.mark.slow
def test_a_missing_package_prepares_with_a_warning_naming_it(tmp_path, layers, probe_index, capsys):
    task = _index_task(tmp_path, "probe-missing", "pip install minirsi-probe==1.0 minirsi-absent==2.0\n")
    assert cli(["prepare", str(task.path)]) == 0
    out = capsys.readouterr().out
    assert ("warning: probe-missing: not in its package index (pip in the jail will say 'No matching distribution'):"
            " minirsi-absent==2.0 (ERROR:") in out and "No matching distribution found for minirsi-absent==2.0" in out
    index = find_prepared(task, default_rootfs()).index_layer
    assert [w["name"] for w in index.meta["wheels"]] == ["minirsi-probe", "minirsi-probe-dep"]  # the rest went in
    assert cli(["layers"]) == 0 and f"index       {index.key}" in capsys.readouterr().out
    assert cli(["prepare", str(task.path)]) == 0 and "minirsi-absent==2.0" in capsys.readouterr().out  # said again


@pytest.mark.slow
def test_an_unreachable_index_fails_the_preparation_and_caches_nothing(tmp_path, layers, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")  # nothing listens on the discard port
    task = _index_task(tmp_path, "probe-offline", "pip install minirsi-unreachable==1.0\n")  # no index has it yet
    with pytest.raises(LayerError, match=r"could not reach the package index(.|\n)*Fix: check the network"):
        prepare(task, default_rootfs())
    assert find_prepared(task, default_rootfs()) is None
    assert not any(".partial" in p.name for p in layers[1].iterdir())

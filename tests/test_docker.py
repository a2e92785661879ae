"""The Docker backend, against a real engine (scripts/dockerd.sh start; DOCKER_HOST).

Skipped when DOCKER_HOST is unset or does not answer, except in CI (CI=true), where an
unreachable engine is a failure: .ci/run starts one, so a skip there would hide a broken backend.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from minirsi.env.sandbox import SandboxError, open_sandbox
from minirsi.env.task_cli import run_empty, run_oracle
from minirsi.env.tasks import load_task
from minirsi.env.verifier import verify

FIXTURES = Path(__file__).parent / "fixtures" / "tasks"
HELLO = load_task(FIXTURES / "good" / "hello")

pytestmark = pytest.mark.docker


def _engine_problem() -> str | None:
    if not os.environ.get("DOCKER_HOST"):
        return "DOCKER_HOST is unset (bash scripts/dockerd.sh start; eval \"$(bash scripts/dockerd.sh env)\")"
    try:
        from minirsi.env.sandbox.docker import BASE_IMAGE, client_from_env

        client = client_from_env()
        client.images.get(BASE_IMAGE)
    except Exception as e:  # SandboxError, ImageNotFound, SDK errors: all mean "no usable engine"
        return f"the Docker engine at {os.environ['DOCKER_HOST']} is not usable: {e}"
    return None


@pytest.fixture(scope="module", autouse=True)
def engine():
    problem = _engine_problem()
    if problem:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {problem}")
        pytest.skip(problem)


@pytest.fixture(scope="module")
def sb(engine):
    with open_sandbox(HELLO, backend="docker") as s:
        yield s


def test_persistent_shell(sb):
    sb.run("cd /tmp && export V=docker", timeout=10)
    r = sb.run('pwd; echo "$V"; id -u; cat /app/input.txt', timeout=10)
    assert r.output == "/tmp\ndocker\n1000\nan input file\n" and r.exit_code == 0


def test_timeout_keeps_session_and_exit_respawns(sb):
    sb.run("cd /tmp; export K=1", timeout=10)
    r = sb.run("sleep 100", timeout=1)
    assert r.timed_out and r.exit_code is None
    assert sb.run("echo $K; pwd; pgrep -c -U 1000 sleep || true", timeout=10).output == "1\n/tmp\n0\n"
    r = sb.run("exit 4", timeout=10)
    assert r.exit_code == 4 and sb.run("pwd", timeout=10).output == "/tmp\n"


def test_output_cap_and_non_utf8(sb):
    r = sb.run("seq 1 100000", timeout=20)
    assert r.truncated and r.output.endswith("100000\n")
    assert sb.run("printf 'a\\377b'", timeout=10).output == "a\ufffdb"


def test_no_network_and_readonly_system(sb):
    r = sb.run("python3 -c \"import socket; s=socket.socket(); s.settimeout(2); s.connect(('1.1.1.1', 53))\" 2>&1 | tail -1;"
               " ls /sys/class/net; touch /etc/x 2>&1 | tail -1", timeout=20)
    assert "OSError" in r.output and "eth0" not in r.output and "Permission denied" in r.output


def test_oracle_and_empty_run():
    oracle, empty = run_oracle(HELLO, "docker"), run_empty(HELLO, "docker")
    assert (oracle.success, oracle.passed, oracle.total) == (True, 2, 2)
    assert (empty.success, empty.passed, empty.total) == (False, 0, 2)


def test_agent_reward_file_and_planted_processes_do_not_count():
    with open_sandbox(HELLO, backend="docker") as s:
        s.run("mkdir -p /logs/verifier 2>/dev/null; echo 1 > /app/reward.txt; nohup sleep 1000 >/dev/null 2>&1 &", timeout=10)
        r = verify(s, HELLO)
    assert (r.success, r.passed, r.total) == (False, 0, 2)


@pytest.mark.slow
def test_dockerfile_is_built_and_used():
    task = load_task(FIXTURES / "docker_only" / "with_dockerfile")
    t0 = time.monotonic()
    result = run_oracle(task, "docker")
    assert result.success and (result.passed, result.total) == (2, 2), result.output_tail
    assert time.monotonic() - t0 < 180


def test_task_env_reaches_the_shell_and_the_setup(tmp_path):
    import shutil

    shutil.copytree(FIXTURES / "good" / "with_setup", tmp_path / "t")
    toml = tmp_path / "t" / "task.toml"
    toml.write_text(toml.read_text() + '\n[environment.env]\nTOY_CLOCK = "2026-01-01"\n')
    setup = next((tmp_path / "t" / "environment").glob("*.sh"))
    setup.write_text(setup.read_text() + '\necho "$TOY_CLOCK" > clock.txt\n')
    with open_sandbox(load_task(tmp_path / "t"), backend="docker") as s:
        assert s.run('echo "$TOY_CLOCK"; cat clock.txt', timeout=10).output == "2026-01-01\n2026-01-01\n"


def test_fork_bomb_contained():
    with open_sandbox(HELLO, backend="docker", pids=64) as s:
        s.run(":(){ :|:& };:", timeout=3)
        # The shell answers. Known imperfection (Docker backend only): the kill rounds after the
        # timeout can miss forks that were mid-spawn, and those still print "fork: retry" into
        # the next command's output until the verifier's kill (or container restart) ends them.
        assert "alive" in s.run("echo alive", timeout=10).output.splitlines()
        r = verify(s, HELLO)
    assert r.success is False and len(r.checks) == 3


def test_unreachable_engine_is_a_sandbox_error(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(SandboxError, match="dockerd.sh"):
        open_sandbox(HELLO, backend="docker")


def _tb2_copy(tmp_path, dockerfile: str | None = None, image: str | None = None) -> Path:
    import shutil

    d = tmp_path / f"t{time.monotonic_ns()}"
    shutil.copytree(FIXTURES / "tb2" / "word-stats", d)
    if dockerfile is not None:
        (d / "environment" / "Dockerfile").write_text(dockerfile)
    if image is not None:
        toml = d / "task.toml"
        toml.write_text(toml.read_text().replace('docker_image = "minirsi/word-stats:fixture"', f'docker_image = "{image}"'))
    return d


def test_docker_image_is_used_when_the_engine_has_it(tmp_path):
    from minirsi.env.sandbox.docker import BASE_IMAGE, client_from_env

    client = client_from_env()
    name = f"minirsi-test/loaded:{os.getpid()}"  # stands for an image the user `docker load`ed
    client.images.get(BASE_IMAGE).tag(name)
    try:
        task = load_task(_tb2_copy(tmp_path, dockerfile="FROM python:3.13-slim-bookworm\nRUN exit 3\n", image=name))
        with open_sandbox(task, backend="docker") as s:  # the Dockerfile (which would fail) is not built
            assert s.image == name and s.run("echo ok", timeout=10).output == "ok\n"
    finally:
        client.images.remove(name)


def test_missing_from_falls_back_to_the_base_image_with_a_warning(tmp_path, caplog):
    task = load_task(_tb2_copy(tmp_path, dockerfile="FROM debian:bookworm-slim\nWORKDIR /app\nCOPY count_hint.txt /app/\n"))
    with caplog.at_level("WARNING"), open_sandbox(task, backend="docker") as s:
        assert s.run("cat /app/count_hint.txt | cut -c1-4", timeout=10).output == "Tip:\n"
    assert "FROM debian:bookworm-slim is not in the Docker engine" in caplog.text and "minirsi-base:bookworm" in caplog.text


@pytest.mark.slow
def test_build_that_needs_the_network_fails_in_one_line(tmp_path):
    task = load_task(_tb2_copy(tmp_path))  # RUN apt-get install: needs the Debian mirror
    with pytest.raises(SandboxError) as info:
        open_sandbox(task, backend="docker")
    msg = str(info.value)
    assert "\n" not in msg and "needs a registry or package mirror" in msg and "RUN apt-get" in msg
    assert "docker load" in msg and f"minirsi task prepare {task.path}" in msg

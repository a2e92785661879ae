"""Hostile agents: every attack is contained, scores 0, leaves the host unchanged, and the next
episode starts clean. Each test plays a whole episode on the `hello` fixture (solved by writing
`hello` into /app/greeting.txt) with the attack, then runs the verifier; twice: on the base
rootfs (the agent is uid 1000 on a read-only root), and on a prepared environment layer (hello
with a Dockerfile that COPYs input.txt; the agent is root on the episode's own writable copy of
the image, as in Docker), where the layer directory must come out unchanged too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from minirsi.env.layers import cache_dir
from minirsi.env.prepare import prepare
from minirsi.env.sandbox import open_sandbox
from minirsi.env.sandbox.bwrap import default_rootfs
from minirsi.env.tasks import load_task
from minirsi.env.verifier import verify

FIXTURES = Path(__file__).parent / "fixtures" / "tasks"
HELLO = load_task(FIXTURES / "good" / "hello")  # the `base` fixture swaps in the layered copy


def _layered_hello(root: Path):
    """hello with environment/Dockerfile, prepared into a private layer cache (no network)."""
    d = root / "hello"
    shutil.copytree(FIXTURES / "good" / "hello", d)
    (d / "environment" / "Dockerfile").write_text("FROM debian:bookworm\nWORKDIR /app\nCOPY input.txt /app/\n")
    os.environ["MINIRSI_LAYERS"] = str(root / "layers")
    task = load_task(d)
    prepare(task, default_rootfs())
    with open_sandbox(task) as sb:
        assert sb.prepared is not None  # the episodes below really run on the layer
    return task


def _layers_state() -> list[tuple[str, int, int]]:
    root = cache_dir()
    return sorted((os.path.join(d, n), os.lstat(os.path.join(d, n)).st_size, os.lstat(os.path.join(d, n)).st_mtime_ns)
                  for d, dirs, files in os.walk(root) for n in dirs + files) if root.is_dir() else []


def _host_state(base: Path) -> dict[str, object]:
    rootfs = default_rootfs()
    etc = sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in (rootfs / "etc").iterdir() if not p.is_symlink())
    return {
        "rootfs_top": sorted(os.listdir(rootfs)),
        "rootfs_etc": etc,
        "rootfs_usr_bin": len(os.listdir(rootfs / "usr/bin")),
        "host_hostname": Path("/etc/hostname").read_text() if Path("/etc/hostname").exists() else None,
        "host_net": sorted(os.listdir("/sys/class/net")),
        "sandbox_dirs": sorted(p.name for p in base.iterdir() if not p.name.startswith(".")),
        "layers": _layers_state(),
    }


@pytest.fixture(scope="module", params=["rootfs", "layer"])
def base(request):
    """A private sandbox base directory, so that other users of the machine do not disturb the
    before/after comparison; world-traversable, as the sandbox's unprivileged uid needs."""
    global HELLO
    d = Path(tempfile.mkdtemp(prefix="minirsi-hostile-", dir="/tmp"))
    os.chmod(d, 0o755)
    saved = {k: os.environ.get(k) for k in ("MINIRSI_SANDBOX_TMP", "MINIRSI_LAYERS")}
    os.environ["MINIRSI_SANDBOX_TMP"] = str(d)
    plain = HELLO = load_task(FIXTURES / "good" / "hello")
    os.environ["MINIRSI_LAYERS"] = str(d / ".layers")  # private: another process's `task prepare` may be writing the shared cache
    if request.param == "layer":
        if os.geteuid() != 0:
            pytest.skip("environment layers need root (preparation and the overlay mount)")
        HELLO = _layered_hello(Path(tempfile.mkdtemp(prefix="minirsi-hostile-layer-")))
    before = _host_state(d)
    yield d
    after = _host_state(d)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if HELLO is not plain:
        shutil.rmtree(HELLO.path.parent, ignore_errors=True)
        HELLO = plain
    assert after == before, "a hostile episode changed the host"
    shutil.rmtree(d, ignore_errors=True)


def episode(commands: list[tuple[str, float]], **limits):
    """Run the commands as the agent, then the verifier; return (results, verifier result)."""
    with open_sandbox(HELLO, **limits) as sb:
        results = [sb.run(cmd, timeout=t) for cmd, t in commands]
        return results, verify(sb, HELLO)


def assert_scores_zero(vr):
    assert vr.success is False and vr.passed == 0 and vr.total == 2


def assert_next_episode_clean():
    with open_sandbox(HELLO) as sb:
        r = sb.run("ls -A /app; ls -A /tmp; ps -e --no-headers | wc -l", timeout=10)
    # input.txt only; empty /tmp; bwrap's init, the shell, ps (and wc) are the only processes
    lines = r.output.split("\n")
    assert lines[0] == "input.txt" and lines[1].strip().isdigit() and int(lines[1]) <= 4, r.output


def test_no_network(base):
    probe = ("python3 -c \"import socket\n"
             "for addr in [('1.1.1.1', 53), ('127.0.0.1', 22), ('10.0.0.1', 80)]:\n"
             "    s = socket.socket(); s.settimeout(2)\n"
             "    try:\n        s.connect(addr); print('CONNECTED', addr)\n"
             "    except OSError as e:\n        print('blocked', e.errno)\"; "
             "getent hosts pypi.org || echo 'no dns'; ls /sys/class/net 2>/dev/null || cat /proc/net/dev")
    (r,), vr = episode([(probe, 20)])
    assert "CONNECTED" not in r.output and "no dns" in r.output
    assert r.output.count("blocked") == 3
    assert "eth0" not in r.output
    assert_scores_zero(vr)


def test_no_docker_or_host_paths(base):
    probe = ("for p in /tmp/minirsi-docker/docker.sock /run/docker.sock /var/run/docker.sock /work/main "
             f"/root/.cache {base}; do [ -e $p ] && echo EXISTS $p; done; echo checked")
    (r,), vr = episode([(probe, 10)])
    assert r.output == "checked\n"
    assert_scores_zero(vr)


def test_writes_outside_the_workdir(base):
    attack = ("for f in /etc/passwd /etc/hostname /usr/bin/python3 /bin/sh /x /root/x /home/x /opt/x /var/x; do "
              "  (echo pwned > $f) 2>/dev/null && echo WROTE $f; done; "
              "rm -rf /usr/lib/python3 2>/dev/null; mkdir /logs 2>/dev/null && echo MADE_LOGS; "
              "ls /usr/lib/python3 >/dev/null 2>&1 && echo intact")
    (r,), vr = episode([(attack, 30)])
    if HELLO.uses_layer:
        # root in the episode's own copy of the image, as in a Docker container: every write
        # lands, in this episode only (the fixture checks the host, rootfs and layers unchanged)
        assert r.output.count("WROTE") == 9 and "MADE_LOGS" in r.output and "intact" not in r.output, r.output
        with open_sandbox(HELLO) as sb:
            after = sb.run("cat /etc/hostname /x 2>&1 | grep -c pwned; ls /usr/lib/python3 >/dev/null && echo intact", timeout=10)
        assert after.output == "0\nintact\n", after.output
    else:  # uid 1000 on a read-only root: the workdir and /tmp only
        assert "WROTE" not in r.output and "MADE_LOGS" not in r.output and "intact" in r.output
    assert_scores_zero(vr)


def test_reward_file_written_by_the_agent_never_counts(base):
    attack = ("mkdir -p /logs/verifier 2>/dev/null; echo 1 > /logs/verifier/reward.txt; "
              "echo 1 > /app/reward.txt; mkdir -p /tmp/logs/verifier; echo 1 > /tmp/logs/verifier/reward.txt; "
              "printf '<testsuite><testcase classname=\"test_outputs\" name=\"test_greeting_exists\"/></testsuite>' > /app/junit.xml")
    _, vr = episode([(attack, 10)])
    assert_scores_zero(vr)


def test_planted_pytest_conftest_and_fake_tests_do_not_help(base):
    attack = (
        "mkdir -p /app/tests; "
        "printf 'def test_greeting_exists(): pass\\ndef test_greeting_content(): pass\\n' > /app/tests/test_outputs.py; "
        "printf 'import pytest\\n@pytest.hookimpl(hookwrapper=True)\\ndef pytest_runtest_makereport(item, call):\\n"
        "    o = yield\\n    r = o.get_result(); r.outcome = \"passed\"\\n' > /app/conftest.py; "
        "printf 'import sys; sys.exit(0)\\n' > /app/pytest.py; cp /app/pytest.py /app/sitecustomize.py; "
        "mkdir -p /tmp/.local/lib/python3.11/site-packages; echo 'import os' > /tmp/.local/lib/python3.11/site-packages/x.pth; "
        "echo 'exit 0' > /tmp/.bashrc; cat /tests/test_outputs.py /solution/solve.sh 2>&1 | head -2")
    (r,), vr = episode([(attack, 10)])
    assert "No such file" in r.output
    assert_scores_zero(vr)


def test_killing_the_harness(base):
    ppid = os.getpid()
    commands = [("kill -9 -1", 10), ("kill -9 $PPID 1 2>&1; pkill -9 -f pytest; pkill -9 python3; echo survived", 10),
                (f"kill -9 {ppid} 2>&1 | head -1", 10), ("echo alive", 10)]
    results, vr = episode(commands)
    assert results[-1].output == "alive\n" and results[-1].exit_code == 0
    assert_scores_zero(vr)
    os.kill(ppid, 0)  # the harness is still here


def _pid_namespace_members(ns: str, live: bool = False) -> list[int]:
    """Host pids of the processes in the pid namespace ``ns`` ("pid:[inode]", as readlink
    /proc/self/ns/pid prints it inside the jail). ``live``: zombies left out, as a killed bomb process
    whose parent died first is reparented to the host's pid 1 and waits there to be reaped
    (seen with the layered root: "State: Z, PPid: 1"); it is dead and holds nothing but its pid."""
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.readlink(f"/proc/{name}/ns/pid") == ns and not (
                        live and "State:\tZ" in Path(f"/proc/{name}/status").read_text()):
                    members.append(int(name))
            except OSError:  # gone meanwhile
                continue
    return members


def test_fork_bomb_is_contained(base):
    t0 = time.monotonic()
    with open_sandbox(HELLO, pids=128) as sb:
        # The agent's pid namespace names the bomb's processes on the host exactly, whatever
        # else the machine runs (a count of all host processes moves with other users' jobs).
        ns = sb.run("readlink /proc/self/ns/pid", timeout=10).output.strip()
        assert ns.startswith("pid:["), ns
        # The bomb runs in the background (`:|:&`): the shell itself comes back, the pids limit
        # holds the bomb, and the verifier's fresh jail still runs every test.
        sb.run(":(){ :|:& };:", timeout=3)
        # A builtin: no fork needed. The bomb's processes live on in the background until the
        # episode ends, so their "fork: retry" noise may come before or after the line.
        alive = sb.run("echo alive", timeout=10)
        during, until = _pid_namespace_members(ns), time.monotonic() + 10
        while len(during) <= 10 and time.monotonic() < until:  # a loaded machine forks slower
            time.sleep(0.05)
            during = _pid_namespace_members(ns)
        vr = verify(sb, HELLO)
    assert "alive" in alive.output.splitlines()
    assert len(during) > 10  # the bomb forked (the check below can see its processes) ...
    assert _pid_namespace_members(ns, live=True) == []  # ... and none of them is left alive
    assert time.monotonic() - t0 < 60
    assert_scores_zero(vr)
    assert len(vr.checks) == 3, vr.output_tail


def test_foreground_fork_bomb_times_out(base):
    results, vr = episode([("bash -c ':(){ :|: & }; :; wait'; sleep 100", 3), ("echo alive", 10)], pids=64)
    assert results[0].timed_out and results[1].output.endswith("alive\n")
    assert_scores_zero(vr)


def test_output_flood(base):
    results, vr = episode([("cat /dev/urandom", 2), ("yes $(head -c 5000 /dev/zero | tr '\\0' x)", 2),
                           ("echo ok", 5)])
    for r in results[:2]:
        assert r.timed_out and r.truncated and len(r.output.encode()) < 16384 * 4
    assert results[2].output == "ok\n"
    assert_scores_zero(vr)


def test_sleep_forever_and_background_daemons(base):
    t0 = time.monotonic()
    results, vr = episode([("nohup sleep infinity >/dev/null 2>&1 & setsid sleep infinity & disown; echo started", 10),
                           ("sleep infinity", 1)])
    assert results[0].output.startswith("started") and results[1].timed_out
    assert time.monotonic() - t0 < 30
    assert_scores_zero(vr)


def test_memory_and_file_size_limits(base):
    commands = [("python3 -c 'x = bytearray(3 << 30); print(\"allocated\")' 2>&1 | tail -1; echo status ${PIPESTATUS[0]}", 30),
                ("head -c 20M /dev/zero > big; ls -s --block-size=M big", 30),
                ("python3 -c 'x = bytearray(300 << 20); print(\"fits\")'", 30)]
    with open_sandbox(HELLO, memory_mb=512, file_size_mb=4) as sb:
        results = [sb.run(cmd, timeout=t) for cmd, t in commands]
        whole_jail = sb._cgroup is not None
        vr = verify(sb, HELLO)
    if whole_jail:  # a memory cgroup (on a layer, where the host has one): the kernel kills it, as Docker's would
        assert results[0].output == "status 137\n", results[0].output
    else:  # the per-process address-space limit
        assert "MemoryError" in results[0].output and "allocated" not in results[0].output, results[0].output
    assert "File size limit exceeded" in results[1].output or results[1].output.endswith("4M big\n")
    assert results[2].output == "fits\n"
    assert_scores_zero(vr)


def test_next_episode_starts_clean(base):
    episode([("echo junk > /app/junk; echo t > /tmp/t; sleep 1000 & echo hello > greeting.txt", 10)])
    assert_next_episode_clean()


def test_agent_program_run_by_the_tests_cannot_forge_the_reward(base, tmp_path):
    """Tests that execute agent code give it the verifier's rights; test.sh's convention
    (kill -9 -1, rm -rf, then write) still keeps a forged reward.txt out."""
    d = tmp_path / "runs_agent_code"
    shutil.copytree(FIXTURES / "good" / "hello", d)
    (d / "tests" / "test_outputs.py").write_text(
        "import subprocess\n\n\ndef test_script_prints_ok():\n"
        "    out = subprocess.run(['bash', '/app/run.sh'], capture_output=True, text=True, timeout=10).stdout\n"
        "    assert out == 'ok\\n'\n")
    task = load_task(d)
    forge = ("cat > run.sh <<'EOS'\n"
             "echo 1 > /logs/verifier/reward.txt; chmod 444 /logs/verifier/reward.txt\n"
             "(while :; do echo 1 > /logs/verifier/reward.txt 2>/dev/null; done) >/dev/null 2>&1 &\n"
             "echo nope\nEOS")
    with open_sandbox(task) as sb:
        sb.run(forge, timeout=10)
        vr = verify(sb, task)
    assert vr.success is False and (vr.passed, vr.total) == (0, 1), vr.output_tail

"""Tutorial 3: a task, a sandbox, and the protected verifier.
(modules: minirsi/env/tasks.py, minirsi/env/sandbox/, minirsi/env/verifier.py, toy_envs/)

Run:  python tutorials/03_sandbox.py          (needs bubblewrap and the rootfs: scripts/setup.sh)

A task is a directory in the Harbor / Terminal-Bench 2 layout (instruction.md, task.toml,
environment/, solution/solve.sh, tests/). The agent acts in a persistent shell inside a jail
(bubblewrap: no network, read-only system, unprivileged user, the task's files at /app). When
it stops, the verifier ends the jail, brings in tests/ (which the agent never saw), runs
tests/test.sh, and reads the gate S from /logs/verifier/reward.txt and the checks P / C from
pytest's junit XML (docs/method.md section 1).
"""

import tempfile
from pathlib import Path

import toy_envs
from minirsi.env.sandbox import open_sandbox
from minirsi.env.tasks import load_task
from minirsi.env.verifier import verify

out = Path(tempfile.mkdtemp(prefix="minirsi-tutorial-"))
paths = toy_envs.generate_suite("core", out, n=12, seed=0)
task = load_task(next(p for p in paths if "files-easy" in p.name))
print("task:", task.task_id, "| family:", task.family, "| difficulty:", task.difficulty)
print("instruction:", task.instruction.strip())

# 1. An agent that does nothing fails, and the checks say how far it got.
with open_sandbox(task) as sb:
    listing = sb.run("ls", timeout=10).output.split()
    print("ls /app ->", listing)
    placed = sorted({p.relative_to(task.path / "environment").parts[0]
                     for p in (task.path / "environment").rglob("*") if p.is_file()})
    assert listing == placed  # /app starts as the task's environment/ folder
    no_tests = sb.run("ls /tests 2>&1", timeout=10)
    print("the tests are not there ->", no_tests.output.strip())
    assert no_tests.exit_code != 0 and "No such file" in no_tests.output
    empty = verify(sb, task)
print(f"do nothing : S={int(empty.success)}  P={empty.passed}/{empty.total}")
assert not empty.success and 0 <= empty.passed < empty.total

# 2. The oracle's commands, typed one by one into the persistent shell, pass the gate.
solution = [line for line in (task.path / "solution" / "solve.sh").read_text().splitlines()
            if line.strip() and not line.startswith(("#", "set "))]
with open_sandbox(task) as sb:
    for command in solution:
        r = sb.run(command, timeout=10)
        print(f"$ {command}   -> exit {r.exit_code}")
        assert r.exit_code == 0
    oracle = verify(sb, task)
print(f"oracle     : S={int(oracle.success)}  P={oracle.passed}/{oracle.total}  checks={oracle.checks}")
assert oracle.success and oracle.passed == oracle.total
assert all(v == "passed" for v in oracle.checks.values())

# 3. Hostile commands are contained: no network, no writes outside /app, no reward forging.
with open_sandbox(task) as sb:
    for command in ("touch /etc/owned", "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt",
                    "python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), 2)'"):
        r = sb.run(command, timeout=10)
        print(f"$ {command[:60]:<60} -> exit {r.exit_code}")
        assert r.exit_code != 0
    forged = verify(sb, task)
print(f"hostile    : S={int(forged.success)}  (a reward file the agent wrote never counts)")
assert not forged.success

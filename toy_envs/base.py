"""The building blocks of a toy task, and how an instance becomes a Harbor task directory.

A toy task is a short list of *steps* of one family. A step is one instruction sentence with
a fixed phrasing ("Copy cat.txt to dog.txt."), its canonical commands (one per line: the
oracle and the pretraining corpus use the same ones), the files it needs in ``/app`` before
the agent starts, and its checks (one test function each; docs/method.md section 1). Difficulty is
the number of canonical commands: easy = 1, medium = 2, hard = 3-4, extreme = 5 or more.

An instance is a pure function of its *key*, ``(family, difficulty, strict, steps)`` with
``steps = ((kind, params, obstacle), ...)``: the params are the names drawn from
toy_envs/words.py, the obstacle "" or one of toy_envs/obstacles.py's (what makes a canonical
command fail in this instance), and every other detail (file contents, numbers) comes from an
RNG seeded by the key's hash. So two instances with the same key are the same task, and
train / eval disjointness is a property of keys alone (toy_envs/suites.py).

The gate (``/logs/verifier/reward.txt``) is 1 iff every test passes, hygiene tests
included. ``strict`` instances add the sentence "Do not create any other files." and a hygiene
test for it: a run can then pass every counted check (P = C) and still fail the gate, like the
paper's 48 runs.

Rendering (``write_task``) produces::

    <task_id>/instruction.md  task.toml  environment/  solution/solve.sh  solution/toy.json
    <task_id>/tests/test.sh  tests/test_outputs.py  tests/run_checks.py

The checks are a pytest module, but test.sh runs them with ``run_checks.py`` (standard library
only, ~0.03 s) instead of pytest (~0.15 s, mostly its start-up): see that file for why.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from toy_envs import obstacles
from toy_envs.obstacles import Obstacle
from toy_envs.words import Exhausted, NamePool

DIFFICULTIES = ("easy", "medium", "hard", "extreme")

STRICT_SENTENCE = "Do not create any other files."

STEPS_FILE = "steps.txt"
"""Where a task's steps are: one numbered line each, in /app, read-only. Why a file the agent reads
one line at a time and not the numbered lines in the instruction: a ~1M-parameter Base copies a
name from the text just above it almost always, but looking up the n-th line of an instruction
far above is a skill it did not learn in 4,000 steps (line 1 right 90%, a new line 11-17%; seven
corpus and model changes left it there, docs/experiments.md "The toy Base's copy skill"). With
the line printed right before its commands the copying is trained away and what is left to get
wrong is decisions: which step is next, what to do after an obstacle, when to stop."""


def read_step(k: int) -> str:
    """The command that prints step ``k`` of ``steps.txt`` (what the demonstrator runs)."""
    return f"sed -n {k}p {STEPS_FILE}"


AGENT_TIMEOUT_SEC = {"easy": 60.0, "medium": 90.0, "hard": 120.0, "extreme": 180.0}
VERIFIER_TIMEOUT_SEC = 30.0
RUN_CHECKS = Path(__file__).with_name("run_checks.py")  # copied into every task's tests/


@dataclass(frozen=True)
class File:
    """A file placed in /app before the agent starts."""

    content: bytes
    mode: int = 0o644


@dataclass(frozen=True)
class Cmd:
    """One canonical command, with what the shell prints for it (used by the corpus)."""

    text: str
    output: str = ""
    exit_code: int = 0
    reads: tuple[str, ...] = ()
    """Paths the command needs to exist. The corpus swaps one for a missing name to make a
    failing command; ``error`` (a format string with ``{path}``) is then what it prints."""
    error: str = ""
    error_code: int = 1
    writes: tuple[str, ...] = ()
    """Paths the command creates; the corpus swaps one for a wrong name (a silent mistake)."""


@dataclass(frozen=True)
class Check:
    """One check (a test function): ``body`` is its Python statements. A hygiene check is
    rendered as ``test_hygiene_<name>`` (how minirsi.env.verifier recognises one without pytest)."""

    name: str
    body: str
    hygiene: bool = False


@dataclass
class Step:
    sentence: str
    cmds: list[Cmd]
    checks: list[Check]
    files: dict[str, File] = field(default_factory=dict)
    creates: tuple[str, ...] = ()
    """Top-level names in /app this step may create (allowed by the strict hygiene test)."""
    setup: tuple[str, ...] = ()
    """Shell lines run after the family's set-up (e.g. an untracked file in a git repo)."""
    obstacle: Obstacle | None = None
    """What makes one of ``cmds`` fail in this instance (toy_envs/obstacles.py), or None."""

    @property
    def solution(self) -> list[str]:
        """The commands that solve the step: ``cmds``, with the obstacle's fix first."""
        out = [c.text for c in self.cmds]
        ob = self.obstacle
        if ob is not None:
            out[ob.at:ob.at + 1] = [*ob.fix, ob.redo or out[ob.at]]
        return out


@dataclass
class State:
    """What earlier steps of the same task left behind (only the git family needs it)."""

    branch: str = "main"
    head: str = "init"
    """Subject of the commit HEAD points to."""


@dataclass(frozen=True)
class StepKind:
    """A parameterised step: ``sample`` draws the names, ``build`` makes the step.

    ``build(params, rng, state)`` must use only ``params`` and ``rng`` (seeded from the task
    key) so an instance is a pure function of its key; a kind that admits obstacles is built
    with ``build(params, rng, state, obstacle=NAME)`` when the instance has one.
    """

    name: str
    n_cmds: int
    sample: Callable[[random.Random, NamePool], tuple | None]
    build: Callable[..., Step]
    obstacles: tuple[str, ...] = ()
    """The obstacles (toy_envs/obstacles.py) this kind can be built with."""

    def make(self, params: tuple, rng: random.Random, state: State, obstacle: str = "") -> Step:
        if not obstacle:
            return self.build(params, rng, state)
        if obstacle not in self.obstacles:
            raise ValueError(f"step kind {self.name!r} admits obstacles {self.obstacles}, not {obstacle!r}")
        step = self.build(params, rng, state, obstacle=obstacle)
        if step.obstacle is None or step.obstacle.kind != obstacle:
            raise ValueError(f"step kind {self.name!r} built with obstacle {obstacle!r} has {step.obstacle}")
        return step


@dataclass(frozen=True)
class Family:
    name: str
    kinds: tuple[StepKind, ...]
    unseen: bool = False
    """Never in the training pool nor in the pretraining corpus."""
    setup: tuple[str, ...] = ()
    """Shell lines run in /app (as the agent's user) after the files are placed."""
    helpers: str = ""
    """Extra helper functions for test_outputs.py."""
    files: tuple[tuple[str, File], ...] = ()
    """Files every task of the family starts with (e.g. a README for the first git commit)."""
    env: tuple[tuple[str, str], ...] = ()
    """Variables of the agent's shell and the setup script (task.toml ``[environment.env]``)."""

    def kind(self, name: str) -> StepKind:
        for k in self.kinds:
            if k.name == name:
                return k
        raise ValueError(f"family {self.name!r} has no step kind {name!r}; kinds: {[k.name for k in self.kinds]}")


@dataclass
class Instance:
    family: Family
    difficulty: str
    key: tuple
    steps: list[Step]
    strict: bool
    tags: tuple[str, ...] = ()

    @property
    def task_id(self) -> str:
        return f"{self.family.name}-{self.difficulty}-{stable_hash(self.key) % 16**8:08x}"

    @property
    def instruction(self) -> str:
        """What the agent is told: how many steps ``steps.txt`` holds and how to print one,
        then the strict sentence if any. The steps themselves (their names) are only in
        ``steps.txt``: the agent prints step k (``read_step(k)``) right before it does it, so
        every name it types is a copy of the line just above (see ``STEPS_FILE``)."""
        n = len(self.steps)
        lines = [f"Do the {n} numbered step{'s' if n > 1 else ''} in {STEPS_FILE}, in order "
                 f"({read_step(1)} prints step 1)."] + ([STRICT_SENTENCE] if self.strict else [])
        return "\n".join(lines) + "\n"

    @property
    def lines(self) -> list[str]:
        """The numbered line of each step ("2. Copy cat.txt to dog.txt."): ``steps.txt``."""
        return [f"{i + 1}. {s.sentence}" for i, s in enumerate(self.steps)]

    @property
    def steps_text(self) -> str:
        """The content of ``steps.txt``: ``lines``, one a line."""
        return "\n".join(self.lines) + "\n"

    @property
    def commands(self) -> list[Cmd]:
        """The canonical commands (their number is the difficulty); obstacles not removed."""
        return [c for s in self.steps for c in s.cmds]

    @property
    def solution(self) -> list[str]:
        """The oracle's commands: the canonical ones with each obstacle's fix before it."""
        return [c for s in self.steps for c in s.solution]

    @property
    def clean_run(self) -> list[str]:
        """The demonstrator's commands when nothing goes wrong: each step's line printed
        (``read_step``), then the step's ``solution``."""
        return [c for k, s in enumerate(self.steps, 1) for c in (read_step(k), *s.solution)]

    @property
    def setup(self) -> list[str]:
        lines = list(self.family.setup)
        for s in self.steps:
            lines.extend(s.setup)
        return lines

    def files(self) -> dict[str, File]:
        """The files in /app when the agent starts: the family's, the steps', and ``steps.txt``."""
        out: dict[str, File] = {STEPS_FILE: File(self.steps_text.encode(), 0o444)}
        out.update(self.family.files)
        for s in self.steps:
            out.update(s.files)
        return out


def stable_hash(obj: object) -> int:
    """A 64-bit hash of ``repr(obj)`` that is the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(repr(obj).encode()).digest()[:8], "big")


def build_instance(family: Family, difficulty: str, strict: bool, steps: tuple, tags=()) -> Instance:
    """Key -> instance. ``steps`` is ``((kind_name, params, obstacle), ...)``, obstacle "" for none."""
    key = (family.name, difficulty, strict, tuple(steps))
    rng = random.Random(stable_hash(key))
    state = State()
    built = [family.kind(kind).make(params, rng, state, obstacle) for kind, params, obstacle in steps]
    return Instance(family, difficulty, key, built, strict, tuple(tags))


def sample_instance(family: Family, difficulty: str, n_cmds: int, rng: random.Random, strict: bool, tags=()) -> Instance:
    """Draw steps whose canonical commands add up to exactly ``n_cmds``; each step whose kind
    admits obstacles gets one with probability ``obstacles.OBSTACLE_RATE``."""
    pool = NamePool(rng)
    steps: list[tuple[str, tuple, str]] = []
    left = n_cmds
    for _attempt in range(100):
        if left == 0:
            break
        fits = [k for k in family.kinds if k.n_cmds <= left]
        if not fits:
            raise ValueError(f"family {family.name}: no step kind fits {left} commands")
        k = rng.choices(fits, [obstacles.KIND_WEIGHT if f.obstacles else 1.0 for f in fits])[0]
        try:
            params = k.sample(rng, pool)
        except Exhausted:
            params = None
        if params is None:  # the kind declined (e.g. a second branch switch in one task)
            continue
        obstacle = rng.choice(k.obstacles) if k.obstacles and rng.random() < obstacles.OBSTACLE_RATE else ""
        steps.append((k.name, params, obstacle))
        left -= k.n_cmds
    if left:
        raise ValueError(f"family {family.name}: could not fill {n_cmds} commands")
    return build_instance(family, difficulty, strict, tuple(steps), tags)


# ----------------------------------------------------------------------------- rendering

_TEST_HEADER = '''"""Checks of toy task {task_id} (generated by toy_envs; one test per check)."""
import os
import stat

APP = "/app"


def path(name):
    return os.path.join(APP, name)


def read(name):
    with open(path(name), encoding="utf-8", errors="replace") as f:
        return f.read()


def lines(name):
    return read(name).splitlines()


def mode(name):
    return stat.S_IMODE(os.stat(path(name)).st_mode)
'''

TEST_SH = """#!/bin/bash
# Verifier of a toy task (convention: minirsi/verifier.py). Each test in test_outputs.py is one
# check; test_hygiene_* tests are bookkeeping (not in P or C). The gate is strict: reward 1 iff
# every test, hygiene included, passes. The checks run under run_checks.py (a pytest-compatible
# runner without pytest's start-up cost) in isolated mode (-I: /app, which the agent wrote, is
# not on sys.path), then kill everything the tests started and write the reward last, so a
# program of the agent's that ran under the checks cannot forge the gate.
mkdir -p /logs/verifier
cd /app || exit 1
python3 -I /tests/run_checks.py /tests/test_outputs.py /logs/verifier/junit.xml
status=$?
kill -9 -1 2>/dev/null
rm -rf /logs/verifier/reward.txt
if [ $status -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def test_source(inst: Instance) -> str:
    parts = [_TEST_HEADER.format(task_id=inst.task_id)]
    if inst.family.helpers:
        parts.append(inst.family.helpers)
    checks = [(f"s{i + 1}_{c.name}", c) for i, s in enumerate(inst.steps) for c in s.checks]
    if inst.strict:
        allowed = sorted(_allowed_names(inst))
        checks.append(("no_other_files", Check(
            "no_other_files",
            f"allowed = set({allowed!r})\nstray = sorted(set(os.listdir(APP)) - allowed)\n"
            "assert not stray, f\"files not asked for: {stray}\"",
            hygiene=True,
        )))
    for name, c in checks:
        body = "\n".join("    " + line for line in c.body.splitlines())
        parts.append(f"\ndef test_{'hygiene_' if c.hygiene else ''}{name}():\n{body}\n")
    return "\n".join(parts)


def _allowed_names(inst: Instance) -> set[str]:
    names = {p.split("/")[0] for p in inst.files()}
    for s in inst.steps:
        names.update(s.creates)
    return names | {".git"}


def solve_source(inst: Instance) -> str:
    cmds = "\n".join(inst.solution)
    return (f"#!/bin/bash\n# Oracle of toy task {inst.task_id}: the canonical commands, one per line, each "
            f"obstacle's fix before the command it blocks.\nset -e\ncd /app\n{cmds}\n")


def toy_metadata(inst: Instance) -> dict:
    """solution/toy.json: what the failure taxonomy (minirsi/run/failures.py) reads after a run; the
    agent never sees solution/. ``canonical``: the canonical commands; ``obstacles``: per
    obstacle its kind, the blocked command, the error, the fix and the redo command."""
    obs = []
    for s in inst.steps:
        if s.obstacle is not None:
            ob = s.obstacle
            cmd = s.cmds[ob.at].text
            obs.append({"kind": ob.kind, "command": cmd, "error": ob.error, "exit_code": ob.exit_code,
                        "fix": list(ob.fix), "redo": ob.redo or cmd})
    return {"canonical": [c.text for c in inst.commands], "obstacles": obs}


def task_toml(inst: Instance) -> str:
    tags = ", ".join(f'"{t}"' for t in ("toy", inst.family.name, *inst.tags))
    setup = '\nsetup = "setup.sh"' if inst.setup else ""
    return (
        'version = "1.0"\n\n'
        f'[metadata]\ndifficulty = "{inst.difficulty}"\ncategory = "{inst.family.name}"\ntags = [{tags}]\n'
        "\n"
        f"[agent]\ntimeout_sec = {AGENT_TIMEOUT_SEC.get(inst.difficulty, 300.0)}\n\n"
        f"[verifier]\ntimeout_sec = {VERIFIER_TIMEOUT_SEC}\n\n"
        f'[environment]\nworkdir = "/app"{setup}\n'
        + ("\n[environment.env]\n" + "".join(f'{k} = "{v}"\n' for k, v in inst.family.env) if inst.family.env else "")
    )


def write_task(inst: Instance, out_dir: Path) -> Path:
    """Write the Harbor-layout directory of ``inst`` under ``out_dir``; returns its path."""
    root = Path(out_dir) / inst.task_id
    (root / "environment").mkdir(parents=True, exist_ok=True)
    (root / "solution").mkdir(exist_ok=True)
    (root / "tests").mkdir(exist_ok=True)
    _write(root / "instruction.md", inst.instruction.encode())
    _write(root / "task.toml", task_toml(inst).encode())
    for rel, f in sorted(inst.files().items()):
        _write(root / "environment" / rel, f.content, f.mode)
    if inst.setup:
        body = "\n".join(inst.setup)
        _write(root / "environment" / "setup.sh", f"#!/bin/bash\n# Set-up run in /app before the agent starts.\nset -e\ncd /app\n{body}\n".encode(), 0o755)
    _write(root / "solution" / "solve.sh", solve_source(inst).encode(), 0o755)
    _write(root / "solution" / "toy.json", (json.dumps(toy_metadata(inst), indent=1) + "\n").encode())
    _write(root / "tests" / "test.sh", TEST_SH.encode(), 0o755)
    _write(root / "tests" / "test_outputs.py", test_source(inst).encode())
    _write(root / "tests" / "run_checks.py", RUN_CHECKS.read_bytes())
    return root


def _write(p: Path, data: bytes, mode: int = 0o644) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    os.chmod(p, mode)


def q(s: str) -> str:
    """Shell-quote only when needed (keeps canonical commands short)."""
    return shlex.quote(s)

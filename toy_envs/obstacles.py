"""Obstacles: what makes a toy task a matter of decisions, and the demonstrator's fixed rates.

A toy step can come with an *obstacle*: something in the environment that makes its canonical
command fail, visible only in what the shell prints (nothing in the instruction says so). Each
obstacle has one error text and one recovery, shared by every step and family it appears in:

=============  ===========================================  =====================================
obstacle       what the environment holds                   recovery (then the command again)
=============  ===========================================  =====================================
missing_dir    the target directory does not exist          ``mkdir D``
no_exec        the script lacks its execute bit             ``chmod +x A.sh``
read_only      the output file exists, read-only (0444)     ``chmod u+w B.txt``
needs_force    git / gzip refuse without ``-f``             the same command with ``-f``
=============  ===========================================  =====================================

An obstacle is part of an instance's key (``toy_envs.base``: each step is ``(kind, params,
obstacle)``), so train / eval disjointness covers it, and it is drawn when the instance is
generated: each step whose kind admits obstacles gets one with probability ``OBSTACLE_RATE``.

The demonstrator (toy_envs/corpus.py, the pretraining data) meets an obstacle and then, with
the probabilities ``DEMONSTRATOR``, recovers (the fix, then the failed command again), moves
on to the next step (the task then fails), or repeats the failing command once and moves on.
It also stops one command early (``STOP_EARLY``, tasks of two commands or more) and, in
``RETRY`` of its sessions, first types a wrong file name, reads the error, and retries right.
So a Base that imitates it has seen every right move, and its mistakes are decisions (what to
do after an error, when to stop), shared across instances, not names to copy.

The rates were fixed once, before any RL run, from the demonstrator's analytic success on a dev
split (``python -m toy_envs rates``, see ``dev_report``): the aim was a demonstrator solving
about a fifth of core-like tasks. They were never tuned against the recipe's results.
"""

from __future__ import annotations

from dataclasses import dataclass

OBSTACLES = ("missing_dir", "no_exec", "read_only", "needs_force")

OBSTACLE_RATE = 0.9
"""Probability that a step whose kind admits obstacles gets one (drawn per instance)."""

KIND_WEIGHT = 4.0
"""How much more often a step kind that admits obstacles is drawn than one that does not."""

DEMONSTRATOR = {"recover": 0.15, "move_on": 0.45, "repeat": 0.40}
"""What the corpus's demonstrator does after an obstacle's error."""

STOP_EARLY = 0.3
"""Share of the demonstrator's sessions of >= 2 canonical commands that leave out the last one."""

RETRY = 0.1
"""Share of sessions in which one command first names a missing file, fails, and is retried."""


@dataclass(frozen=True)
class Obstacle:
    """An obstacle on one command of a step (``Step.obstacle``).

    The command at ``at`` fails with ``error`` / ``exit_code``; running ``fix`` and then
    ``redo`` (the same command when None) succeeds.
    """

    kind: str
    at: int
    """Index of the failing command in ``Step.cmds``."""
    error: str
    exit_code: int
    fix: tuple[str, ...] = ()
    """Commands that remove the obstacle, run before the command again."""
    redo: str | None = None
    """The command that replaces the failing one (needs_force); None: the same command again."""

    def __post_init__(self) -> None:
        if self.kind not in OBSTACLES:
            raise ValueError(f"obstacle kind {self.kind!r}: use one of {OBSTACLES}")
        if not self.fix and self.redo is None:
            raise ValueError(f"obstacle {self.kind}: give a fix or a redo command")


# Error texts as the sandbox's shell prints them (Debian 12 coreutils, bash, tar, gzip, git).
# ``bash: line 8:`` is where the sandbox's command driver (minirsi/env/sandbox/shell.py) evals the
# first line of a block: the demonstrator's one command. tests/test_toy_envs.py checks every text
# against a real sandbox.


def missing_dir(d: str, at: int, tool: str, script: str = "", target: str = "") -> Obstacle:
    """Directory ``d`` is absent; ``tool`` (cp, tar, chmod) writes into or changes it, or
    (tool "script") the script ``script`` run as ``./script`` writes ``target`` inside it."""
    error = {
        "cp": f"cp: cannot create regular file '{d}/': Not a directory",
        "tar": f"tar: {d}: Cannot open: No such file or directory\ntar: Error is not recoverable: exiting now",
        "chmod": f"chmod: cannot access '{d}': No such file or directory",
        "script": f"./{script}: line 2: {target}: No such file or directory",
    }[tool]
    return Obstacle("missing_dir", at, error, 2 if tool == "tar" else 1, fix=(f"mkdir {d}",))


def no_exec(script: str, at: int) -> Obstacle:
    """``script`` is mode 0644 and the command runs it as ``./script``."""
    return Obstacle("no_exec", at, f"bash: line 8: ./{script}: Permission denied", 126, fix=(f"chmod +x {script}",))


def read_only(target: str, at: int, tool: str = "redirect") -> Obstacle:
    """``target`` exists with mode 0444 and the command (over)writes it (``tool``: how)."""
    error = {
        "redirect": f"bash: line 8: {target}: Permission denied",
        "cp": f"cp: cannot create regular file '{target}': Permission denied",
        "tar": f"tar: {target}: Cannot open: Permission denied\ntar: Error is not recoverable: exiting now",
    }[tool]
    return Obstacle("read_only", at, error, 1 if tool in ("redirect", "cp") else 2, fix=(f"chmod u+w {target}",))


def needs_force(command: str, at: int, error: str, exit_code: int) -> Obstacle:
    """``command`` refuses (``error``) until given ``-f`` right after the program's (sub)command."""
    words = command.split()
    head = 2 if words[0] == "git" else 1
    return Obstacle("needs_force", at, error, exit_code, redo=" ".join([*words[:head], "-f", *words[head:]]))


def step_success(obstacle: Obstacle | None) -> float:
    """Probability that the demonstrator gets past a step's commands (1 without an obstacle)."""
    return 1.0 if obstacle is None else DEMONSTRATOR["recover"]


def analytic_success(inst: object) -> float:
    """P(the demonstrator's session of ``inst`` passes the verifier): the product over its
    obstacles of P(recover), times 1 - STOP_EARLY for two commands or more (the retry defect
    retries right, so it never fails a session)."""
    p = 1.0
    for s in inst.steps:  # type: ignore[attr-defined]
        p *= step_success(s.obstacle)
    if len(inst.commands) >= 2:  # type: ignore[attr-defined]
        p *= 1.0 - STOP_EARLY
    return p


def dev_report(n: int = 720, seed: int = 0) -> dict:
    """The demonstrator's analytic success on a dev split: ``n`` train-side instances drawn with
    the core suite's families and difficulty pattern (seed ``("dev", seed)``, so not core's
    instances), overall and per difficulty, with the share of steps that hold an obstacle."""
    from toy_envs.suites import suite_instances

    insts = suite_instances("dev", n=n, seed=seed)
    by: dict[str, list[float]] = {}
    for i in insts:
        by.setdefault(i.difficulty, []).append(analytic_success(i))
    steps = [s for i in insts for s in i.steps]
    return {
        "n": len(insts),
        "success": sum(analytic_success(i) for i in insts) / len(insts),
        "by_difficulty": {d: sum(v) / len(v) for d, v in sorted(by.items())},
        "steps_with_obstacle": sum(s.obstacle is not None for s in steps) / len(steps),
        "rates": {"OBSTACLE_RATE": OBSTACLE_RATE, "DEMONSTRATOR": DEMONSTRATOR, "STOP_EARLY": STOP_EARLY,
                  "RETRY": RETRY},
    }

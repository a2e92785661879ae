"""Synthetic shell sessions for pretraining the tiny Base model (structured data, not text).

A session is a training-family task drawn from the same templates as the suites (fresh
random names, and only keys on the "train" side of ``toy_envs.suites.split_of``, so no
evaluation instance is ever seen) together with the turns of a *demonstrator*: one command per
turn and what the shell prints for it (most commands print nothing; ``sed -n Kp steps.txt``,
``ls``, ``cat``, ``unzip``, ``git commit`` and failing commands print what they would:
tests/test_toy_envs.py replays sessions in the sandbox and compares). Before the first command
of step K the demonstrator prints step K's line from steps.txt, so the names it types are on the
line just above (toy_envs/base.py ``STEPS_FILE``). The renderer in minirsi/core/actions.py turns a session into
chat text and appends the final ``TASK_COMPLETE`` reply; this module never renders text.

The demonstrator is right about names and commands, and imperfect about decisions, at the rates
fixed in toy_envs/obstacles.py (the same for every instance, never tuned against RL results):

==============  ==========================================================  ==========
defect          what happens                                                solved
==============  ==========================================================  ==========
(obstacle)      the canonical command fails with the obstacle's error, then
  recover         the fix, and the command again                            yes
  move_on         the next step (the failed command is never redone)        no
  repeat          the same failing command once more, then the next step   no
stop_early      the last canonical command is left out (and the last step's
                line is not printed when that was its only command)       no
retry           one command first names a missing file, fails with the      yes
                real error text, and is run right
==============  ==========================================================  ==========

So a model trained on these sessions has seen every right move, copies names (the corpus
never swaps one silently), and fails where the demonstrator decides wrong.

Knobs (arguments of ``sessions``): ``explore`` (default 0.2), the share of sessions that first
look around (``ls``, and half of those ``cat`` of the first text input); ``difficulty_weights``
(default easy .4, medium .3, hard .2, extreme .1); families are drawn uniformly.

Call::

    from toy_envs import corpus
    data = corpus.sessions(5000, seed=0)
    data[0].instruction, data[0].turns[0].commands, data[0].turns[0].output, data[0].defects
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from toy_envs import obstacles
from toy_envs.base import Cmd, Instance, read_step, stable_hash
from toy_envs.families import TRAIN_FAMILIES
from toy_envs.suites import draw
from toy_envs.words import FILES

VERSION = 2
"""Bumped whenever the sessions a seed gives change (2: each step's line printed from steps.txt
before its commands, no comment lines); part of the pretrain config hash, so a Base cached
from an older corpus is not reused."""

DIFFICULTY_WEIGHTS = {"easy": 0.4, "medium": 0.3, "hard": 0.2, "extreme": 0.1}
STRICT_SHARE = 0.3


@dataclass
class Turn:
    """One agent turn: the command block, what the shell printed, and the last exit code.

    The demonstrator's block is one command: ``sed -n Kp steps.txt`` before the first command of
    step K (its output is the step's numbered line), else a command of the step."""

    commands: str
    output: str
    exit_code: int

    @property
    def command(self) -> str:
        """The shell command (the block's last line)."""
        return self.commands.rsplit("\n", 1)[-1]


@dataclass
class Session:
    """A synthetic episode: the task's instruction and the agent's turns; the renderer adds
    the final completion reply (``TASK_COMPLETE``)."""

    instruction: str
    turns: list[Turn]
    family: str
    difficulty: str
    task_id: str
    key: tuple = field(repr=False)
    """The instance key (toy_envs.base): always on the "train" side of the split."""
    defects: tuple[str, ...] = ()
    """What the demonstrator did wrong or took a detour for, in order: ``"<obstacle>:<choice>"``
    per obstacle met (choice recover | move_on | repeat), ``"stop_early"``, ``"retry"``."""
    solved: bool = True
    """Whether the session's commands pass the task's verifier (tested in the sandbox)."""


def sessions(
    n: int,
    seed: int = 0,
    explore: float = 0.2,
    difficulty_weights: dict[str, float] | None = None,
) -> list[Session]:
    """``n`` demonstrator sessions over the training families, deterministic for ``seed``."""
    if n < 0:
        raise ValueError(f"corpus.sessions: n must be >= 0, got {n}")
    if not 0.0 <= explore <= 1.0:
        raise ValueError(f"corpus.sessions: explore must be in [0, 1], got {explore}")
    weights = difficulty_weights or DIFFICULTY_WEIGHTS
    bad = set(weights) - set(DIFFICULTY_WEIGHTS)
    if bad:
        raise ValueError(f"corpus.sessions: unknown difficulties {sorted(bad)}; use {list(DIFFICULTY_WEIGHTS)}")
    rng = random.Random(stable_hash(("corpus", seed)))
    diffs, dw = list(weights), list(weights.values())
    out = []
    for _ in range(n):
        family = rng.choice(TRAIN_FAMILIES)
        difficulty = rng.choices(diffs, dw)[0]
        inst = draw(family, difficulty, "train", rng, rng.random() < STRICT_SHARE)
        out.append(session_for(inst, rng, look=rng.random() < explore))
    return out


def session_for(inst: Instance, rng: random.Random, look: bool = False, choices: dict | None = None) -> Session:
    """The demonstrator's session of one instance.

    ``choices`` fixes what would otherwise be drawn at the rates of toy_envs/obstacles.py:
    ``{"obstacle": "recover" | "move_on" | "repeat", "stop_early": bool, "retry": bool}``
    (``obstacle`` applies to every obstacle of the instance); tests use it.
    """
    choices = choices or {}
    defects: list[str] = []
    solved = True
    turns = _look(inst, rng) if look else []
    plan: list[tuple[Cmd, list[Turn], int]] = []  # per canonical command run: its turns, its step's number
    for k, step in enumerate(inst.steps, 1):
        for i, c in enumerate(step.cmds):
            ob = step.obstacle if step.obstacle is not None and step.obstacle.at == i else None
            if ob is None:
                plan.append((c, [_turn(c)], k))
                continue
            choice = choices.get("obstacle") or _pick(rng, obstacles.DEMONSTRATOR)
            defects.append(f"{ob.kind}:{choice}")
            failed = Turn(c.text, ob.error + "\n", ob.exit_code)
            if choice == "recover":
                plan.append((c, [failed, *(Turn(f, "", 0) for f in ob.fix), Turn(ob.redo or c.text, c.output, c.exit_code)],
                             k))
                continue
            # move_on / repeat: the step is given up; its later commands (which need the failed
            # one: a commit after a refused ``git add``) are not run either
            plan.append((c, [failed] * (2 if choice == "repeat" else 1), k))
            solved = False
            break
    retry = choices["retry"] if "retry" in choices else rng.random() < obstacles.RETRY
    if retry:
        _retry(inst, plan, rng, defects)
    multi = len(inst.commands) >= 2
    stop = choices["stop_early"] if "stop_early" in choices else (multi and rng.random() < obstacles.STOP_EARLY)
    if stop and multi:
        plan.pop()
        defects.append("stop_early")
        solved = False
    shown = 0  # the step whose line the demonstrator printed last
    for _, ts, k in plan:
        if k != shown:
            turns.append(Turn(read_step(k), inst.lines[k - 1] + "\n", 0))
            shown = k
        turns += ts
    return Session(inst.instruction, turns, inst.family.name, inst.difficulty, inst.task_id, inst.key,
                   tuple(defects), solved)


def _pick(rng: random.Random, weights: dict[str, float]) -> str:
    return rng.choices(list(weights), list(weights.values()))[0]


def _turn(c: Cmd) -> Turn:
    return Turn(c.text, c.output, c.exit_code)


def _look(inst: Instance, rng: random.Random) -> list[Turn]:
    """``ls`` of /app as the agent finds it, maybe followed by ``cat`` of a text input."""
    names = {p.split("/")[0] for p in inst.files()}
    for line in inst.setup:  # files the set-up script writes, e.g. "echo plum > cat.txt"
        m = re.search(r"> (\S+)$", line)
        if m and "/" not in m.group(1) and not m.group(1).startswith("."):  # ls hides dot files
            names.add(m.group(1))
    turns = [Turn("ls", "".join(f"{x}\n" for x in sorted(names)), 0)]
    if rng.random() < 0.5:
        files = inst.files()
        for c in inst.commands:
            readable = [r for r in c.reads if r in files and not r.endswith((".tar", ".zip"))
                        and not any(r in line for line in inst.setup)]  # set-up may have changed it
            if readable:
                turns.append(Turn(f"cat {readable[0]}", files[readable[0]].content.decode(), 0))
                break
    return turns


def _retry(inst: Instance, plan: list[tuple[Cmd, list[Turn], int]], rng: random.Random, defects: list[str]) -> None:
    """A command that reads a file first names one the task never mentions, fails, and is
    run right next (only commands without an obstacle of their own)."""
    reading = [i for i, (c, ts, _) in enumerate(plan) if c.reads and c.error and ts == [_turn(c)]]
    if not reading:
        return
    i = rng.choice(reading)
    c, ts, k = plan[i]
    path = rng.choice(c.reads)
    free = [w for w in FILES if not re.search(rf"\b{w}\b", inst.steps_text)]
    wrong = _rename(path, rng.choice(free))
    plan[i] = (c, [Turn(_sub(c.text, path, wrong), c.error.format(path=wrong) + "\n", c.error_code), *ts], k)
    defects.append("retry")


def _rename(path: str, stem: str) -> str:
    """``red/cat.txt`` with stem ``dog`` -> ``red/dog.txt``; a bare directory name -> ``dog``."""
    head, _, base = path.rpartition("/")
    ext = base[base.index("."):] if "." in base else ""
    return f"{head}/{stem}{ext}" if head else f"{stem}{ext}"


def _sub(text: str, old: str, new: str) -> str:
    """Replace ``old`` as a whole name (not inside a longer name) by ``new``."""
    return re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w])", new, text)

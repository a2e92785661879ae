"""Synthetic shell sessions for pretraining the tiny Base model (structured data, not text).

A session is a training-family task drawn from the same templates as the suites (fresh
random names, and only keys on the "train" side of ``toy_envs.suites.split_of``, so no
evaluation instance is ever seen) together with the turns an agent would take: one canonical
command per turn and what the shell prints for it (most commands print nothing; ``ls``,
``cat``, ``unzip``, ``git commit`` print what they would). The renderer in minirsi/actions.py
turns a session into chat text and appends the final ``TASK_COMPLETE`` reply; this module
never renders text.

Knobs (all arguments of ``sessions``):

``noise`` (default 0.3)
    Share of imperfect sessions, so that a model trained on them is imperfect (Base 5-40%)
    but has seen the right moves. An imperfect session has one of these defects:

    ============  ======================================================  =========
    kind          what happens                                            solved
    ============  ======================================================  =========
    retry         a command names a missing file, fails with the real      yes
                  error text, and is retried correctly
    no_retry      the same failing command, never retried                 no
    wrong_file    a file the command creates gets a wrong name (silent)   no
    wrong_arg     a word argument (directory, mode, fruit, message) is    no
                  swapped for another one from its list (silent)
    missing_step  one canonical command is left out                       no
    ============  ======================================================  =========

    drawn with weights ``NOISE_WEIGHTS``; so about ``0.7 * noise`` of sessions end unsolved.
``explore`` (default 0.2)
    Share of sessions that first look around: ``ls`` (and, half of those, ``cat`` of the
    first text file the solution reads).
``difficulty_weights`` (default easy .4, medium .3, hard .2, extreme .1)
    How often each difficulty is drawn; families are drawn uniformly.

Call::

    from toy_envs import corpus
    data = corpus.sessions(5000, seed=0, noise=0.3)
    data[0].instruction, data[0].turns[0].commands, data[0].turns[0].output
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from toy_envs.base import Cmd, Instance, stable_hash
from toy_envs.families import TRAIN_FAMILIES
from toy_envs.suites import draw
from toy_envs.words import DIRS, FILES, FRUITS, MODES, TAGS

NOISE_WEIGHTS = {"retry": 0.3, "no_retry": 0.1, "wrong_file": 0.2, "wrong_arg": 0.2, "missing_step": 0.2}
DIFFICULTY_WEIGHTS = {"easy": 0.4, "medium": 0.3, "hard": 0.2, "extreme": 0.1}
STRICT_SHARE = 0.3
_SWAPPABLE = (DIRS, FRUITS, TAGS, MODES)


@dataclass
class Turn:
    """One agent turn: the command block, what the shell printed, and the last exit code."""

    commands: str
    output: str
    exit_code: int


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
    noise: str | None = None
    """None for a clean session, else the kind of defect (see the module docstring)."""
    solved: bool = True
    """Whether the session's commands would pass the task's verifier."""


def sessions(
    n: int,
    seed: int = 0,
    noise: float = 0.3,
    explore: float = 0.2,
    difficulty_weights: dict[str, float] | None = None,
) -> list[Session]:
    """``n`` sessions over the training families, deterministic for ``seed``."""
    if n < 0:
        raise ValueError(f"corpus.sessions: n must be >= 0, got {n}")
    for name, x in (("noise", noise), ("explore", explore)):
        if not 0.0 <= x <= 1.0:
            raise ValueError(f"corpus.sessions: {name} must be in [0, 1], got {x}")
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
        kind = rng.choices(list(NOISE_WEIGHTS), list(NOISE_WEIGHTS.values()))[0] if rng.random() < noise else None
        out.append(session_for(inst, rng, kind, rng.random() < explore))
    return out


def session_for(inst: Instance, rng: random.Random, kind: str | None = None, look: bool = False) -> Session:
    """The turns of one instance, with defect ``kind`` (None: the clean canonical run)."""
    cmds = list(inst.commands)
    turns = _look(inst, rng) if look else []
    solved = True
    if kind is not None:
        kind, solved, cmds_turns = _defect(inst, cmds, rng, kind)
    else:
        cmds_turns = [_turn(c) for c in cmds]
    return Session(inst.instruction, turns + cmds_turns, inst.family.name, inst.difficulty, inst.task_id,
                   inst.key, kind, solved)


def _turn(c: Cmd) -> Turn:
    return Turn(c.text, c.output, c.exit_code)


def _look(inst: Instance, rng: random.Random) -> list[Turn]:
    """``ls`` of /app as the agent finds it, maybe followed by ``cat`` of a text input."""
    names = {p.split("/")[0] for p in inst.files()}
    for line in inst.setup:  # files the set-up script writes, e.g. "echo plum > cat.txt"
        m = re.search(r"> (\S+)$", line)
        if m:
            names.add(m.group(1))
    turns = [Turn("ls", "".join(f"{x}\n" for x in sorted(names)), 0)]
    if rng.random() < 0.5:
        files = inst.files()
        for c in inst.commands:
            readable = [r for r in c.reads if r in files and not r.endswith((".tar", ".zip"))]
            if readable:
                turns.append(Turn(f"cat {readable[0]}", files[readable[0]].content.decode(), 0))
                break
    return turns


def _other_stem(inst: Instance, rng: random.Random) -> str:
    """A file stem the task never mentions (so a command using it names a missing file)."""
    free = [w for w in FILES if not re.search(rf"\b{w}\b", inst.instruction)]
    return rng.choice(free)


def _defect(inst: Instance, cmds: list[Cmd], rng: random.Random, kind: str):
    """Apply defect ``kind`` (falling back to a simpler one when it does not apply)."""
    reading = [i for i, c in enumerate(cmds) if c.reads and c.error]
    writing = [i for i, c in enumerate(cmds) if c.writes]
    swappable = [i for i, c in enumerate(cmds) if not c.text.startswith("grep") and _swap_word(c.text)]
    if kind in ("retry", "no_retry") and not reading:
        kind = "wrong_arg"
    if kind == "wrong_arg" and not swappable:
        kind = "wrong_file"
    if kind == "wrong_file" and not writing:
        kind = "missing_step"
    turns = [_turn(c) for c in cmds]
    if kind in ("retry", "no_retry"):
        i = rng.choice(reading)
        c = cmds[i]
        path = rng.choice(c.reads)
        wrong = _rename(path, _other_stem(inst, rng))
        bad = Turn(_sub(c.text, path, wrong), c.error.format(path=wrong) + "\n", c.error_code)
        turns[i:i + 1] = [bad, _turn(c)] if kind == "retry" else [bad]
        return kind, kind == "retry", turns
    if kind == "wrong_file":
        i = rng.choice(writing)
        c = cmds[i]
        path = rng.choice(c.writes)
        wrong = _rename(path, _other_stem(inst, rng))
        turns[i] = Turn(_sub(c.text, path, wrong), _sub(c.output, path, wrong), c.exit_code)
        return kind, False, turns
    if kind == "wrong_arg":
        i = rng.choice(swappable)
        c = cmds[i]
        word, words = _swap_word(c.text)
        fresh = [w for w in words if w != word and not re.search(rf"\b{w}\b", inst.instruction)]
        other = rng.choice(fresh or [w for w in words if w != word])
        turns[i] = Turn(_sub(c.text, word, other), _sub(c.output, word, other), c.exit_code)
        return kind, False, turns
    i = rng.randrange(len(cmds))
    del turns[i]
    return "missing_step", False, turns


def _swap_word(text: str):
    """The first word of ``text`` from a swappable list, and that list (or None)."""
    for tok in re.findall(r"[a-z0-9]+", text):
        for words in _SWAPPABLE:
            if tok in words:
                return tok, words
    return None


def _rename(path: str, stem: str) -> str:
    """``red/cat.txt`` with stem ``dog`` -> ``red/dog.txt``; a bare directory name -> ``dog``."""
    head, _, base = path.rpartition("/")
    ext = base[base.index("."):] if "." in base else ""
    return f"{head}/{stem}{ext}" if head else f"{stem}{ext}"


def _sub(text: str, old: str, new: str) -> str:
    """Replace ``old`` as a whole name (not inside a longer name) by ``new``."""
    return re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w])", new, text)

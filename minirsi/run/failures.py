"""Why a failed episode failed: the failure taxonomy of ``minirsi report`` and results.json.

Each failed episode (S = 0) gets one category, the first that applies:

=============  =================================================================================
category       rule
=============  =================================================================================
format         it ran no command, or at least half its replies parsed to no command
turn_limit     it did not stop by itself (turn limit, time-out, context)
wrong_name     a command has the shape of a command the task needs (same words but the names,
               toy_envs/words.py) with other names, and the needed command never ran right
obstacle       an obstacle's error showed in an observation and its fix (or the ``-f`` form)
               never ran right afterwards: the wrong decision after an obstacle
stopped_early  it declared the task done with a canonical command never run right
other          none of the above (e.g. a strict task's stray file)
=============  =================================================================================

The rules after ``turn_limit`` need what the task's oracle knows: toy tasks carry it in
``solution/toy.json`` (toy_envs/base.py ``toy_metadata``; the agent never sees solution/). A
task without it (a real Terminal-Bench task) gets format, turn_limit or other. "Ran right"
means the command's block exited 0 (``actions.read_blocks``).

Call::

    failures.summarise(episodes, {task_id: task_dir})   # {"n_failed": ..., "counts": {...}}
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

from minirsi.core.actions import bare_command, read_blocks
from minirsi.core.episode import Episode

CATEGORIES = ("format", "turn_limit", "wrong_name", "obstacle", "stopped_early", "other")


@functools.lru_cache(maxsize=4096)
def toy_metadata(task_dir: str) -> dict | None:
    """``solution/toy.json`` of a toy task, or None (a task that is not a toy)."""
    p = Path(task_dir) / "solution" / "toy.json"
    return json.loads(p.read_text()) if p.is_file() else None


@functools.lru_cache(maxsize=1)
def _names() -> frozenset[str]:
    from toy_envs import words

    return frozenset(words.FILES + words.DIRS + words.FRUITS + words.TAGS)


def shape(command: str) -> str:
    """A command with every name replaced by ``N`` (``cp cat.txt red/`` -> ``cp N.txt N/``)."""
    names = _names()
    return re.sub(r"[a-z]+", lambda m: "N" if m.group(0) in names else m.group(0), command.strip())


_LINE = re.compile(r"^bash: line \d+: ", re.MULTILINE)


def classify(ep: Episode, meta: Mapping[str, Any] | None) -> str | None:
    """The category of a failed episode (None for a success); ``meta``: its task's toy.json."""
    if ep.success:
        return None
    ran = [(bare_command(c), _LINE.sub("bash: ", out, count=0), ok) for turn in ep.transcript
           for c, out, ok in read_blocks(turn.get("commands") or [], turn.get("observation"))]
    if not ran or 2 * ep.parse_errors >= max(ep.turns, 1):
        return "format"
    if ep.stop_reason != "done":
        return "turn_limit"
    if not meta:
        return "other"
    good = {c for c, _, ok in ran if ok}
    obstacles = meta.get("obstacles", [])
    needed = list(meta.get("canonical", [])) + [x for o in obstacles for x in (*o["fix"], o["redo"])]
    done = {c for c in needed if c in good}
    for c in needed:
        if c not in done and any(shape(r) == shape(c) and r != c for r, _, _ in ran):
            return "wrong_name"
    for o in obstacles:
        first = _LINE.sub("bash: ", o["error"].splitlines()[0])  # where bash says "line N" depends on the block
        met = [i for i, (_, out, _) in enumerate(ran) if first in out]
        cure = list(o["fix"]) or [o["redo"]]
        if met and not any(r in cure and ok for r, _, ok in ran[met[0] + 1:]):
            return "obstacle"
    redo = {o["command"]: o["redo"] for o in obstacles}
    if any(c not in good and redo.get(c) not in good for c in meta.get("canonical", [])):
        return "stopped_early"
    return "other"


def summarise(episodes: Iterable[Episode], task_dirs: Mapping[str, str | Path | None]) -> dict[str, Any]:
    """Counts per category over the failed episodes, and their number (a task whose directory
    is unknown is classified without its metadata)."""
    counts = dict.fromkeys(CATEGORIES, 0)
    n = 0
    for ep in episodes:
        d = task_dirs.get(ep.task_id)
        cat = classify(ep, toy_metadata(str(d)) if d is not None else None)
        if cat is not None:
            counts[cat] += 1
            n += 1
    return {"n_failed": n, "counts": counts}

"""The fixed word lists every toy task draws its names from.

Small, fixed vocabularies are a design choice for the tiny models of the CPU recipe: each word
is frequent in the pretraining corpus, so a byte-level BPE of ~1-2k tokens learns it as one
token, and solving a task is mostly copying names from the instruction into the command.
Held-out instances use new *combinations* of these words, never new words.

``NamePool`` hands out words without repetition inside one task, so two steps of a task never
touch the same file by accident.
"""

from __future__ import annotations

import random

FILES = ("cat", "dog", "fox", "owl", "bee", "ant", "cow", "pig", "hen", "elk", "yak", "bat",
         "rat", "emu", "cod", "ape")
"""File stems: ``cat.txt``, ``dog.sh``, ``fox.tar`` ..."""

DIRS = ("red", "blue", "green", "gold", "pink", "gray", "black", "white")
"""Directory names."""

FRUITS = ("apple", "berry", "lemon", "mango", "melon", "peach", "plum", "grape")
"""Words inside files: text lines, script messages, CSV cells, config values."""

TAGS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "theta", "kappa", "zeta", "iota")
"""Git commit messages, branch and tag names."""

KEYS = ("port", "host", "mode", "level", "user", "size")
"""Config keys (unseen family only)."""

MODES = ("600", "640", "700", "750", "755", "444", "400")
"""Octal permission modes used by the perms family (never 644: the files start at 644)."""


class Exhausted(ValueError):
    """A word list has no unused word left for this task (the step kind is skipped)."""


class NamePool:
    """Draws distinct words from the lists above for one task."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def take(self, words: tuple[str, ...]) -> str:
        free = [w for w in words if w not in self.used]
        if not free:
            raise Exhausted(f"word list {words[:3]}... exhausted: use fewer steps per task")
        w = self.rng.choice(free)
        self.used.add(w)
        return w

    def file(self) -> str:
        return self.take(FILES)

    def dir(self) -> str:
        return self.take(DIRS)

    def fruit(self) -> str:
        return self.take(FRUITS)

    def tag(self) -> str:
        return self.take(TAGS)

    def key(self) -> str:
        return self.take(KEYS)

"""Helpers shared by the family modules: file contents, check snippets, shell error texts.

Error texts are what GNU coreutils / bash / git print in the Debian sandbox when an input is
missing (the corpus uses them for its retry defect; ``{path}`` is the wrong name);
``bash: line 8:`` is where the sandbox's driver evals the first line of a block, the demonstrator's
one command (minirsi/env/sandbox/shell.py, toy_envs/corpus.py).
tests/test_toy_envs.py replays the corpus in a sandbox and compares every output.
"""

from __future__ import annotations

import random

from toy_envs.words import FRUITS

ERR = {
    "cp": ("cp: cannot stat '{path}': No such file or directory", 1),
    "mv": ("mv: cannot stat '{path}': No such file or directory", 1),
    "rm": ("rm: cannot remove '{path}': No such file or directory", 1),
    "cat": ("cat: {path}: No such file or directory", 1),
    "grep": ("grep: {path}: No such file or directory", 2),
    "sort": ("sort: cannot read: {path}: No such file or directory", 2),
    "head": ("head: cannot open '{path}' for reading: No such file or directory", 1),
    "tail": ("tail: cannot open '{path}' for reading: No such file or directory", 1),
    "redirect": ("bash: line 8: {path}: No such file or directory", 1),
    "sed": ("sed: can't read {path}: No such file or directory", 2),
    "chmod": ("chmod: cannot access '{path}': No such file or directory", 1),
    "tar_x": ("tar: {path}: Cannot open: No such file or directory\ntar: Error is not recoverable: exiting now", 2),
    "tar_c": ("tar: {path}: Cannot stat: No such file or directory\ntar: Exiting with failure status due to previous errors", 2),
    "bash": ("bash: {path}: No such file or directory", 127),
    "exec": ("bash: line 8: ./{path}: No such file or directory", 127),
    "gzip": ("gzip: {path}: No such file or directory", 1),
    "unzip": ("unzip:  cannot find or open {path}, {path}.zip or {path}.ZIP.", 9),
    "cut": ("cut: {path}: No such file or directory", 1),
    "awk": ("awk: fatal: cannot open file `{path}' for reading: No such file or directory", 2),
    "git_add": ("fatal: pathspec '{path}' did not match any files", 128),
    "git_rm": ("fatal: pathspec '{path}' did not match any files", 128),
}


def err(tool: str) -> dict:
    """Keyword arguments of ``Cmd`` for a command that fails like ``tool`` on a missing input."""
    text, code = ERR[tool]
    return {"error": text, "error_code": code}


def fruit_lines(rng: random.Random, n: int, must: str | None = None, dupes: bool = False) -> list[str]:
    """``n`` lines "fruit digit"; ``must`` appears on 1-3 lines (never all of them)."""
    others = [f for f in FRUITS if f != must]
    out = [f"{rng.choice(others)} {rng.randint(1, 9)}" for _ in range(n)]
    if must is not None:
        for i in rng.sample(range(n), rng.randint(1, min(3, n - 1))):
            out[i] = f"{must} {rng.randint(1, 9)}"
    if dupes:
        i, j = rng.sample(range(n), 2)
        out[j] = out[i]
    return out


def text(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def lit(x: object) -> str:
    """A Python literal for a check body."""
    return repr(x)

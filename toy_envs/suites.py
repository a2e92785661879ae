"""The toy suites and the rule that keeps training and evaluation instances apart.

Suites (default sizes; ``n`` overrides them; difficulties are cycled per family):

========  =====  ================================  ===========================================
suite     n      families                          difficulties (cycled per family)
========  =====  ================================  ===========================================
train     600    the 6 training families           easy, medium, hard x3 each + extreme per 10
core      144    the 6 training families           easy, medium, hard
hard      12     the 6 training families           extreme
long      4      the 6 training families           8-10 commands ("extreme", tag "long")
unseen    12     csv, config (never trained on)    easy, medium, hard
dev       720    the 6 training families           as core, but train-side keys (for the rates)
========  =====  ================================  ===========================================

Difficulty = number of canonical commands: easy 1, medium 2, hard 3-4, extreme 5-6, long 8-10
(an obstacle's fix is not counted). Core holds what a policy can move (1-4 commands, 48 tasks
of each difficulty; one Mean@3 figure's standard error is about 2 points); the 5-6 command
tasks are the ``hard`` suite. ``dev`` is not evaluated: toy_envs/obstacles.py's rates were
fixed from the demonstrator's analytic success on it.

Train / eval disjointness. Every instance of a training family is assigned to exactly one side
by a hash of its *content key*: the family and the sorted multiset of its steps (step kind,
drawn names and obstacle), so neither step order, nor the strict flag, nor the difficulty label
can move a task across. ``split_of(key) == "eval"`` for about a quarter of all keys; "train",
"dev" and the pretraining corpus (toy_envs/corpus.py) draw only "train" keys, "core", "hard"
and "long" draw only "eval" keys. The unseen families are never drawn by "train" or the corpus.

Departure from the paper: its suites are human-written benchmarks (Terminal-Bench 2.1, LHTB,
SWR100); these are generated stand-ins with the same roles and the same task layout.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from toy_envs.base import Instance, sample_instance, stable_hash, write_task
from toy_envs.families import FAMILIES, TRAIN_FAMILIES, UNSEEN_FAMILIES

EVAL_SHARE = 4
"""One key in EVAL_SHARE is held out for evaluation."""

N_CMDS = {"easy": (1, 1), "medium": (2, 2), "hard": (3, 4), "extreme": (5, 6), "long": (8, 10)}


@dataclass(frozen=True)
class SuiteSpec:
    name: str
    n: int
    families: tuple[str, ...]
    pattern: tuple[str, ...]
    """Difficulty slots cycled per family ("long" = 8-10 commands, labelled extreme)."""
    split: str
    """Which side of the train / eval split the instances come from."""
    strict_share: float = 0.3
    """Share of instances with the hygiene condition "Do not create any other files."."""
    description: str = ""


SUITES: dict[str, SuiteSpec] = {
    s.name: s
    for s in (
        SuiteSpec("train", 600, TRAIN_FAMILIES,
                  ("easy", "medium", "hard", "easy", "medium", "hard", "easy", "medium", "hard", "extreme"),
                  "train", description="training pool (RSR / RPR): 1-4 commands, a few of 5-6"),
        SuiteSpec("core", 144, TRAIN_FAMILIES, ("easy", "medium", "hard"), "eval",
                  description="held-out instances of the training families, 1-4 commands (like TB 2.1)"),
        SuiteSpec("hard", 12, TRAIN_FAMILIES, ("extreme",), "eval",
                  description="held-out instances of 5-6 commands"),
        SuiteSpec("long", 4, TRAIN_FAMILIES, ("long",), "eval", strict_share=0.5,
                  description="long-horizon held-out instances with many checks (like LHTB)"),
        SuiteSpec("unseen", 12, UNSEEN_FAMILIES, ("easy", "medium", "hard"), "eval",
                  description="families never trained on (like SWR100)"),
        SuiteSpec("dev", 720, TRAIN_FAMILIES, ("easy", "medium", "hard"), "train",
                  description="core-like train-side instances: what the obstacle rates were fixed on"),
    )
}


def list_suites() -> list[str]:
    return list(SUITES)


def content_key(key: tuple) -> tuple:
    """What makes two instances "the same task" for disjointness: family + sorted steps."""
    family, _difficulty, _strict, steps = key
    return (family, tuple(sorted(repr(s) for s in steps)))


def split_of(key: tuple) -> str:
    """"eval" for about 1 / EVAL_SHARE of instance keys, "train" for the rest."""
    return "eval" if stable_hash(content_key(key)) % EVAL_SHARE == 0 else "train"


def draw(family: str, difficulty: str, split: str, rng: random.Random, strict: bool,
         avoid: set | None = None, tags: tuple[str, ...] = ()) -> Instance:
    """One instance of ``family`` at ``difficulty`` whose key lies on ``split`` and whose
    content key is not in ``avoid`` (then added to it)."""
    lo, hi = N_CMDS[difficulty]
    label = "extreme" if difficulty == "long" else difficulty
    for _ in range(2000):
        try:
            inst = sample_instance(FAMILIES[family], label, rng.randint(lo, hi), rng, strict, tags)
        except ValueError:  # the word lists ran out for this draw of step kinds: draw again
            continue
        ck = content_key(inst.key)
        if (FAMILIES[family].unseen or split_of(inst.key) == split) and (avoid is None or ck not in avoid):
            if avoid is not None:
                avoid.add(ck)
            return inst
    raise ValueError(f"could not draw a new {split} instance of {family}/{difficulty}: ask for a smaller n")


def suite_instances(name: str, n: int | None = None, seed: int = 0) -> list[Instance]:
    """The instances of suite ``name`` (deterministic for ``seed``), without writing them."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; choose one of {list_suites()}")
    spec = SUITES[name]
    n = spec.n if n is None else n
    if n < 1:
        raise ValueError(f"suite {name}: n must be >= 1, got {n}")
    rng = random.Random(stable_hash(("suite", name, seed)))
    seen: set = set()
    out = []
    nf = len(spec.families)
    for i in range(n):
        family = spec.families[i % nf]
        difficulty = spec.pattern[(i // nf) % len(spec.pattern)]
        strict = rng.random() < spec.strict_share
        tags = ("long",) if difficulty == "long" else ()
        out.append(draw(family, difficulty, spec.split, rng, strict, seen, tags))
    return out


def clean_easy(n: int, seed: int = 0) -> list[Instance]:
    """``n`` held-out easy instances of the training families without an obstacle (families in
    turn): what a Base past the copy transition must solve (minirsi/run/pretrain.py)."""
    rng = random.Random(stable_hash(("clean_easy", seed)))
    seen: set = set()
    out: list[Instance] = []
    while len(out) < n:
        for _ in range(200):
            inst = draw(TRAIN_FAMILIES[len(out) % len(TRAIN_FAMILIES)], "easy", "eval", rng, False, seen)
            if all(s.obstacle is None for s in inst.steps):
                out.append(inst)
                break
        else:
            raise ValueError(f"clean_easy: could not draw {n} distinct instances; ask for fewer")
    return out


SAMPLES = {"core": 18, "hard": 2, "long": 1, "unseen": 4}
"""The committed samples (toy_envs/samples/<suite>/): the first n tasks of each suite, seed 0."""


def write_samples(root: str | Path) -> list[Path]:
    """Regenerate toy_envs/samples (``python -m toy_envs samples toy_envs/samples``)."""
    return [p for name, n in SAMPLES.items() for p in generate_suite(name, Path(root) / name, n=n, seed=0)]


def generate_suite(name: str, out_dir: str | Path, n: int | None = None, seed: int = 0) -> list[Path]:
    """Write suite ``name`` as Harbor task directories under ``out_dir``; returns their paths.

    Deterministic: the same (name, n, seed) writes the same bytes, and the first k tasks of a
    suite do not depend on n (a smaller n is a prefix of a larger one).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [write_task(inst, out) for inst in suite_instances(name, n, seed)]

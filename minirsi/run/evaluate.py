"""Mean@k evaluation of a checkpoint on task suites (docs/method.md section 7).

For a suite of tasks T, each task t is attempted k times (k = 3, fresh sandbox each time) and
S_{t,i} in {0, 1} is the verifier's strict outcome of attempt i. Then

    Mean@k(T)            = (1 / |T|) * sum_t (1 / k) * sum_i S_{t,i}
    Mean@k(T, d)         = the same over the tasks of difficulty d  (easy/medium/hard/extreme)
    process_reward(T)    = mean over all attempts of P / C          (long-horizon suites)
    strict_completion(T) = number of tasks whose attempts pass the gate in a majority (>= k/2)

``stderr`` is the standard error of Mean@k over tasks, sqrt(var(task scores) / n_tasks) (the
task-to-task spread, the larger part of the noise here); ``failures`` sorts the failed episodes
into minirsi/run/failures.py's categories.

P / C are the passed and total non-hygiene checks (docs/method.md section 1). Strict completion is a
count of tasks, as the paper reports LHTB (0/46 -> 5/46); the paper does not say how it folds
3 samples into one completion per task, so "a majority of the k attempts" is our choice.

Result of ``evaluate`` (also the per-stage entry of a run's ``results.json``)::

    {"core": {"mean_at_3": 0.41, "stderr": 0.03, "n_tasks": 24, "n_episodes": 72,
              "by_difficulty": {"easy": 0.6, "medium": 0.3},
              "mean_passed_fraction": 0.55, "mean_turns": 3.1,
              "failures": {"n_failed": 42, "counts": {"obstacle": 30, ...}}},
     "long": {..., "process_reward": 0.37, "strict_completion": {"completed": 2, "tasks": 6}}}

Run it on any checkpoint (the toy suites are generated into ``--tasks`` when it is empty)::

    minirsi eval --model runs/toy/stages/05-rpr2/actor --suites core,hard,long,unseen --k 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from minirsi.core.episode import Episode
from minirsi.run import failures
from minirsi.run.report import difficulty_order

logger = logging.getLogger(__name__)

LONG_SUITES = ("long",)
"""Suites that also report process reward and strict completion (the paper's LHTB)."""


def summarise(episodes: Sequence[Episode], k: int, long_horizon: bool = False) -> dict[str, Any]:
    """Fold one suite's episodes (k per task) into Mean@k and its breakdowns.

    Tasks are grouped by ``task_id``; a task's score is the mean success of its attempts, so a
    task that got fewer than k attempts (a crashed sandbox) still counts once, with what it has.
    """
    if not episodes:
        raise ValueError("summarise: no episodes to score; did the rollout produce any?")
    by_task = _by_task(episodes)
    task_score = _task_scores(by_task)
    by_diff: dict[str, list[float]] = defaultdict(list)
    for t, eps in by_task.items():
        by_diff[eps[0].difficulty].append(task_score[t])
    order = difficulty_order(by_diff)
    mean, stderr = _mean_and_stderr(list(task_score.values()))
    out: dict[str, Any] = {
        f"mean_at_{k}": mean,
        "stderr": stderr,
        "n_tasks": len(by_task),
        "n_episodes": len(episodes),
        "by_difficulty": {d: _mean(by_diff[d]) for d in order},
        "n_by_difficulty": {d: len(by_diff[d]) for d in order},
        "mean_passed_fraction": _mean(e.passed / e.total if e.total else 0.0 for e in episodes),
        "mean_turns": _mean(e.turns for e in episodes),
    }
    if long_horizon:
        out["process_reward"] = out["mean_passed_fraction"]
        completed = sum(
            1 for eps in by_task.values() if sum(e.success for e in eps) * 2 >= len(eps) and any(e.success for e in eps)
        )
        out["strict_completion"] = {"completed": completed, "tasks": len(by_task)}
    return out


def paired(before: Sequence[Episode], after: Sequence[Episode]) -> dict[str, float]:
    """The change in Mean@k from ``before`` to ``after``, two evaluations of the same tasks with
    the same sampling seeds (common random numbers), and its standard error from the per-task
    differences d_t = score_after(t) - score_before(t): sqrt(var(d) / n). Pairing removes the
    task-to-task spread both share, so this error is smaller than either figure's ``stderr``.
    Tasks missing from either side are an error: a paired difference needs both."""
    a, b = _task_scores(_by_task(before)), _task_scores(_by_task(after))
    if set(a) != set(b) or not a:
        raise ValueError(f"paired: the two evaluations cover different tasks ({len(set(a) ^ set(b))} differ, "
                         f"{len(a)} vs {len(b)}); evaluate both checkpoints on the same suite")
    d = [b[t] - a[t] for t in sorted(a)]
    mean, stderr = _mean_and_stderr(d)
    return {"diff": mean, "stderr": stderr, "n_tasks": len(d)}


def paired_by(before: Sequence[Episode], after: Sequence[Episode],
              groups: Mapping[str, Callable[[str], bool]]) -> dict[str, dict[str, float]]:
    """``paired`` on subsets of the tasks: ``groups`` maps a name to a predicate on ``task_id``
    (e.g. a difficulty, or "the SFT set holds a rewrite of it"). Each row adds both sides'
    success rates over their episodes (``before``, ``after``); a group no task falls in is left
    out."""
    out = {}
    for name, keep in groups.items():
        b = [e for e in before if keep(e.task_id)]
        a = [e for e in after if keep(e.task_id)]
        if b or a:
            out[name] = {"before": _mean(e.success for e in b), "after": _mean(e.success for e in a),
                         **paired(b, a)}
    return out


def evaluate(
    actor: Any,
    tokenizer: Any,
    suites: Mapping[str, Sequence[Any]],
    k: int = 3,
    rollout_cfg: Any = None,
    out_dir: str | Path | None = None,
    seed: int = 0,
    long_suites: Sequence[str] = LONG_SUITES,
    sampler: Any = None,
) -> dict[str, dict[str, Any]]:
    """Roll the actor out k times on every task of every suite and score it.

    Args:
        actor: a causal LM (``models.load_actor``); sampled through ``sampler.HFSampler``
            unless ``sampler`` is given (then it may be None).
        tokenizer: its tokenizer.
        suites: suite name -> list of ``tasks.Task``.
        k: attempts per task (Mean@k).
        rollout_cfg: a ``rollout.RolloutConfig`` (turn limit, temperature, ...); default one if None.
        out_dir: when given, each suite's episodes are written to ``out_dir/<suite>.jsonl``
            (what ``minirsi audit`` rescores).
        seed: sampling seed (the same for every checkpoint: common random numbers).
        long_suites: suites that also report process reward and strict completion.
        sampler: sample with this instead (inference servers holding the actor's weights:
            ``weight_sync.WeightSync.sampler`` after a push).
    Returns:
        suite -> the dict ``summarise`` returns.
    """
    from minirsi.core.episode import write_jsonl
    from minirsi.engine import rollout
    from minirsi.engine.sampler import HFSampler

    if k < 1:
        raise ValueError(f"k={k}: Mean@k needs at least one attempt per task, e.g. k=3")
    for name, tasks in suites.items():
        if not tasks:
            raise ValueError(f"evaluate: suite '{name}' has no tasks; check its task directory")
    cfg = rollout_cfg if rollout_cfg is not None else rollout.RolloutConfig()
    # One collect call over every suite, k entries per task: the generation batch stays full
    # (``cfg.concurrency`` episodes live) instead of draining at the end of each small suite.
    entries = [(name, t) for name, tasks in suites.items() for t in tasks for _ in range(k)]
    was_training = getattr(actor, "training", False)
    if actor is not None:
        actor.eval()
    try:
        episodes = rollout.collect([t for _, t in entries], sampler or HFSampler(actor, tokenizer), tokenizer,
                                   dataclasses.replace(cfg, seed=seed))
    finally:
        if was_training:
            actor.train()
    results: dict[str, dict[str, Any]] = {}
    for name in suites:
        eps = [ep for (suite, _), ep in zip(entries, episodes) if suite == name]
        if out_dir is not None:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            write_jsonl(eps, Path(out_dir) / f"{name}.jsonl")  # what `minirsi audit --eval` rescores
        results[name] = summarise(eps, k, long_horizon=name in long_suites)
        results[name]["failures"] = failures.summarise(eps, {t.task_id: getattr(t, "path", None) for t in suites[name]})
        logger.info("eval %s: Mean@%d = %.3f over %d tasks", name, k, results[name][f"mean_at_{k}"], len(suites[name]))
    return results


def load_suites(root: str | Path, names: Sequence[str]) -> dict[str, list[Any]]:
    """Load ``root/<name>/`` for each suite name; a missing or empty suite is an error."""
    return {name: load_suite(Path(root) / name) for name in names}


def load_suite(d: str | Path) -> list[Any]:
    """The tasks of one folder of task directories (a suite: its name is the folder's); a missing
    folder or one with no valid task is an error, an invalid task is skipped with a warning."""
    from minirsi.env.tasks import load_tasks

    d = Path(d)
    if not d.is_dir():
        raise ValueError(
            f"suite '{d.name}': no task directory {d}; generate the toy suites "
            f"(leave --tasks empty) or point --tasks at a directory with a '{d.name}/' folder"
        )
    tasks, errors = load_tasks(d)
    for err in errors:
        logger.warning("skipping a task of suite %s: %s", d.name, err)
    if not tasks:
        raise ValueError(f"suite '{d.name}': {d} holds no valid task ({len(errors)} rejected)")
    return tasks


def generate_toy_suites(root: str | Path, names: Sequence[str], sizes: Mapping[str, int] | None = None, seed: int = 0) -> None:
    """Write the toy suites ``names`` into ``root/<name>/`` (deterministic in ``seed``).

    A suite whose directory already holds a ``.complete`` marker is left alone; the marker is
    written after the last task, so a generation killed halfway is redone, not half-used.
    """
    import shutil

    import toy_envs

    for name in names:
        d = Path(root) / name
        if (d / ".complete").exists():
            continue
        if d.exists():
            shutil.rmtree(d)
        n = (sizes or {}).get(name)
        toy_envs.generate_suite(name, d, n=n, seed=seed)
        (d / ".complete").write_text("")


def _by_task(episodes: Sequence[Episode]) -> dict[str, list[Episode]]:
    by_task: dict[str, list[Episode]] = defaultdict(list)
    for ep in episodes:
        by_task[ep.task_id].append(ep)
    return by_task


def _task_scores(by_task: Mapping[str, Sequence[Episode]]) -> dict[str, float]:
    """A task's score: the mean success of its attempts."""
    return {t: sum(e.success for e in eps) / len(eps) for t, eps in by_task.items()}


def _mean_and_stderr(xs: Sequence[float]) -> tuple[float, float]:
    """The mean and its standard error sqrt(var / n), var with n - 1 (0 for a single value)."""
    mean = _mean(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0
    return mean, math.sqrt(var / len(xs))


def _mean(xs: Any) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else 0.0


def cli(argv: Sequence[str] | None = None, command: str = "eval") -> int:
    p = argparse.ArgumentParser(prog=f"minirsi {command}", description="Mean@k of a checkpoint on task suites.")
    p.add_argument("--model", required=True, help="a checkpoint directory (or a Hugging Face name)")
    p.add_argument("--suites", default="core,hard,long,unseen", help="comma-separated suite names")
    p.add_argument("--k", type=int, default=3, help="attempts per task (Mean@k)")
    p.add_argument("--tasks", default="", help="directory with one folder per suite (default: generate the toy suites)")
    p.add_argument("--n", type=int, default=None, help="toy tasks per suite when generating (default: the suite's own)")
    p.add_argument("--seed", type=int, default=0, help="toy suite seed when generating; sampling seed")
    p.add_argument("--max-turns", type=int, default=None, help="turn limit per episode")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default 1.0, as the recipe evaluates; 0 is greedy)")
    p.add_argument("--out", default="", help="write the results JSON here (a .json file; the episodes go in the folder "
                                             "of its name without .json)")
    args = p.parse_args(argv)
    if args.out and Path(args.out).suffix != ".json":
        # the episodes' folder is the name without its suffix: without one, the JSON could not be written
        print(f"minirsi {command}: --out {args.out!r} must name a .json file, e.g. --out {args.out.rstrip('/')}.json "
              "(the episodes then go in the folder beside it)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    from minirsi.engine import rollout
    from minirsi.engine.models import load_actor

    names = [s.strip() for s in args.suites.split(",") if s.strip()]
    try:
        root = Path(args.tasks) if args.tasks else Path(".cache") / f"toy-suites-seed{args.seed}-n{args.n}"
        if not args.tasks:
            generate_toy_suites(root, names, {n: args.n for n in names} if args.n else None, seed=args.seed)
        suites = load_suites(root, names)
        actor, tokenizer = load_actor(args.model)
        cfg = rollout.RolloutConfig()
        if args.max_turns is not None:
            cfg = dataclasses.replace(cfg, max_turns=args.max_turns)
        if args.temperature is not None:
            cfg = dataclasses.replace(cfg, temperature=args.temperature)
        out_dir = Path(args.out).with_suffix("") if args.out else None
        results = evaluate(actor, tokenizer, suites, k=args.k, rollout_cfg=cfg, out_dir=out_dir, seed=args.seed)
    except ValueError as e:
        print(f"minirsi {command}: {e}", file=sys.stderr)
        return 2
    text = json.dumps(results, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0

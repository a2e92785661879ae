"""The run directory: stage checkpoints, completion markers, resume, RNG state and metrics.

``recipe.py`` says which stages run and what each computes; this module runs a list of stages
(``run_stages``) so that an interrupted run can go on where it stopped. Its layout::

    RUN_DIR/run.lock            held by the live run (minirsi.run.runlock): a second run here is refused
    RUN_DIR/config.yaml         the full RunConfig (a resumed run must match it)
    RUN_DIR/calibration.json    FDR/SPR scales D_f, computed once from the train suite, frozen
    RUN_DIR/tasks/<suite>/      the generated toy suites (deterministic in suites.seed)
    RUN_DIR/stages/NN-name/     actor/, critic/, optimizer.pt (sharded: optimizer/), rng.pt, metrics.jsonl,
                                episodes*.jsonl, eval/<suite>.jsonl, eval.json, DONE.json
    RUN_DIR/journal/NN-name/    an unfinished RPR stage's episodes, one file per step (below)
    RUN_DIR/metrics.jsonl       every update of every stage: {"stage", "step", metric: value}
    RUN_DIR/tb/                 the same metrics for TensorBoard (offline)
    RUN_DIR/results.json        stage -> suite -> {"mean_at_3", "by_difficulty", ...}

Checkpoint protocol. A stage writes into ``stages/NN-name/`` and, last, ``DONE.json`` through
a temporary file and an atomic rename (``minirsi.core.atomic``); a stage directory without it is
incomplete. Its evaluation is a separate unit with its own marker ``eval.json`` (written the
same way), so a kill during evaluation keeps the trained stage. What a stage did not change
(an RSR stage's critic) passes through as hard links, so every stage directory holds the full
checkpoint the next stage starts from. ``--resume`` deletes incomplete stage directories,
drops their lines from ``metrics.jsonl``, and runs from the first stage that is not done:
whatever finished is kept. Within an RPR stage the unit is the episode: each step's episodes are
appended to ``journal/NN-name/rollout-<seed>.jsonl`` as they finish (``engine.rollout.make_rollout_fn``),
a directory the resume keeps, so the rerun stage replays its finished steps from their
episodes (the same updates, no sampling) and collects only the episodes that the interrupted
step had not finished (a kill, a full disk, an inference server that died with
``serving.on_server_failure=fail``); the journal goes once the stage is done.

Each stage seeds every RNG from (run seed, stage name), so a resumed run reproduces the stages
an uninterrupted run would have produced, bit for bit on one machine, whatever its load
(docs/experiments.md, "Load, machines and results"), except the episodes a resumed RPR step
collects again, which share a batch with other episodes than they would have; a continuation
branch instead restores the RNG and optimizer state its source stage saved, as if that stage
had simply run longer.

One run at a time: ``run_stages`` holds ``run.lock`` (an ``flock``, ``minirsi.run.runlock``) from
before it reads the directory until it returns, so a second ``minirsi run`` or ``--resume`` on a
live directory stops with an error naming the holder's PID instead of deleting the stage the
holder is writing; the kernel drops the lock when its holder dies, so a dead run's lock is taken
over.

Sharded runs (torchrun / accelerate launch, ``minirsi.core.distributed``): every rank trains every
stage; rank 0 alone owns the directory (the lock, markers, metrics, evaluation).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch
from tqdm import tqdm

from minirsi.config import ConfigError, load_config, save_config, to_dict
from minirsi.core import distributed
from minirsi.core.atomic import atomic_write_json, atomic_write_text
from minirsi.engine.models import torch_threads
from minirsi.run.config import RunConfig
from minirsi.run.runlock import LOCK_NAME, RunLock

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Stages, directories, markers, metrics, RNG state
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageSpec:
    """One stage of the plan and where its inputs come from."""

    index: int
    name: str
    """Key in results.json and metrics.jsonl: base, rsr1, warmup, rpr1, ..."""
    kind: str
    """base | rsr | warmup | rpr"""
    label: str
    """Paper name, for reports: Base, RSR-1, ..."""
    actor_from: str | None = None
    """Stage whose actor this stage starts from."""
    critic_from: str | None = None
    """Stage whose critic this stage starts from (None: a fresh critic where one is needed)."""
    config: Any = field(default=None, hash=False)
    """The stage's finished config (``RSRConfig``, ``WarmupConfig`` or ``RPRConfig``; None for
    Base), as ``recipe.plan`` made it: its seed, the warm-up's discount, an ablation's one change
    and a continuation's steps are already in it."""
    extra_steps: int = 0
    """Continuation branches: RPR steps added to the source stage (its optimizer and RNG go on)."""
    step_offset: int = 0
    """Continuation branches: the source stage's step count, where this stage's metrics go on."""
    retained: bool = True
    """One of the paper's five retained stages (False: a baseline branch)."""
    evaluate: bool = True
    """Evaluated with Mean@k after training (False: the warm-up, or not in eval.stages)."""

    @property
    def dirname(self) -> str:
        return f"{self.index:02d}-{self.name}"


class RunDir:
    """Paths and completion markers of one run directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.stages = self.root / "stages"
        self.journals = self.root / "journal"
        self.config = self.root / "config.yaml"
        self.calibration = self.root / "calibration.json"
        self.tasks = self.root / "tasks"
        self.metrics = self.root / "metrics.jsonl"
        self.results = self.root / "results.json"
        self.tb = self.root / "tb"

    def stage(self, spec: StageSpec) -> Path:
        return self.stages / spec.dirname

    def journal(self, spec: StageSpec) -> Path:
        """Where the stage's rollouts are journaled until it is done (the docstring above)."""
        return self.journals / spec.dirname

    def done(self, spec: StageSpec) -> dict | None:
        """The stage's DONE.json record, or None when it has not finished."""
        p = self.stage(spec) / "DONE.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def eval_done(self, spec: StageSpec) -> dict | None:
        p = self.stage(spec) / "eval.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def stage_by_name(self, plan_: Sequence[StageSpec], name: str) -> Path:
        return self.stage(next(s for s in plan_ if s.name == name))


class MetricsLog:
    """``log(step, metrics)`` for one stage: RUN_DIR/metrics.jsonl, the stage's own
    metrics.jsonl, and TensorBoard scalars ``<stage>/<metric>``."""

    def __init__(self, run: RunDir, spec: StageSpec, writer: Any = None):
        self.stage = spec.name
        self.files = [run.metrics, run.stage(spec) / "metrics.jsonl"]
        self.writer = writer

    def __call__(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"stage": self.stage, "step": int(step), "time": round(time.time(), 3)}
        # The driver's step wins over a "step" inside the metrics (a continuation numbers its
        # updates after its source stage's).
        record.update({k: _jsonable(v) for k, v in metrics.items() if k not in record})
        line = json.dumps(record) + "\n"
        for path in self.files:
            with path.open("a") as f:
                f.write(line)
        if self.writer is not None:
            for k, v in record.items():
                if k not in ("stage", "step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.writer.add_scalar(f"{self.stage}/{k}", v, int(step))


def drop_metrics_of(path: Path, stages: set[str]) -> int:
    """Remove the lines of ``stages`` from a metrics JSONL file (an interrupted stage's partial
    log, before it is rerun); returns the number of lines dropped. A torn last line goes too."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if rec.get("stage") in stages:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        atomic_write_text(path, "".join(x + "\n" for x in kept))
    return dropped


def stage_seed(run_seed: int, name: str) -> int:
    """A stage's seed from (run seed, stage name): a resumed stage draws what it drew the first time."""
    return int.from_bytes(hashlib.sha256(f"{run_seed}:{name}".encode()).digest()[:4], "little") & 0x7FFFFFFF


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global RNGs."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def save_rng(path: Path) -> None:
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}, path)


def load_rng(path: Path) -> None:
    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def link_tree(src: Path, dst: Path) -> None:
    """Copy a checkpoint directory as hard links (no extra disk, bit-identical by construction);
    falls back to a real copy across file systems."""
    try:
        shutil.copytree(src, dst, copy_function=os.link)
    except OSError:
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(src, dst)


def _jsonable(v: Any) -> Any:
    """A metric value as strict JSON: tensors and numpy scalars unwrapped, NaN/inf as null."""
    if isinstance(v, torch.Tensor):
        v = v.item() if v.numel() == 1 else v.tolist()
    elif hasattr(v, "item") and callable(v.item):  # numpy scalar
        v = v.item()
    if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
        return None
    return v


ADDABLE_BRANCHES = ("baselines.direct_ppo", "baselines.critic_reset", "baselines.token_gae",
                    "baselines.continue_rpr1", "baselines.continue_rpr2")
"""Config keys a ``--resume`` may switch on (off / 0 in the run's config): they add baseline
branches beside the finished stages (``minirsi run --resume RUN baselines.token_gae=true``)."""


def _get(d: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part, {}) if isinstance(d, dict) else {}
    return d if d != {} else None


def config_diff(saved: dict, now: dict, prefix: str = "") -> list[str]:
    """Human-readable differences between two nested config dicts, one line per key."""
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key, "<absent>"), now.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} in the run's config.yaml, {b!r} now")
    return out


@dataclass
class StageInputs:
    """Checkpoint paths a stage starts from (None where the plan gives none)."""

    actor: Path | None
    critic: Path | None
    optimizer: Path | None
    rng: Path | None


class Runner(Protocol):
    """What ``run_stages`` asks of the code that trains and evaluates.

    ``run_stages`` owns ordering, directories, markers, seeding and logging; a Runner only
    computes. ``RecipeRunner`` is the real one; tests inject a fast fake.
    """

    def setup(self, cfg: RunConfig, run: RunDir) -> None:
        """Make the task suites and the frozen calibration exist (idempotent)."""

    def train(self, cfg: RunConfig, run: RunDir, spec: StageSpec, inputs: StageInputs, out: Path,
              log: Callable[[int, dict], None]) -> dict:
        """Run one stage; write ``out/actor`` (and ``out/critic``, ``out/optimizer.pt`` where it
        has them); return the stage's summary statistics."""

    def evaluate(self, cfg: RunConfig, run: RunDir, spec: StageSpec, actor: Path, out: Path) -> dict:
        """Mean@k of ``actor`` on ``cfg.eval.suites``; episodes go under ``out``."""


# ----------------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------------


class RunError(RuntimeError):
    """A run stopped; the message says why and how to resume it."""


def run_stages(cfg: RunConfig, run_dir: str | Path, stages: Sequence[StageSpec], runner: Runner,
               resume: bool = False, tensorboard: bool = True) -> dict:
    """Run (or, with ``resume``, continue) ``stages`` in ``run_dir``; returns results.json's dict.

    Raises:
        ConfigError: ``resume`` with a config that differs from the run's (every difference
            is listed), or a new run into a directory that already holds one.
        RunError: a stage failed (disk full, a dead sandbox, ...); finished stages are kept
            and the message gives the ``--resume`` command.
        RunDirBusy: another live process holds the directory's lock (``minirsi.run.runlock``);
            nothing was read or changed.
    """
    run_ = RunDir(run_dir)
    world = distributed.current()  # torchrun / accelerate: rank 0 owns the run directory
    held: list[RunLock] = []  # rank 0's lock on the directory, until this function returns

    def prepare() -> list[str]:
        if resume and not run_.config.is_file():  # before the lock would create the directory
            raise ConfigError(f"--resume {run_.root}: no config.yaml there, so it is not a minirsi run "
                              f"directory; start a new run with --out {run_.root}")
        held.append(RunLock.acquire(run_.root))  # RunDirBusy, naming the holder, while another run lives
        _prepare_dir(cfg, run_, resume)
        _check_finished_in_plan(run_, stages)
        return _drop_incomplete(run_, stages)

    try:
        kept = _on_main(world, prepare)
        with torch_threads(cfg.threads):  # the caller's thread count back after the run, as after a rollout
            return _run_locked(cfg, run_, stages, runner, resume, tensorboard, kept)
    finally:
        for lock in held:
            lock.release()


def _run_locked(cfg: RunConfig, run_: RunDir, stages: Sequence[StageSpec], runner: Runner, resume: bool,
                tensorboard: bool, kept: list[str]) -> dict:
    """``run_stages`` once the directory is locked and prepared."""
    world = distributed.current()
    if resume:
        logger.info("resuming %s: %d finished stages kept (%s)", run_.root, len(kept), ", ".join(kept) or "none")
    writer = _tb_writer(run_) if tensorboard and world.is_main else None
    current = "setup"
    try:
        _on_main(world, lambda: runner.setup(cfg, run_))
        for spec in _progress(stages) if world.is_main else stages:
            current = spec.dirname
            if run_.done(spec) is None:
                _train_stage(cfg, run_, runner, stages, spec, writer)
            if spec.evaluate and run_.eval_done(spec) is None:  # every rank (a sharded evaluation), rank 0 writes
                _eval_stage(cfg, run_, runner, spec)
                _on_main(world, lambda: write_results(run_, stages))
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise RunError(
                f"disk full during {current} in {run_.root} ({e}). Free space, then run "
                f"`minirsi run --resume {run_.root}`: every finished stage is kept."
            ) from e
        raise RunError(_failure(run_, current, e)) from e
    except RuntimeError as e:  # SandboxError and other runtime failures of a stage
        raise RunError(_failure(run_, current, e)) from e
    finally:
        if writer is not None:
            writer.close()
    return _on_main(world, lambda: write_results(run_, stages))


def _on_main(world: distributed.World, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0 (every rank at world size 1), its result or its exception on every
    rank: a ConfigError on rank 0 stops all ranks instead of leaving them at a barrier
    (``World.on_main``)."""
    return world.on_main(fn)


def _failure(run_: RunDir, where: str, e: BaseException) -> str:
    return (f"{where} failed: {type(e).__name__}: {e}. Finished stages are kept in {run_.stages}; "
            f"fix the cause, then run `minirsi run --resume {run_.root}`.")


def _prepare_dir(cfg: RunConfig, run_: RunDir, resume: bool) -> None:
    now = to_dict(cfg)
    if resume:
        # Through load_config, so a field added since the run started reads as its default on both
        # sides (a run from before serving.* or rpr*.tis_cap existed still resumes).
        saved = to_dict(load_config(type(cfg), run_.config))
        added = [k for k in ADDABLE_BRANCHES if not _get(saved, k) and _get(now, k)]
        diff = [d for d in config_diff(saved, now) if d.split(":")[0] not in added]
        if saved["serving"]["servers"] and now["serving"]["servers"]:  # this job's servers: new URLs in every
            diff = [d for d in diff if not d.startswith("serving.servers:")]  # SLURM job, the same computation
        if diff:
            raise ConfigError(
                f"--resume {run_.root}: the config differs from the one the run started with:\n  "
                + "\n  ".join(diff)
                + "\nResume without overrides (the run's config.yaml is used), add a branch (one of "
                + ", ".join(f"{k}=..." for k in ADDABLE_BRANCHES) + "), or start a new run with --out."
            )
        if added:  # branches beside the finished stages: the run's config now has them too
            logger.info("resume adds the branches %s", ", ".join(added))
            save_config(cfg, run_.config)
        return
    if any(p.name != LOCK_NAME for p in run_.root.iterdir()):
        raise ConfigError(f"{run_.root} already holds a run; continue it with `minirsi run --resume "
                          f"{run_.root}` or pick a new --out directory")
    run_.stages.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_.config)


def _check_finished_in_plan(run_: RunDir, stages: Sequence[StageSpec]) -> None:
    """A finished stage whose directory the plan no longer names (a branch added on resume
    before it in plan order would renumber it) is refused rather than silently redone."""
    names = {run_.stage(s).name for s in stages}
    orphans = [d for d in (p.parent.name for p in run_.stages.glob("*/DONE.json")) if d not in names]
    if orphans:
        raise ConfigError(f"{run_.root}: finished stages {sorted(orphans)} are not in this run's plan (a branch "
                          f"added on resume would renumber them); start a new run with --out instead")


def _drop_incomplete(run_: RunDir, stages: Sequence[StageSpec]) -> list[str]:
    """Delete what an interrupted stage left behind; return the names of finished stages."""
    finished, unfinished = [], set()
    for spec in stages:
        d = run_.stage(spec)
        if run_.done(spec) is not None:
            finished.append(spec.name)
            shutil.rmtree(run_.journal(spec), ignore_errors=True)  # killed between DONE.json and its removal
            if spec.evaluate and run_.eval_done(spec) is None and (d / "eval").exists():
                shutil.rmtree(d / "eval")  # a half-written evaluation is redone
            continue
        unfinished.add(spec.name)
        if d.exists():
            logger.info("removing the unfinished stage %s", d)
            shutil.rmtree(d)
        if run_.journal(spec).is_dir():
            logger.info("keeping the journaled episodes of %s in %s", spec.dirname, run_.journal(spec))
    drop_metrics_of(run_.metrics, unfinished)
    return finished


def _train_stage(cfg: RunConfig, run_: RunDir, runner: Runner, stages: Sequence[StageSpec],
                 spec: StageSpec, writer: Any) -> None:
    src = {s.name: run_.stage(s) for s in stages}
    actor_dir = src[spec.actor_from] if spec.actor_from else None
    critic_dir = src[spec.critic_from] if spec.critic_from else None
    inputs = StageInputs(
        actor=actor_dir / "actor" if actor_dir else None,
        critic=critic_dir / "critic" if critic_dir and (critic_dir / "critic").exists() else None,
        optimizer=actor_dir / "optimizer.pt" if spec.extra_steps and actor_dir else None,
        rng=actor_dir / "rng.pt" if spec.extra_steps and actor_dir else None,
    )
    if inputs.rng is not None and inputs.rng.is_file():
        load_rng(inputs.rng)  # a continuation goes on as if its source stage had run longer
    else:
        seed_everything(stage_seed(cfg.seed, spec.name))
    world = distributed.current()
    if not world.is_main:
        # Every rank trains (same seeds, inputs, collectives); only rank 0 writes the stage
        # directory. A rank's own writes (episode logs) go to a scratch directory, then away.
        with tempfile.TemporaryDirectory(prefix=f"minirsi-rank{world.rank}-") as scratch:
            runner.train(cfg, run_, spec, inputs, Path(scratch), lambda step, metrics: None)
        world.barrier()
        return
    out = run_.stage(spec)
    out.mkdir(parents=True)
    logger.info("stage %s (%s) starts", spec.dirname, spec.label)
    t0 = time.time()
    stats = runner.train(cfg, run_, spec, inputs, out, MetricsLog(run_, spec, writer))
    # Whatever the stage did not change passes through as hard links, so every stage directory
    # holds the full checkpoint (an RSR stage's critic is its input, bit for bit).
    for name, path in (("actor", inputs.actor), ("critic", inputs.critic)):
        if path is not None and not (out / name).exists():
            link_tree(path, out / name)
    save_rng(out / "rng.pt")
    record = {"stage": spec.name, "label": spec.label, "kind": spec.kind, "retained": spec.retained,
              "actor_from": spec.actor_from, "critic_from": spec.critic_from, "extra_steps": spec.extra_steps,
              "wall_s": round(time.time() - t0, 2), "stats": {k: _jsonable(v) for k, v in (stats or {}).items()}}
    atomic_write_json(out / "DONE.json", record)  # last: the stage is finished once this exists
    shutil.rmtree(run_.journal(spec), ignore_errors=True)  # its episodes are in the stage's episodes.jsonl
    logger.info("stage %s done in %.0f s", spec.dirname, record["wall_s"])
    world.barrier()


def _eval_stage(cfg: RunConfig, run_: RunDir, runner: Runner, spec: StageSpec) -> None:
    """Every rank calls ``runner.evaluate`` (it may load the actor sharded); rank 0 alone writes
    the stage's eval/ and eval.json, the others' episode files go to a scratch directory."""
    d = run_.stage(spec)
    out = d / "eval"
    world = distributed.current()
    seed_everything(stage_seed(cfg.seed, f"eval:{spec.name}"))
    if not world.is_main:
        with tempfile.TemporaryDirectory(prefix=f"minirsi-rank{world.rank}-eval-") as scratch:
            runner.evaluate(cfg, run_, spec, d / "actor", Path(scratch))
        return
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    t0 = time.time()
    results = runner.evaluate(cfg, run_, spec, d / "actor", out)
    atomic_write_json(d / "eval.json", {"results": results, "wall_s": round(time.time() - t0, 2)})
    core = results.get("core", {}).get(f"mean_at_{cfg.eval.k}")
    logger.info("stage %s evaluated in %.0f s%s", spec.dirname, time.time() - t0,
                f" (core Mean@{cfg.eval.k} = {core:.3f})" if core is not None else "")


def write_results(run_: RunDir, stages: Sequence[StageSpec]) -> dict:
    """results.json: stage -> suite -> metrics, for every evaluated stage, in plan order."""
    results = {}
    for spec in stages:
        rec = run_.eval_done(spec) if spec.evaluate else None
        if rec is not None:
            results[spec.name] = rec["results"]
    atomic_write_json(run_.results, results)
    return results


def _tb_writer(run_: RunDir) -> Any:
    from torch.utils.tensorboard import SummaryWriter  # here: its import is slow, and only a logging run pays it

    return SummaryWriter(log_dir=str(run_.tb))


def _progress(stages: Sequence[StageSpec]) -> Iterator[StageSpec]:
    bar = tqdm(stages, desc="recipe", unit="stage", leave=True)
    for spec in bar:
        bar.set_postfix_str(spec.label)
        yield spec

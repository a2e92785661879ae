"""The recipe: Base -> RSR-1 -> Warm-up -> RPR-1 -> RSR-2 -> RPR-2, checkpointed and evaluated.

METHOD.md section 7. One command runs the paper's five retained stages on the toy suites,
each stage with its own learning rates, and evaluates every stage on every suite::

    minirsi run                                   # preset toy-cpu, run dir runs/toy-cpu
    minirsi run --preset smoke --out runs/ci      # the CI-sized run
    minirsi run rpr1.lr_actor=5e-4 baselines.continue_rpr1=4     # key=value overrides
    minirsi run --resume runs/toy-cpu             # continue an interrupted run
    minirsi run serving.servers=[http://h1:8000,http://h2:8000]  # RPR samples on vLLM servers,
                                                  # synced after every update (scale/README.md)

The stage plan (``plan``), with where each stage's actor and critic come from::

    00-base        pretrain the tiny model (or load base.model)     actor
    01-rsr1        RSR on Base                                       actor            critic: none
    02-warmup      Warm-up Critic Model on rollouts of frozen RSR-1  critic <- new from RSR-1
    03-rpr1        RPR: actor RSR-1, critic Warm-up                  actor + critic
    04-rsr2        RSR on RPR-1; the critic passes through untouched
    05-rpr2        RPR: actor RSR-2, critic RPR-1 (inherited)        actor + critic
    06-direct_ppo         baseline: RPR on Base with a fresh critic, RPR-1's steps and config
    07-rpr2_critic_reset  ablation: RPR-2 with a fresh critic instead of RPR-1's (baselines.critic_reset)
    08-rpr1_token_gae     ablation: RPR-1 with per-token GAE instead of TB-GAE (baselines.token_gae)
    09-rpr1_cont          baseline: RPR-1 continued for more steps (its optimizer and RNG state)
    10-rpr2_cont          baseline: RPR-2 continued
(the numbers of the optional ones shift down when a branch before them is off)

The run directory::

    RUN_DIR/config.yaml         the full RunConfig (a resumed run must match it)
    RUN_DIR/calibration.json    FDR/SPR scales D_f, computed once from the train suite, frozen
    RUN_DIR/tasks/<suite>/      the generated toy suites (deterministic in suites.seed)
    RUN_DIR/stages/NN-name/     actor/, critic/, optimizer.pt, rng.pt, metrics.jsonl,
                                episodes*.jsonl, eval/<suite>.jsonl, eval.json, DONE.json
    RUN_DIR/metrics.jsonl       every update of every stage: {"stage", "step", metric: value}
    RUN_DIR/tb/                 the same metrics for TensorBoard (offline)
    RUN_DIR/results.json        stage -> suite -> {"mean_at_3", "by_difficulty", ...}

Checkpoint protocol. A stage writes into ``stages/NN-name/`` and, last, ``DONE.json`` through
a temporary file and an atomic rename; a stage directory without it is incomplete. Its
evaluation is a separate unit with its own marker ``eval.json`` (written the same way), so a
kill during evaluation keeps the trained stage. ``--resume`` deletes incomplete stage
directories, drops their lines from ``metrics.jsonl``, and runs from the first stage that is
not done: whatever finished is kept. Each stage seeds every RNG from (run seed, stage name),
so a resumed run reproduces the stages an uninterrupted run would have produced (up to the
non-determinism of concurrent sandboxes); a continuation branch instead restores the RNG and
optimizer state its source stage saved, as if that stage had simply run longer.

Departures from the paper: the stages run on toy tasks with a ~1M-parameter model; "steps"
are PPO iterations of a few dozen episodes, not the paper's large batches; Direct PPO uses
RPR-1's config (learning rates included) so that the comparison is at equal steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import hashlib
import json
import logging
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from minirsi import distributed
from minirsi.config import ConfigError, load_config, save_config, to_dict

logger = logging.getLogger(__name__)

PRESETS_DIR = Path(__file__).parent / "presets"
SUITES = ("train", "core", "hard", "long", "unseen")
"""The toy suites: ``train`` is the training pool, the others are held out."""
EVALUATED = ("base", "rsr1", "rpr1", "rsr2", "rpr2", "direct_ppo", "rpr2_critic_reset", "rpr1_token_gae",
             "rpr1_cont", "rpr2_cont")
"""Stages that can be evaluated (the warm-up trains only the critic)."""

# Imported after the stdlib so a missing sibling module fails with its own name.
from minirsi.critic import WarmupConfig  # noqa: E402
from minirsi.memplan import ScaleConfig  # noqa: E402
from minirsi.models import LoraRecipe  # noqa: E402
from minirsi.pretrain import PretrainConfig  # noqa: E402
from minirsi.rollout import RolloutConfig  # noqa: E402
from minirsi.rpr import RPRConfig  # noqa: E402
from minirsi.rsr import RSRConfig  # noqa: E402


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


@dataclass
class SuitesConfig:
    """Where the tasks come from."""

    root: str = ""
    """A directory with one folder per suite (``train/``, ``core/``, ...); "" generates the toy
    suites into ``RUN_DIR/tasks``."""
    seed: int = 0
    """Seed of the toy suite generator (held-out instances differ from the training pool)."""
    train: int = 48
    """Training-pool tasks (RSR sampling, warm-up, RPR rollouts; FDR calibration)."""
    core: int = 24
    """Held-out instances of the training families: the suite the targets are measured on."""
    hard: int = 8
    """Harder variants of the training families."""
    long: int = 6
    """Long-horizon tasks with many checks (process reward and strict completion)."""
    unseen: int = 8
    """Families never used in training."""

    def __post_init__(self) -> None:
        for name in SUITES:
            if getattr(self, name) < 1:
                raise ValueError(f"suites.{name}={getattr(self, name)}: a suite needs at least 1 task")

    def size(self, suite: str) -> int:
        return int(getattr(self, suite))


@dataclass
class BaseConfig:
    """Stage 0: the Base model."""

    model: str = ""
    """A Hugging Face name or checkpoint directory to start from; "" pretrains the tiny model
    with ``pretrain`` (``minirsi pretrain``)."""
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    """Pretraining of the tiny Base model (used when ``model`` is "")."""
    cache_dir: str = ""
    """When set, a pretrained Base is kept in ``cache_dir/<hash of the pretrain config>/`` and
    reused by later runs with the same pretrain config (the smoke preset sets it, so CI
    pretrains once); "" pretrains in every run."""


@dataclass
class BaselinesConfig:
    """Branches recorded beside the retained stages (never discarded)."""

    direct_ppo: bool = True
    """Direct PPO: RPR from Base with a fresh critic, RPR-1's config and number of steps."""
    critic_reset: bool = False
    """Ablation: RPR-2 from RSR-2 with a fresh critic (built from the actor, zero head) instead of
    the inherited one; RPR-2's config and steps."""
    token_gae: bool = False
    """Ablation: RPR-1 from RSR-1 and the warmed-up critic with plain per-token GAE instead of
    TB-GAE (``RPRConfig.advantage = "token_gae"``); RPR-1's config and steps."""
    continue_rpr1: int = 0
    """Extra RPR steps for a continuation branch of RPR-1 (0: no branch)."""
    continue_rpr2: int = 0
    """Extra RPR steps for a continuation branch of RPR-2 (0: no branch)."""

    def __post_init__(self) -> None:
        for name in ("continue_rpr1", "continue_rpr2"):
            if getattr(self, name) < 0:
                raise ValueError(f"baselines.{name}={getattr(self, name)}: use 0 (no branch) or a step count")


@dataclass
class EvalConfig:
    """Mean@k evaluation of every stage."""

    suites: list[str] = field(default_factory=lambda: ["core", "hard", "long", "unseen"])
    """Suites every stage is evaluated on."""
    k: int = 3
    """Attempts per task (Mean@3 in the paper)."""
    stages: list[str] = field(default_factory=list)
    """Stages to evaluate (names as in results.json); empty: every stage (the recipe's default;
    the CI smoke preset evaluates only Base and the final stage to fit its budget)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Turn limit, temperature, concurrency of evaluation episodes."""

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"eval.k={self.k}: Mean@k needs k >= 1, e.g. eval.k=3")
        bad = [s for s in self.stages if s not in EVALUATED]
        if bad:
            raise ValueError(f"eval.stages has {bad}; choose from {list(EVALUATED)} (or [] for all)")
        bad = [s for s in self.suites if s not in SUITES or s == "train"]
        if bad:
            raise ValueError(f"eval.suites has {bad}; choose from {[s for s in SUITES if s != 'train']}")
        if not self.suites:
            raise ValueError("eval.suites is empty; name at least one, e.g. eval.suites=[core]")


@dataclass
class ServingConfig:
    """Where RPR samples its rollouts: in this process (default) or on inference servers."""

    servers: list[str] = field(default_factory=list)
    """Base URLs of OpenAI-compatible servers (``scale/serve_vllm.sh``, or ``minirsi serve``
    for tests), all started on a checkpoint of the actor's architecture; empty: in-process
    ``HFSampler``. The RPR stages sample there, each episode pinned to one server, and push
    the actor to every server before their first rollout and after every update
    (``minirsi.weight_sync``, full weights); RSR, the warm-up and evaluation sample in-process."""
    model_name: str = "policy"
    """The name the servers serve (``--served-model-name``)."""
    sync_dir: str = ""
    """Where weights are written for the servers to read (shared storage across nodes);
    "" is RUN_DIR/weights."""
    on_server_failure: str = "fail"
    """A server that stops answering mid-step: "fail" stops the run naming it; "retry" moves
    its episodes to the servers still up and leaves it out from then on."""
    timeout: float = 600.0
    """Seconds for one request (a generation batch, or a reload)."""
    max_retries: int = 3
    """Retries of a request that met a connection error, a timeout or a 5xx."""
    verify_tol: float = 0.0
    """> 0: after each sync, every server's log-probs of a probe sequence must match the
    trainer's within this (``WeightSync``); 0: no check."""

    def __post_init__(self) -> None:
        from minirsi.sampler import ON_SERVER_FAILURE, server_base

        for url in self.servers:
            server_base(url)  # raises on a URL without http(s)://
        if self.on_server_failure not in ON_SERVER_FAILURE:
            raise ValueError(f"serving.on_server_failure={self.on_server_failure!r}: use one of {ON_SERVER_FAILURE}")
        if not self.timeout > 0 or self.max_retries < 0 or self.verify_tol < 0:
            raise ValueError("serving.timeout must be > 0, serving.max_retries and serving.verify_tol >= 0")


@dataclass
class RunConfig:
    """The whole recipe. Every field can be set in a preset YAML or as ``key=value``."""

    seed: int = 0
    """Run seed: each stage seeds its RNGs from (seed, stage name)."""
    device: str = "cpu"
    """Where models train and sample: cpu or cuda."""
    threads: int = 0
    """torch CPU threads (0: torch's default)."""
    suites: SuitesConfig = field(default_factory=SuitesConfig)
    base: BaseConfig = field(default_factory=BaseConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Training rollouts (warm-up); RSR and RPR configs carry their own sampling settings."""
    rsr1: RSRConfig = field(default_factory=RSRConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    rpr1: RPRConfig = field(default_factory=RPRConfig)
    rsr2: RSRConfig = field(default_factory=RSRConfig)
    rpr2: RPRConfig = field(default_factory=RPRConfig)
    baselines: BaselinesConfig = field(default_factory=BaselinesConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    fdr_quantile: float = 0.9
    """Calibration: D_f is this quantile of the check counts C of family f's training tasks."""
    fdr_fallback: float = 82.0
    """D_f of a family with no calibration task (the paper's 82)."""
    lora: LoraRecipe = field(default_factory=LoraRecipe)
    """LoRA adapters for actor training (off by default: full fine-tuning)."""
    scale: ScaleConfig = field(default_factory=ScaleConfig)
    """The GPUs a sharded run is planned for; a run the planner says will not fit is refused."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device='{self.device}': use cpu, cuda or cuda:N")
        if self.threads < 0:
            raise ValueError(f"threads={self.threads}: use 0 (torch default) or a positive count")
        if not 0.0 < self.fdr_quantile <= 1.0:
            raise ValueError(f"fdr_quantile={self.fdr_quantile}: use a quantile in (0, 1], e.g. 0.9")
        if self.fdr_fallback <= 0:
            raise ValueError(f"fdr_fallback={self.fdr_fallback}: D_f must be positive, e.g. 82")


def resolve_preset(name_or_path: str) -> Path:
    """A preset name (``toy-cpu``) or a YAML path -> the YAML path."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise ConfigError(f"preset file {p} not found")
        return p
    p = PRESETS_DIR / f"{name_or_path}.yaml"
    if not p.is_file():
        names = sorted(q.stem for q in PRESETS_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown preset '{name_or_path}'; choose one of {names} or pass a YAML path")
    return p


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


# ----------------------------------------------------------------------------------------------
# The stage plan
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
    config_key: str = ""
    """Attribute of RunConfig holding this stage's config (rsr1, rpr1, ...)."""
    extra_steps: int = 0
    """Continuation branches: RPR steps to add to the source stage."""
    overrides: tuple[tuple[str, Any], ...] = ()
    """(field, value) pairs replaced in the stage's config (an ablation's one change)."""
    retained: bool = True
    """One of the paper's five retained stages (False: a baseline branch)."""
    evaluate: bool = True

    @property
    def dirname(self) -> str:
        return f"{self.index:02d}-{self.name}"


def plan(cfg: RunConfig) -> list[StageSpec]:
    """The ordered stages of a run (retained stages first, then the baselines)."""
    stages = _plan_stages(cfg)
    if cfg.eval.stages:
        stages = [dataclasses.replace(s, evaluate=s.evaluate and s.name in cfg.eval.stages) for s in stages]
    return stages


def _plan_stages(cfg: RunConfig) -> list[StageSpec]:
    stages = [
        StageSpec(0, "base", "base", "Base", config_key="base"),
        StageSpec(1, "rsr1", "rsr", "RSR-1", actor_from="base", config_key="rsr1"),
        StageSpec(2, "warmup", "warmup", "Warm-up critic", actor_from="rsr1", config_key="warmup",
                  retained=False, evaluate=False),
        StageSpec(3, "rpr1", "rpr", "RPR-1", actor_from="rsr1", critic_from="warmup", config_key="rpr1"),
        StageSpec(4, "rsr2", "rsr", "RSR-2", actor_from="rpr1", critic_from="rpr1", config_key="rsr2"),
        StageSpec(5, "rpr2", "rpr", "RPR-2", actor_from="rsr2", critic_from="rsr2", config_key="rpr2"),
    ]
    b = cfg.baselines
    if b.direct_ppo:
        stages.append(StageSpec(len(stages), "direct_ppo", "rpr", "Direct PPO", actor_from="base",
                                config_key="rpr1", retained=False))
    if b.critic_reset:
        stages.append(StageSpec(len(stages), "rpr2_critic_reset", "rpr", "RPR-2, critic reset", actor_from="rsr2",
                                config_key="rpr2", retained=False))
    if b.token_gae:
        stages.append(StageSpec(len(stages), "rpr1_token_gae", "rpr", "RPR-1, per-token GAE", actor_from="rsr1",
                                critic_from="warmup", config_key="rpr1", overrides=(("advantage", "token_gae"),),
                                retained=False))
    for src, extra in (("rpr1", b.continue_rpr1), ("rpr2", b.continue_rpr2)):
        if extra > 0:
            steps = getattr(cfg, src).steps + extra
            stages.append(StageSpec(len(stages), f"{src}_cont", "rpr", f"{src.upper()[:3]}-{src[-1]} to step {steps}",
                                    actor_from=src, critic_from=src, config_key=src, extra_steps=extra,
                                    retained=False))
    return stages


# ----------------------------------------------------------------------------------------------
# The run directory: markers, metrics, RNG state
# ----------------------------------------------------------------------------------------------


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


class RunDir:
    """Paths and completion markers of one run directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.stages = self.root / "stages"
        self.config = self.root / "config.yaml"
        self.calibration = self.root / "calibration.json"
        self.tasks = self.root / "tasks"
        self.metrics = self.root / "metrics.jsonl"
        self.results = self.root / "results.json"
        self.tb = self.root / "tb"

    def stage(self, spec: StageSpec) -> Path:
        return self.stages / spec.dirname

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
        # The pipeline's step wins over a "step" inside the metrics (a continuation numbers its
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
    return int.from_bytes(hashlib.sha256(f"{run_seed}:{name}".encode()).digest()[:4], "little") & 0x7FFFFFFF


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def save_rng(path: Path) -> None:
    import numpy as np

    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}, path)


def load_rng(path: Path) -> None:
    import numpy as np

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


# ----------------------------------------------------------------------------------------------
# What a stage does: the Runner protocol and the real implementation
# ----------------------------------------------------------------------------------------------


@dataclass
class StageInputs:
    """Checkpoint paths a stage starts from (None where the plan gives none)."""

    actor: Path | None
    critic: Path | None
    optimizer: Path | None
    rng: Path | None


class Runner(Protocol):
    """What the pipeline asks of the code that trains and evaluates.

    The pipeline owns ordering, directories, markers, seeding and logging; a Runner only
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


class PipelineError(RuntimeError):
    """A run stopped; the message says why and how to resume it."""


def run(cfg: RunConfig, run_dir: str | Path, runner: Runner | None = None, resume: bool = False,
        tensorboard: bool = True) -> dict:
    """Run (or, with ``resume``, continue) the recipe in ``run_dir``; returns results.json's dict.

    Raises:
        ConfigError: ``resume`` with a config that differs from the run's (every difference
            is listed), or a new run into a directory that already holds one.
        PipelineError: a stage failed (disk full, a dead sandbox, ...); finished stages are kept
            and the message gives the ``--resume`` command.
    """
    run_ = RunDir(run_dir)
    world = distributed.current()  # torchrun / accelerate: rank 0 owns the run directory
    check_plan(cfg, world.size)
    stages = plan(cfg)
    kept = _on_main(world, lambda: (_prepare_dir(cfg, run_, resume), _drop_incomplete(run_, stages))[1])
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    runner = runner if runner is not None else RecipeRunner()
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
            if spec.evaluate and run_.eval_done(spec) is None:  # rank 0 evaluates, the others wait
                _on_main(world, lambda: (_eval_stage(cfg, run_, runner, spec), write_results(run_, stages)))
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise PipelineError(
                f"disk full during {current} in {run_.root} ({e}). Free space, then run "
                f"`minirsi run --resume {run_.root}`: every finished stage is kept."
            ) from e
        raise PipelineError(_failure(run_, current, e)) from e
    except RuntimeError as e:  # SandboxError and other runtime failures of a stage
        raise PipelineError(_failure(run_, current, e)) from e
    finally:
        if writer is not None:
            writer.close()
    return _on_main(world, lambda: write_results(run_, stages))


def _on_main(world: distributed.World, fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0 (every rank at world size 1), its result or its exception on every
    rank: a ConfigError on rank 0 stops all ranks instead of leaving them at a barrier."""
    if world.size == 1:
        return fn()
    outcome: tuple[bool, Any] = (True, None)
    if world.is_main:
        try:
            outcome = (True, fn())
        except Exception as e:  # handed to every rank, raised there below
            outcome = (False, e)
    ok, value = world.broadcast(outcome)
    if not ok:
        raise value
    return value


def check_plan(cfg: RunConfig, world_size: int = 1) -> Any:
    """Refuse a run the planner (minirsi.memplan) says will not fit: when ``scale.gpu_mem_gib``
    is set, the per-GPU memory of actor + critic on ``world_size`` GPUs (or ``scale.gpus``)
    must fit. Returns the plan (None when the config has no ``scale.gpu_mem_gib``)."""
    from minirsi import memplan

    if not cfg.scale.gpu_mem_gib:
        return None
    if not cfg.base.model:
        raise ConfigError("scale.gpu_mem_gib is set but base.model is empty: the planner needs the model; set "
                          "base.model to a Hugging Face id or checkpoint dir, or scale.gpu_mem_gib=0 (no plan)")
    try:
        shape = memplan.shape_of(cfg.base.model)
    except ValueError:
        from transformers import AutoConfig  # a hub id outside KNOWN_SHAPES: its config.json only

        shape = memplan.ModelShape.from_config(AutoConfig.from_pretrained(cfg.base.model))
    scale = dataclasses.replace(cfg.scale, lora=cfg.scale.lora or cfg.lora.enabled,
                                tokens_per_step=cfg.scale.tokens_per_step or cfg.scale.seq_len * cfg.rpr1.episodes_per_step,
                                kl_reference=cfg.scale.kl_reference or max(cfg.rpr1.kl_coef, cfg.rpr2.kl_coef) > 0)
    result = memplan.plan(shape, scale, world_size if world_size > 1 else None)
    if not result.fits:
        raise ConfigError(memplan.fit_error(result))
    return result


def _failure(run_: RunDir, where: str, e: BaseException) -> str:
    return (f"{where} failed: {type(e).__name__}: {e}. Finished stages are kept in {run_.stages}; "
            f"fix the cause, then run `minirsi run --resume {run_.root}`.")


def _prepare_dir(cfg: RunConfig, run_: RunDir, resume: bool) -> None:
    now = to_dict(cfg)
    if resume:
        if not run_.config.is_file():
            raise ConfigError(f"--resume {run_.root}: no config.yaml there, so it is not a minirsi run "
                              f"directory; start a new run with --out {run_.root}")
        # Through load_config, so a field added since the run started reads as its default on both
        # sides (a run from before serving.* or rpr*.tis_cap existed still resumes).
        saved = to_dict(load_config(RunConfig, run_.config))
        diff = config_diff(saved, now)
        if diff:
            raise ConfigError(
                f"--resume {run_.root}: the config differs from the one the run started with:\n  "
                + "\n  ".join(diff)
                + "\nResume without overrides (the run's config.yaml is used) or start a new run with --out."
            )
        return
    if run_.root.exists() and any(run_.root.iterdir()):
        raise ConfigError(f"{run_.root} already holds a run; continue it with `minirsi run --resume "
                          f"{run_.root}` or pick a new --out directory")
    run_.stages.mkdir(parents=True, exist_ok=True)
    tmp = run_.config.with_name(".config.yaml.tmp")
    save_config(cfg, tmp)
    os.replace(tmp, run_.config)


def _drop_incomplete(run_: RunDir, stages: Sequence[StageSpec]) -> list[str]:
    """Delete what an interrupted stage left behind; return the names of finished stages."""
    finished, unfinished = [], set()
    for spec in stages:
        d = run_.stage(spec)
        if run_.done(spec) is not None:
            finished.append(spec.name)
            if spec.evaluate and run_.eval_done(spec) is None and (d / "eval").exists():
                shutil.rmtree(d / "eval")  # a half-written evaluation is redone
            continue
        unfinished.add(spec.name)
        if d.exists():
            logger.info("removing the unfinished stage %s", d)
            shutil.rmtree(d)
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
        import tempfile

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
    logger.info("stage %s done in %.0f s", spec.dirname, record["wall_s"])
    world.barrier()


def _eval_stage(cfg: RunConfig, run_: RunDir, runner: Runner, spec: StageSpec) -> None:
    d = run_.stage(spec)
    out = d / "eval"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    seed_everything(stage_seed(cfg.seed, f"eval:{spec.name}"))
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
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(run_.tb))


def _progress(stages: Sequence[StageSpec]) -> Iterator[StageSpec]:
    from tqdm import tqdm

    bar = tqdm(stages, desc="recipe", unit="stage", leave=True)
    for spec in bar:
        bar.set_postfix_str(spec.label)
        yield spec


# ----------------------------------------------------------------------------------------------
# The real stages
# ----------------------------------------------------------------------------------------------


def count_checks(task: Any) -> int:
    """C of a task without running it: its non-hygiene checks as ``verifier.static_checks`` reads
    them from tests/test_*.py. Used only for the FDR calibration D_f, before any rollout exists."""
    from minirsi.verifier import static_checks

    checks = static_checks(Path(task.path) / "tests")
    if not checks:
        raise ValueError(f"task {task.task_id}: no test_* function under {task.path}/tests; FDR calibration "
                         f"counts its checks (C)")
    return sum(1 for hygiene in checks.values() if not hygiene)


def calibrate_scales(tasks: Sequence[Any], cfg: RunConfig) -> dict[str, float]:
    """D_f of every family of ``tasks`` (the training pool), from their check counts C."""
    from minirsi import fdr

    counts: dict[str, list[int]] = {}
    for t in tasks:
        counts.setdefault(t.family, []).append(count_checks(t))
    return fdr.calibrate(counts, quantile=cfg.fdr_quantile, fallback=cfg.fdr_fallback)


def base_cache_path(cfg: RunConfig) -> Path | None:
    """Where ``base.cache_dir`` keeps the Base of this pretrain config (None: no cache)."""
    if not cfg.base.cache_dir:
        return None
    key = hashlib.sha256(json.dumps(to_dict(cfg.base.pretrain), sort_keys=True).encode()).hexdigest()[:16]
    return Path(cfg.base.cache_dir).expanduser() / f"base-{key}"


class RecipeRunner:
    """The real stages: ``pretrain``, ``rsr.run_rsr``, ``critic.warmup_critic``, ``rpr.run_rpr``
    and ``evaluate.evaluate`` on the run's task suites."""

    def __init__(self) -> None:
        self._tasks: dict[str, list[Any]] = {}

    # -- tasks and calibration --------------------------------------------------------------

    def task_root(self, cfg: RunConfig, run_: RunDir) -> Path:
        return Path(cfg.suites.root) if cfg.suites.root else run_.tasks

    def tasks(self, cfg: RunConfig, run_: RunDir, suite: str) -> list[Any]:
        from minirsi.evaluate import load_suites

        if suite not in self._tasks:
            self._tasks[suite] = load_suites(self.task_root(cfg, run_), [suite])[suite]
        return self._tasks[suite]

    def setup(self, cfg: RunConfig, run_: RunDir) -> None:
        from minirsi import fdr
        from minirsi.evaluate import generate_toy_suites

        needed = ["train", *cfg.eval.suites]
        if cfg.suites.root:
            if not Path(cfg.suites.root).is_dir():
                raise ConfigError(f"suites.root={cfg.suites.root}: no such directory; point it at a folder "
                                  f"with {needed} sub-folders, or set suites.root='' to generate the toy suites")
        else:
            generate_toy_suites(run_.tasks, needed, {s: cfg.suites.size(s) for s in needed}, seed=cfg.suites.seed)
        for s in needed:
            self.tasks(cfg, run_, s)  # fail now, not hours later, on a missing or empty suite
        if not run_.calibration.is_file():
            scales = calibrate_scales(self.tasks(cfg, run_, "train"), cfg)
            tmp = run_.calibration.with_name(".calibration.json.tmp")
            fdr.save_scales(scales, tmp)
            os.replace(tmp, run_.calibration)  # frozen from here on: a resume reads this file
            logger.info("FDR calibration D_f: %s", scales)

    def scales(self, run_: RunDir) -> dict[str, float]:
        from minirsi import fdr

        return fdr.load_scales(run_.calibration)

    # -- stages -----------------------------------------------------------------------------

    def train(self, cfg: RunConfig, run_: RunDir, spec: StageSpec, inputs: StageInputs, out: Path,
              log: Callable[[int, dict], None]) -> dict:
        return getattr(self, f"_{spec.kind}")(cfg, run_, spec, inputs, out, log)

    def _base(self, cfg: RunConfig, run_: RunDir, spec: StageSpec, inputs: StageInputs, out: Path,
              log: Callable[[int, dict], None]) -> dict:
        from minirsi.models import load_actor, save_actor
        from minirsi.pretrain import pretrain

        if not distributed.current().is_main:
            return {}  # Base is loaded or pretrained by rank 0 alone (it trains nothing sharded)
        if cfg.base.model:
            actor, tok = load_actor(cfg.base.model, device=cfg.device)
            save_actor(actor, tok, out / "actor")
            return {"source": cfg.base.model}
        cached = base_cache_path(cfg)
        if cached is not None and (cached / "config.json").is_file():
            shutil.copytree(cached, out / "actor")
            logger.info("Base: reusing the pretrained model cached in %s", cached)
            return {"source": str(cached)}
        metrics = pretrain(cfg.base.pretrain, out / "actor")
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
            shutil.copytree(out / "actor", tmp)
            try:
                os.rename(tmp, cached)  # atomic; another run that cached it first wins
            except OSError:
                shutil.rmtree(tmp)
        for point in metrics.get("curve", []):
            if isinstance(point, dict) and "step" in point:
                log(int(point["step"]), {k: v for k, v in point.items() if k != "step"})
        return {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}

    def _rsr(self, cfg: RunConfig, run_: RunDir, spec: StageSpec, inputs: StageInputs, out: Path,
             log: Callable[[int, dict], None]) -> dict:
        from minirsi import rsr
        from minirsi.episode import JsonlWriter

        world = distributed.current()
        actor, tok = self._actor(cfg, inputs.actor)
        stage_cfg = dataclasses.replace(getattr(cfg, spec.config_key), seed=stage_seed(cfg.seed, spec.name))
        optimizer = rsr.make_optimizer(actor, stage_cfg)
        with JsonlWriter(out / "episodes.jsonl") as writer:
            stats = rsr.run_rsr(actor, tok, self.tasks(cfg, run_, "train"), stage_cfg,
                                world.rollout_fn(_recording(self._rollout_fn(cfg, tok), writer)),
                                log_fn=lambda rec: log(0, rec), optimizer=optimizer, world=world)
        self._save_actor(cfg, actor, tok, out)
        state = world.optimizer_state(actor, optimizer)
        if world.is_main:
            torch.save({"actor": state}, out / "optimizer.pt")
        out_stats = stats.to_dict()
        (out / "rewrites.json").write_text(json.dumps(out_stats.pop("kept"), indent=1) + "\n")
        return out_stats

    @staticmethod
    def _rollout_fn(cfg: RunConfig, tok: Any, temperature: float | None = None, sync: Any = None) -> Callable:
        """In-process sampling, or, given a ``WeightSync``, its servers' sampler."""
        from minirsi.rpr import make_rollout_fn

        rcfg = cfg.rollout if temperature is None else dataclasses.replace(cfg.rollout, temperature=temperature)
        return make_rollout_fn(tok, rcfg, None if sync is None else (lambda model, tok_: sync.sampler))

    @staticmethod
    def _actor(cfg: RunConfig, path: Path | None) -> tuple[Any, Any]:
        """The stage's actor: loaded, with fresh LoRA adapters when ``lora.enabled``, sharded
        over the ranks (minirsi.distributed; unchanged in one process)."""
        from minirsi.models import load_actor_sharded

        return load_actor_sharded(path, distributed.current(), lora=cfg.lora if cfg.lora.enabled else None,
                                  device=cfg.device)

    @staticmethod
    def _save_actor(cfg: RunConfig, actor: Any, tok: Any, out: Path) -> None:
        """actor/ (LoRA merged in), and adapter/ alone when ``lora.save_adapter``; gathered to rank 0."""
        from minirsi.models import save_actor

        def save(plain: Any) -> None:
            save_actor(plain, tok, out / "actor")
            if cfg.lora.enabled and cfg.lora.save_adapter:
                save_actor(plain, tok, out / "adapter", merge_lora=False)

        distributed.current().save(actor, save)

    def _warmup(self, cfg: RunConfig, run_: RunDir, spec: StageSpec, inputs: StageInputs, out: Path,
                log: Callable[[int, dict], None]) -> dict:
        from minirsi import rollout
        from minirsi.critic import build_critic, critic_skeleton, save_critic, warmup_critic
        from minirsi.models import load_actor, load_tokenizer
        from minirsi.rpr import score
        from minirsi.sampler import HFSampler

        world = distributed.current()
        # the frozen RSR-1 actor samples on rank 0; the other ranks need only its tokenizer
        actor, tok = load_actor(inputs.actor, device=cfg.device) if world.is_main else (None, load_tokenizer(inputs.actor))
        if actor is not None:
            actor.eval().requires_grad_(False)
        seed = stage_seed(cfg.seed, spec.name)
        tasks = [t for t in self.tasks(cfg, run_, "train") for _ in range(cfg.warmup.samples_per_task)]
        episodes = world.on_main(lambda: rollout.collect(tasks, HFSampler(actor, tok), tok,
                                                         dataclasses.replace(cfg.rollout, seed=seed), out / "episodes.jsonl"))
        usable = [e for e in episodes if any(e.action_mask)]
        if not usable:
            raise RuntimeError("warm-up: no rollout produced an action; check the sandbox (minirsi task check)")
        rewards = score(usable, cfg.warmup.reward, self.scales(run_))
        # every critic parameter trains; the actor stays frozen
        critic = world.load_sharded(lambda: build_critic(actor).to(cfg.device), lambda: critic_skeleton(inputs.actor),
                                    keep_unsharded=False)
        optimizer = torch.optim.AdamW(critic.parameters(), lr=cfg.warmup.lr_critic, weight_decay=0.0)
        wcfg = dataclasses.replace(cfg.warmup, seed=seed)
        evs = warmup_critic(critic, usable, rewards, wcfg, optimizer=optimizer, pad_id=tok.pad_token_id or 0,
                            world=world)
        binary = sum(e.success for e in usable) / len(usable)
        for i, ev in enumerate(evs):
            log(i, {"phase": "warmup", "explained_variance": ev, "reward": sum(rewards) / len(rewards),
                    "binary_reward": binary})
        world.save(critic, lambda plain: save_critic(plain, out / "critic"))
        state = world.optimizer_state(critic, optimizer)
        if world.is_main:
            torch.save({"critic": state}, out / "optimizer.pt")
        return {"episodes": len(usable), "updates": len(evs), "ev_first": evs[0] if evs else None,
                "ev_last": evs[-1] if evs else None, "binary_reward": binary}

    def _rpr(self, cfg: RunConfig, run_: RunDir, spec: StageSpec, inputs: StageInputs, out: Path,
             log: Callable[[int, dict], None]) -> dict:
        from minirsi.critic import build_critic, load_critic, load_critic_sharded, save_critic
        from minirsi.episode import JsonlWriter
        from minirsi.models import load_actor, load_actor_sharded
        from minirsi.rpr import make_optimizers, run_rpr

        world = distributed.current()
        lora = cfg.lora if cfg.lora.enabled else None
        if world.size > 1:  # rank 0 reads each checkpoint, the other ranks receive their shards
            # with servers sampling, rank 0 keeps no unsharded actor: each push gathers one
            actor, tok = load_actor_sharded(inputs.actor, world, lora=lora, keep_unsharded=not cfg.serving.servers)
            critic = load_critic_sharded(inputs.critic or inputs.actor, world)
        else:
            actor, tok = load_actor(inputs.actor, lora=lora, device=cfg.device)
            critic = (load_critic(inputs.critic) if inputs.critic else build_critic(actor)).to(cfg.device)
        base_cfg = getattr(cfg, spec.config_key)
        offset = 0
        stage_cfg = dataclasses.replace(base_cfg, seed=stage_seed(cfg.seed, spec.name), **dict(spec.overrides))
        if spec.extra_steps:  # a continuation: the same phase, run longer (no second calibration)
            offset = base_cfg.critic_calibration_updates + base_cfg.steps
            stage_cfg = dataclasses.replace(stage_cfg, steps=spec.extra_steps, critic_calibration_updates=0)
        if stage_cfg.tis_cap is None:  # auto: on when another engine samples (rpr.py's docstring)
            stage_cfg = dataclasses.replace(stage_cfg, tis_cap=2.0 if cfg.serving.servers else 0.0)
        ref_model = None  # run_rpr's default (a frozen copy, or the adapter-free LoRA actor) in one process
        if world.size > 1 and stage_cfg.kl_coef > 0 and not cfg.lora.enabled:  # a sharded frozen copy
            ref_model, _ = load_actor_sharded(inputs.actor, world, keep_unsharded=False, frozen=True)
        optimizers = make_optimizers(actor, critic, stage_cfg)
        if inputs.optimizer is not None and inputs.optimizer.is_file():
            state = torch.load(inputs.optimizer, weights_only=False)
            world.load_optimizer_state(actor, optimizers.actor, state["actor"])
            world.load_optimizer_state(critic, optimizers.critic, state["critic"])
        # rank 0 talks to the servers; a sharded actor is gathered for each push (_sharded_push)
        sync = _weight_sync(cfg, run_) if cfg.serving.servers and world.is_main else None
        push = _sharded_push(world, sync) if cfg.serving.servers else None
        if push is not None:
            log(offset, {"phase": "sync", **push(actor)})  # the servers start from this stage's actor
        with JsonlWriter(out / "episodes.jsonl") as writer:
            rollout_fn = world.rollout_fn(_recording(self._rollout_fn(cfg, tok, stage_cfg.temperature, sync), writer),
                                          gather=not cfg.serving.servers)  # servers sample: no gather per rollout
            history = run_rpr(actor, critic, tok, self.tasks(cfg, run_, "train"), stage_cfg, rollout_fn,
                              self.scales(run_), log_fn=lambda rec: log(offset + int(rec["step"]), rec),
                              ref_model=ref_model, optimizers=optimizers, after_actor_update=push, world=world)
        self._save_actor(cfg, actor, tok, out)
        world.save(critic, lambda plain: save_critic(plain, out / "critic"))
        state = {"actor": world.optimizer_state(actor, optimizers.actor),
                 "critic": world.optimizer_state(critic, optimizers.critic)}
        if world.is_main:
            torch.save(state, out / "optimizer.pt")
        joint = [h for h in history if h.get("phase") == "joint"] or history
        last = joint[-min(3, len(joint)):]
        return {"steps": len(history), "final_binary_reward": _avg(h["binary_reward"] for h in last),
                "final_dense_reward": _avg(h["dense_reward"] for h in last),
                "final_explained_variance": _avg(h["explained_variance"] for h in last)}

    def evaluate(self, cfg: RunConfig, run_: RunDir, spec: StageSpec, actor_dir: Path, out: Path) -> dict:
        from minirsi.evaluate import evaluate
        from minirsi.models import load_actor

        actor, tok = load_actor(actor_dir, device=cfg.device)
        suites = {s: self.tasks(cfg, run_, s) for s in cfg.eval.suites}
        # Every stage is scored with the same seed: common random numbers, so the differences
        # between stages come from the policies rather than from the dice.
        return evaluate(actor, tok, suites, k=cfg.eval.k, rollout_cfg=cfg.eval.rollout, out_dir=out,
                        seed=stage_seed(cfg.seed, "eval"))


def _weight_sync(cfg: RunConfig, run_: RunDir) -> Any:
    """An ``OpenAISampler`` over ``serving.servers`` and the ``WeightSync`` that feeds them."""
    from minirsi.sampler import OpenAISampler
    from minirsi.weight_sync import WeightSync

    s = cfg.serving
    sampler = OpenAISampler(s.servers, s.model_name, timeout=s.timeout, max_retries=s.max_retries,
                            on_server_failure=s.on_server_failure)
    probe = list(range(1, 65)) if s.verify_tol > 0 else ()  # any ids score; the tiny vocab has these
    return WeightSync(sampler, s.sync_dir or run_.root / "weights", timeout=s.timeout, retries=s.max_retries,
                      verify_tol=s.verify_tol, probe_ids=probe)


def _sharded_push(world: distributed.World, sync: Any) -> Callable[[Any], dict] | None:
    """The weight push after each update: ``sync`` itself in one process; sharded, every rank
    gathers the actor's weights and rank 0 pushes them (``sync`` exists on rank 0 only), its
    metrics going to every rank."""
    if world.size == 1:
        return sync

    def push(actor: Any) -> dict:
        plain = world.unsharded(actor)
        return world.on_main(lambda: sync(plain))

    return push


def _recording(rollout_fn: Callable, writer: Any) -> Callable:
    """Wrap a ``rollout_fn(actor, tasks, seed)`` so every episode is also appended to the stage's
    episodes.jsonl (what ``minirsi audit`` rescores)."""

    def fn(actor: Any, tasks: Sequence[Any], seed: int) -> list:
        episodes = rollout_fn(actor, tasks, seed)
        for ep in episodes:
            writer.write(ep)
        return episodes

    return fn


def _avg(xs: Any) -> float:
    xs = [float(x) for x in xs]
    return sum(xs) / len(xs) if xs else float("nan")


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def cli(argv: Sequence[str] | None = None, command: str = "run") -> int:
    p = argparse.ArgumentParser(
        prog=f"minirsi {command}",
        description="The five-stage recipe Base -> RSR-1 -> RPR-1 -> RSR-2 -> RPR-2, evaluated on every suite.",
        epilog="Overrides are key=value with dots for nesting, e.g. rpr1.lr_actor=5e-4 eval.k=3.",
    )
    p.add_argument("--preset", default=None, help="preset name (toy-cpu, smoke, gpu-small) or YAML path; default toy-cpu")
    p.add_argument("--out", default=None, help="run directory (default runs/<preset>)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue the interrupted run in RUN_DIR")
    p.add_argument("--no-report", action="store_true", help="skip writing RUN_DIR/report.md at the end")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per checkpoint load/save drowns the stage bars
    try:
        if args.resume:
            if args.out and Path(args.out) != Path(args.resume):
                raise ConfigError("--resume RUN_DIR continues RUN_DIR in place; drop --out")
            run_dir = Path(args.resume)
            source = resolve_preset(args.preset) if args.preset else run_dir / "config.yaml"
            if not source.is_file():
                raise ConfigError(f"--resume {run_dir}: no config.yaml there; is it a minirsi run directory?")
        else:
            preset = args.preset or "toy-cpu"
            source = resolve_preset(preset)
            run_dir = Path(args.out) if args.out else Path("runs") / Path(preset).stem
        cfg = load_config(RunConfig, source, args.overrides)
        t0 = time.time()
        world = distributed.init(cfg.device)  # torchrun / accelerate launch: join the ranks
        try:
            results = run(cfg, run_dir, resume=bool(args.resume))
        except BaseException:
            distributed.shutdown(wait=False)  # the other ranks may be gone: no last barrier
            raise
        distributed.shutdown()  # destroy_process_group, after a last barrier
    except ConfigError as e:
        print(f"minirsi {command}: config error: {e}", file=sys.stderr)
        return 2
    except PipelineError as e:
        print(f"minirsi {command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nminirsi {command}: interrupted; continue with `minirsi run --resume {run_dir}`", file=sys.stderr)
        return 130
    if not world.is_main:
        return 0  # rank 0 reports
    from minirsi import report

    print(report.results_table(results, k=cfg.eval.k, labels=report.stage_labels(run_dir, list(results))))
    if not args.no_report:
        path = report.write_report(run_dir)
        print(f"report: {path}")
    print(f"run dir: {run_dir}  ({(time.time() - t0) / 60:.1f} min)")
    return 0

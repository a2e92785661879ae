"""The run's configuration: one ``RunConfig`` dataclass for the whole recipe, with a section per
stage, loadable from a preset YAML and ``key=value`` overrides (``minirsi.config.load_config``).

``recipe.plan`` turns a ``RunConfig`` into the ordered stages, each with its finished config
(seed, the warm-up's discount, an ablation's one change, a continuation's steps); the stages
(``stages.RecipeRunner``) read only that. This module imports no other part of ``minirsi.run``
but the pretraining config, so the recipe, the stages and the run directory can all import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from minirsi.config import ConfigError
from minirsi.core import fdr
from minirsi.core.critic import WarmupConfig
from minirsi.core.rpr import RPRConfig
from minirsi.core.rsr import RSRConfig
from minirsi.engine.models import LoraRecipe
from minirsi.engine.rollout import RolloutConfig
from minirsi.engine.weight_sync import ServingConfig
from minirsi.env.sandbox import BACKENDS
from minirsi.run.memplan import ScaleConfig
from minirsi.run.pretrain import PretrainConfig

PRESETS_DIR = Path(__file__).parents[1] / "presets"

SUITES = ("train", "core", "hard", "long", "unseen")
"""The toy suites: ``train`` is the training pool, the others are held out."""


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

EVALUATED = ("base", "rsr1", "rpr1", "rsr2", "rpr2", "direct_ppo", "rpr2_critic_reset", "rpr1_token_gae",
             "rpr1_cont", "rpr2_cont")
"""Stages that can be evaluated (the warm-up trains only the critic)."""


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
class RunConfig:
    """The whole recipe. Every field can be set in a preset YAML or as ``key=value``."""

    seed: int = 0
    """Run seed: each stage seeds its RNGs from (seed, stage name)."""
    device: str = "cpu"
    """Where models train and sample: cpu or cuda."""
    threads: int = 0
    """torch CPU threads (0: torch's default) for training and everything but rollouts, which
    may set their own (``rollout.threads``, ``eval.rollout.threads``)."""
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
        for key in ("rsr1", "rsr2"):  # core's RSRConfig does not know the sandbox backends
            backend = getattr(self, key).backend
            if backend not in BACKENDS:
                raise ValueError(f"RSRConfig.backend={backend!r}: use one of {BACKENDS}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device='{self.device}': use cpu, cuda or cuda:N")
        if self.threads < 0:
            raise ValueError(f"threads={self.threads}: use 0 (torch default) or a positive count")
        for name in ("gamma_turn", "lam_turn"):  # the warm-up's returns are RPR-1's (plan() hands them on)
            mine, rpr1 = getattr(self.warmup, name), getattr(self.rpr1, name)
            if mine is not None and mine != rpr1:
                raise ValueError(f"warmup.{name}={mine} but rpr1.{name}={rpr1}: the warm-up trains the critic on "
                                 f"RPR-1's returns; drop warmup.{name} (it is taken from rpr1)")
        fdr.check_quantile(self.fdr_quantile, "fdr_quantile")  # fdr.py holds the valid ranges
        fdr.check_scale(self.fdr_fallback, "fdr_fallback")


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

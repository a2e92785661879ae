"""The recipe: Base -> RSR-1 -> Warm-up -> RPR-1 -> RSR-2 -> RPR-2, checkpointed and evaluated.

docs/method.md section 7. One command runs the paper's five retained stages on the toy suites,
each stage with its own learning rates, and evaluates every stage on every suite::

    minirsi run                                   # preset toy-cpu, run dir runs/toy-cpu
    minirsi run --preset smoke --out runs/ci      # the CI-sized run
    minirsi run rpr1.lr_actor=5e-4 baselines.continue_rpr1=4     # key=value overrides
    minirsi run --resume runs/toy-cpu             # continue an interrupted run
    minirsi run serving.servers=[http://h1:8000,http://h2:8000]  # RPR samples on vLLM servers,
                                                  # synced after every update (scale/README.md)

The recipe in code (``plan``): each stage is named by the checkpoint it leaves, and a stage
starts from the actor and the critic of the stages it is given::

    base   = pretrain()                  00-base
    rsr1   = rsr(actor=base)             01-rsr1     actor = rsr(actor)
    warmup = warmup(actor=rsr1)          02-warmup   critic = warmup(actor): RSR-1 frozen
    rpr1   = rpr(rsr1, critic=warmup)    03-rpr1     rpr(actor, critic)
    rsr2   = rsr(rpr1, critic=rpr1)      04-rsr2     rsr(actor); the critic passes through untouched
    rpr2   = rpr(rsr2, critic=rsr2)      05-rpr2     rpr(actor, critic): RPR-1's critic, inherited
    baselines (beside the retained stages, never discarded):
    direct_ppo        = rpr(base)                  fresh critic, RPR-1's config and steps
    rpr2_critic_reset = rpr(rsr2)                  fresh critic instead of RPR-1's (baselines.critic_reset)
    rpr1_token_gae    = rpr(rsr1, critic=warmup)   per-token GAE instead of TB-GAE (baselines.token_gae)
    rpr1_cont, rpr2_cont                           RPR-1 / RPR-2 run longer (their optimizer and RNG state)
(the numbers of the optional ones shift down when a branch before them is off)

What each stage computes is ``stages.RecipeRunner`` (``pretrain``, ``rsr.run_rsr``,
``critic.warmup_critic``, ``rpr.run_rpr``, ``evaluate.evaluate``); where the checkpoints go,
resume and seeding are ``rundir``'s (its docstring shows the run directory).

Departures from the paper: the stages run on toy tasks with a ~1M-parameter model; "steps"
are PPO iterations of a few dozen episodes, not the paper's large batches; Direct PPO uses
RPR-1's config (learning rates included) so that the comparison is at equal steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from transformers import AutoConfig
from transformers.utils import logging as hf_logging

from minirsi.config import ConfigError, load_config
from minirsi.core import distributed, fdr
from minirsi.core.critic import WarmupConfig
from minirsi.core.rpr import RPRConfig
from minirsi.core.rsr import RSRConfig
from minirsi.engine.models import LoraRecipe
from minirsi.engine.rollout import RolloutConfig
from minirsi.engine.weight_sync import ServingConfig
from minirsi.env.sandbox import BACKENDS
from minirsi.run import memplan, report
from minirsi.run.memplan import ScaleConfig
from minirsi.run.rundir import RunError, Runner, StageSpec, run_stages
from minirsi.run.runlock import RunDirBusy
from minirsi.run.stages import SUITES, BaseConfig, RecipeRunner, SuitesConfig

logger = logging.getLogger(__name__)

PRESETS_DIR = Path(__file__).parents[1] / "presets"
EVALUATED = ("base", "rsr1", "rpr1", "rsr2", "rpr2", "direct_ppo", "rpr2_critic_reset", "rpr1_token_gae",
             "rpr1_cont", "rpr2_cont")
"""Stages that can be evaluated (the warm-up trains only the critic)."""


# ----------------------------------------------------------------------------------------------
# The recipe
# ----------------------------------------------------------------------------------------------


def plan(cfg: RunConfig) -> list[StageSpec]:
    """The ordered stages of a run: the paper's five retained stages, then the baselines. Each
    name is a handle on the stage's checkpoint (``rundir``: its actor/ and critic/)."""
    s = _Stages()
    base = s.base()
    rsr1 = s.rsr("rsr1", actor=base)                  # actor = rsr(actor)
    warmup = s.warmup(actor=rsr1)                     # critic = warmup(actor)
    rpr1 = s.rpr("rpr1", actor=rsr1, critic=warmup)   # rpr(actor, critic)
    rsr2 = s.rsr("rsr2", actor=rpr1, critic=rpr1)     # rsr(actor): the critic passes through untouched
    rpr2 = s.rpr("rpr2", actor=rsr2, critic=rsr2)     # rpr(actor, critic): RPR-1's critic, inherited
    b = cfg.baselines
    if b.direct_ppo:  # RPR on Base with a fresh critic, RPR-1's config and steps
        s.baseline("direct_ppo", "Direct PPO", actor=base, config_key="rpr1")
    if b.critic_reset:  # RPR-2 with a fresh critic instead of the inherited one
        s.baseline("rpr2_critic_reset", "RPR-2, critic reset", actor=rsr2, config_key="rpr2")
    if b.token_gae:  # RPR-1 with per-token GAE instead of TB-GAE
        s.baseline("rpr1_token_gae", "RPR-1, per-token GAE", actor=rsr1, critic=warmup, config_key="rpr1",
                   overrides=(("advantage", "token_gae"),))
    for src, extra in ((rpr1, b.continue_rpr1), (rpr2, b.continue_rpr2)):
        if extra > 0:  # the same phase run longer: its optimizer and RNG state go on
            steps = getattr(cfg, src).steps + extra
            s.baseline(f"{src}_cont", f"{src.upper()[:3]}-{src[-1]} to step {steps}", actor=src, critic=src,
                       config_key=src, extra_steps=extra)
    if cfg.eval.stages:
        return [dataclasses.replace(x, evaluate=x.evaluate and x.name in cfg.eval.stages) for x in s.stages]
    return s.stages


class _Stages:
    """The stage list as ``plan`` writes it: each call appends a stage and returns its name,
    the handle later stages start from. Only the five retained stages have their own config
    (``RunConfig.<name>``); a baseline names the one it borrows."""

    def __init__(self) -> None:
        self.stages: list[StageSpec] = []

    def _add(self, name: str, kind: str, label: str, **spec: Any) -> str:
        spec.setdefault("config_key", name)
        self.stages.append(StageSpec(len(self.stages), name, kind, label, **spec))
        return name

    def base(self) -> str:
        return self._add("base", "base", "Base")

    def rsr(self, name: str, actor: str, critic: str | None = None) -> str:
        return self._add(name, "rsr", f"RSR-{name[-1]}", actor_from=actor, critic_from=critic)

    def warmup(self, actor: str) -> str:
        return self._add("warmup", "warmup", "Warm-up critic", actor_from=actor, retained=False, evaluate=False)

    def rpr(self, name: str, actor: str, critic: str | None = None) -> str:
        return self._add(name, "rpr", f"RPR-{name[-1]}", actor_from=actor, critic_from=critic)

    def baseline(self, name: str, label: str, actor: str, critic: str | None = None, **spec: Any) -> str:
        """An RPR branch beside the retained stages (critic None: a fresh one)."""
        return self._add(name, "rpr", label, actor_from=actor, critic_from=critic, retained=False, **spec)


def run(cfg: RunConfig, run_dir: str | Path, runner: Runner | None = None, resume: bool = False,
        tensorboard: bool = True) -> dict:
    """Run (or, with ``resume``, continue) the recipe in ``run_dir``; returns results.json's dict.

    Raises:
        ConfigError: a run the planner says will not fit (``check_plan``), ``resume`` with a
            config that differs from the run's, or a new run into a directory that holds one.
        RunError: a stage failed; finished stages are kept (``rundir.run_stages``).
        RunDirBusy: another live run holds ``run_dir`` (``minirsi.run.runlock``); nothing was touched.
    """
    check_plan(cfg, distributed.current().size)
    return run_stages(cfg, run_dir, plan(cfg), runner if runner is not None else RecipeRunner(), resume,
                      tensorboard)


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


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


    def finished_warmup(self) -> WarmupConfig:
        """The warm-up's config as the stage runs it: its discount is RPR-1's, whose returns the
        critic will be the baseline of."""
        return dataclasses.replace(self.warmup, gamma_turn=self.rpr1.gamma_turn, lam_turn=self.rpr1.lam_turn)


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


def check_plan(cfg: RunConfig, world_size: int = 1) -> Any:
    """Refuse a run the planner (minirsi.run.memplan) says will not fit: when ``scale.gpu_mem_gib``
    is set, the per-GPU memory of actor + critic on ``world_size`` GPUs (or ``scale.gpus``)
    must fit. Returns the plan (None when the config has no ``scale.gpu_mem_gib``)."""
    if not cfg.scale.gpu_mem_gib:
        return None
    if not cfg.base.model:
        raise ConfigError("scale.gpu_mem_gib is set but base.model is empty: the planner needs the model; set "
                          "base.model to a Hugging Face id or checkpoint dir, or scale.gpu_mem_gib=0 (no plan)")
    try:
        shape = memplan.shape_of(cfg.base.model)
    except ValueError:
        # a hub id outside KNOWN_SHAPES: its config.json only
        shape = memplan.ModelShape.from_config(AutoConfig.from_pretrained(cfg.base.model))
    scale = dataclasses.replace(cfg.scale, lora=cfg.scale.lora or cfg.lora.enabled,
                                tokens_per_step=cfg.scale.tokens_per_step or cfg.scale.seq_len * cfg.rpr1.episodes_per_step,
                                kl_reference=cfg.scale.kl_reference or max(cfg.rpr1.kl_coef, cfg.rpr2.kl_coef) > 0)
    result = memplan.plan(shape, scale, world_size if world_size > 1 else None, passes=memplan.passes_of(cfg))
    if not result.fits:
        raise ConfigError(memplan.fit_error(result))
    return result


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
        world = distributed.init(cfg.device, cfg.scale)  # torchrun / accelerate launch: join the ranks
        try:
            results = run(cfg, run_dir, resume=bool(args.resume))
        except BaseException:
            distributed.shutdown(wait=False)  # the other ranks may be gone: no last barrier
            raise
        distributed.shutdown()  # destroy_process_group, after a last barrier
    except ConfigError as e:
        print(f"minirsi {command}: config error: {e}", file=sys.stderr)
        return 2
    except (RunError, RunDirBusy) as e:
        print(f"minirsi {command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nminirsi {command}: interrupted; continue with `minirsi run --resume {run_dir}`", file=sys.stderr)
        return 130
    if world.is_main:  # rank 0 reports
        print(report.results_table(results, k=cfg.eval.k, labels=report.stage_labels(run_dir, list(results))))
        if not args.no_report:
            path = report.write_report(run_dir)
            print(f"report: {path}")
        print(f"run dir: {run_dir}  ({(time.time() - t0) / 60:.1f} min)")
    if world.size > 1:
        distributed.exit_rank(0)  # out of the process group already; skip the interpreter's teardown
    return 0

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

Each stage runs its finished config (``StageSpec.config``): its section of ``RunConfig``
(minirsi/run/config.py) with its own seed, the warm-up's discount taken from RPR-1, a baseline's
one change applied. What each stage computes is ``stages.RecipeRunner`` (``pretrain``,
``rsr.run_rsr``, ``critic.warmup_critic``, ``rpr.run_rpr``, ``evaluate.evaluate``); where the
checkpoints go, resume and seeding are ``rundir``'s (its docstring shows the run directory).

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
from pathlib import Path
from typing import Any, Sequence

from transformers import AutoConfig
from transformers.utils import logging as hf_logging

from minirsi.config import ConfigError, load_config
from minirsi.core import distributed
from minirsi.core.critic import WarmupConfig
from minirsi.core.rpr import RPRConfig
from minirsi.core.rsr import RSRConfig
from minirsi.run import memplan, report
from minirsi.run.config import RunConfig, resolve_preset
from minirsi.run.rundir import RunError, Runner, StageSpec, run_stages, stage_seed
from minirsi.run.runlock import RunDirBusy
from minirsi.run.stages import RecipeRunner

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# The recipe
# ----------------------------------------------------------------------------------------------


def plan(cfg: RunConfig) -> list[StageSpec]:
    """The ordered stages of a run: the paper's five retained stages, then the baselines. Each
    name is a handle on the stage's checkpoint (``rundir``: its actor/ and critic/), and each
    stage carries its finished config: the stage runs exactly that, and reads nothing else of
    ``cfg`` for its training."""
    s = _Stages(cfg)
    base = s.base()
    rsr1 = s.rsr("rsr1", cfg.rsr1, actor=base)                   # actor = rsr(actor)
    warmup = s.warmup(cfg.warmup, actor=rsr1, serves=cfg.rpr1)   # critic = warmup(actor), on RPR-1's returns
    rpr1 = s.rpr("rpr1", cfg.rpr1, actor=rsr1, critic=warmup)    # rpr(actor, critic)
    rsr2 = s.rsr("rsr2", cfg.rsr2, actor=rpr1, critic=rpr1)      # rsr(actor): the critic passes through untouched
    rpr2 = s.rpr("rpr2", cfg.rpr2, actor=rsr2, critic=rsr2)      # rpr(actor, critic): RPR-1's critic, inherited
    b = cfg.baselines
    if b.direct_ppo:  # RPR on Base with a fresh critic, RPR-1's config and steps
        s.rpr("direct_ppo", cfg.rpr1, actor=base, label="Direct PPO")
    if b.critic_reset:  # RPR-2 with a fresh critic instead of the inherited one
        s.rpr("rpr2_critic_reset", cfg.rpr2, actor=rsr2, label="RPR-2, critic reset")
    if b.token_gae:  # RPR-1 with per-token GAE instead of TB-GAE: the ablation's one change
        s.rpr("rpr1_token_gae", dataclasses.replace(cfg.rpr1, advantage="token_gae"), actor=rsr1, critic=warmup,
              label="RPR-1, per-token GAE")
    for src, phase, extra in ((rpr1, cfg.rpr1, b.continue_rpr1), (rpr2, cfg.rpr2, b.continue_rpr2)):
        if extra > 0:  # the same phase run longer: its optimizer and RNG state go on
            s.continuation(src, phase, extra)
    if cfg.eval.stages:
        return [dataclasses.replace(x, evaluate=x.evaluate and x.name in cfg.eval.stages) for x in s.stages]
    return s.stages


class _Stages:
    """The stage list as ``plan`` writes it: each call appends a stage with its finished config
    and returns its name, the handle later stages start from."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.stages: list[StageSpec] = []

    def _add(self, name: str, kind: str, label: str, config: Any, **spec: Any) -> str:
        if config is not None:  # each stage seeds its own RNGs from (run seed, stage name)
            config = dataclasses.replace(config, seed=stage_seed(self.cfg.seed, name))
        self.stages.append(StageSpec(len(self.stages), name, kind, label, config=config, **spec))
        return name

    def base(self) -> str:
        return self._add("base", "base", "Base", None)

    def rsr(self, name: str, config: RSRConfig, actor: str, critic: str | None = None) -> str:
        return self._add(name, "rsr", f"RSR-{name[-1]}", config, actor_from=actor, critic_from=critic)

    def warmup(self, config: WarmupConfig, actor: str, serves: RPRConfig) -> str:
        """The critic warm-up, its returns discounted as those of the RPR phase it ``serves``."""
        config = dataclasses.replace(config, gamma_turn=serves.gamma_turn, lam_turn=serves.lam_turn)
        return self._add("warmup", "warmup", "Warm-up critic", config, actor_from=actor, retained=False,
                         evaluate=False)

    def rpr(self, name: str, config: RPRConfig, actor: str, critic: str | None = None, label: str = "",
            **spec: Any) -> str:
        """An RPR phase; with a ``label``, a baseline branch beside the retained stages (critic
        None: a fresh one)."""
        if config.tis_cap is None:  # auto: on when another engine samples (rpr.py's docstring)
            config = dataclasses.replace(config, tis_cap=2.0 if self.cfg.serving.servers else 0.0)
        return self._add(name, "rpr", label or f"RPR-{name[-1]}", config, actor_from=actor, critic_from=critic,
                         retained=not label, **spec)

    def continuation(self, src: str, phase: RPRConfig, extra: int) -> str:
        """RPR phase ``src`` run ``extra`` steps longer, from its actor, critic, optimizer and RNG
        state (no second calibration); its metrics' steps go on from the source's."""
        config = dataclasses.replace(phase, steps=extra, critic_calibration_updates=0)
        label = f"{src.upper()[:3]}-{src[-1]} to step {phase.steps + extra}"
        return self.rpr(f"{src}_cont", config, actor=src, critic=src, label=label, extra_steps=extra,
                        step_offset=phase.critic_calibration_updates + phase.steps)


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

"""What each stage of the recipe computes: Base, RSR, the critic warm-up, RPR, and evaluation.

``recipe.plan`` says which stages run, in which order, from which checkpoints, each with its
finished config (``StageSpec.config``); ``rundir`` runs them, resumably. ``RecipeRunner.train``
computes one stage from its inputs (checkpoint paths) into its output directory, its models
loaded by ``load_models`` (the same call in one process and under torchrun):

    base     pretrain the tiny model (``pretrain``), or load ``base.model``     -> actor/
    rsr      ``rsr.run_rsr`` on the train suite                                -> actor/
    warmup   rollouts of the frozen actor, ``critic.warmup_critic``            -> critic/
    rpr      ``rpr.run_rpr`` with the actor and critic it is given             -> actor/, critic/
    and ``evaluate``: Mean@k of a stage's actor on ``eval.suites`` (``evaluate.evaluate``).

The task suites and the FDR calibration D_f (from the training pool's check counts, frozen
in RUN_DIR/calibration.json) are made once, by ``setup``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from minirsi.config import ConfigError
from minirsi.core import distributed, fdr, rsr
from minirsi.core.critic import load_critic_sharded, save_critic, warmup_critic
from minirsi.core.episode import JsonlWriter, pad_id_of
from minirsi.core.optim import adamw
from minirsi.core.rpr import make_optimizers, run_rpr, score
from minirsi.engine import rollout
from minirsi.engine.models import load_actor, load_actor_sharded, save_actor
from minirsi.engine.rollout import make_replay_fn, make_rollout_fn
from minirsi.engine.sampler import HFSampler
from minirsi.engine.weight_sync import serving_sync, sharded_push
from minirsi.env.verifier import static_checks
from minirsi.run.evaluate import evaluate, generate_toy_suites, load_suite
from minirsi.run.config import RunConfig
from minirsi.run.pretrain import PretrainConfig, config_hash, pretrain
from minirsi.run.rundir import RunDir, StageInputs, StageSpec, stage_seed

logger = logging.getLogger(__name__)

def count_checks(task: Any) -> int:
    """C of a task without running it: its non-hygiene checks as ``verifier.static_checks`` reads
    them from tests/test_*.py. Used only for the FDR calibration D_f, before any rollout exists."""
    checks = static_checks(Path(task.path) / "tests")
    if not checks:
        raise ValueError(f"task {task.task_id}: no test_* function under {task.path}/tests; FDR calibration "
                         f"counts its checks (C)")
    return sum(1 for hygiene in checks.values() if not hygiene)


def calibrate_scales(tasks: Sequence[Any], cfg: RunConfig) -> dict[str, float]:
    """D_f of every family of ``tasks`` (the training pool), from their check counts C."""
    counts: dict[str, list[int]] = {}
    for t in tasks:
        counts.setdefault(t.family, []).append(count_checks(t))
    return fdr.calibrate(counts, quantile=cfg.fdr_quantile, fallback=cfg.fdr_fallback)


SHIPPED_BASE = Path(__file__).parents[1] / "presets" / "toy-base"
"""The toy Base committed with the code (``minirsi pretrain`` with the presets' pretrain config
wrote it; its pretrain_metrics.json names that config's hash), so every machine starts from the
same Base and a fresh run does not pretrain."""


def shipped_base(pcfg: PretrainConfig, root: Path = SHIPPED_BASE) -> Path | None:
    """The shipped Base when its recorded config hash is ``pcfg``'s, else None (another pretrain
    config: the recipe pretrains, or takes it from ``base.cache_dir``)."""
    metrics = root / "pretrain_metrics.json"
    if not metrics.is_file():
        return None
    return root if json.loads(metrics.read_text()).get("config_hash") == config_hash(pcfg) else None


def base_cache_path(cfg: RunConfig) -> Path | None:
    """Where ``base.cache_dir`` keeps the Base of this pretrain config (None: no cache)."""
    if not cfg.base.cache_dir:
        return None
    return Path(cfg.base.cache_dir).expanduser() / f"base-{config_hash(cfg.base.pretrain)}"


@dataclass
class StageModels:
    """What ``load_models`` gives a stage (None where it asked for nothing)."""

    actor: Any
    tokenizer: Any
    critic: Any = None
    reference: Any = None
    """The KL reference: a frozen copy of the actor (None with LoRA: the actor, adapters off)."""

    def release(self, world: distributed.World) -> None:
        """Forget rank 0's unsharded copies (``World.release``) at the stage's end."""
        world.release(*(m for m in (self.actor, self.critic, self.reference) if m is not None))


def load_models(cfg: RunConfig, actor: Path | None = None, critic: Path | None = None, *, trains: bool = False,
                reference: bool = False, keep_unsharded: bool = True) -> StageModels:
    """A stage's models, at any world size: ``from_pretrained`` on ``cfg.device`` in one process;
    under torchrun, rank 0 reads each checkpoint and every rank keeps its FSDP2 shards
    (``World.load_sharded``), so no rank holds a model whole on a device.

    Args:
        actor: the actor checkpoint; trained when ``trains`` (fresh LoRA adapters when
            ``lora.enabled``), else frozen (eval mode, no gradients: sampling, evaluation).
        critic: a saved critic/ directory, or an actor checkpoint to build a fresh critic from
            (its backbone, a zero value head).
        reference: also a frozen copy of ``actor`` as the KL reference (none with LoRA, whose
            reference is the actor with its adapters disabled).
        keep_unsharded: sharded, rank 0 keeps an unsharded host copy of the actor for
            in-process sampling; False when servers sample (each push gathers one).
    """
    world = distributed.current()
    model, tok, crit, ref = None, None, None, None
    if actor is not None:
        lora = cfg.lora if trains and cfg.lora.enabled else None
        model, tok = load_actor_sharded(actor, world, lora=lora, device=cfg.device, keep_unsharded=keep_unsharded,
                                        frozen=not trains)
        if reference and not cfg.lora.enabled:
            ref, _ = load_actor_sharded(actor, world, device=cfg.device, keep_unsharded=False, frozen=True)
    if critic is not None:
        crit = load_critic_sharded(critic, world, device=cfg.device)
    return StageModels(model, tok, crit, ref)


class RecipeRunner:
    """The real stages: ``pretrain``, ``rsr.run_rsr``, ``critic.warmup_critic``, ``rpr.run_rpr``
    and ``evaluate.evaluate`` on the run's task suites."""

    def __init__(self) -> None:
        self._tasks: dict[str, list[Any]] = {}
        self._sync: Any = None

    def _servers(self, cfg: RunConfig, run_: RunDir) -> Any:
        """The run's ``WeightSync`` over ``serving.servers`` (None without servers), one for the
        whole run so weight versions count up across stages. Built on every rank (no request is
        sent until rank 0 pushes), so every rank takes the same branches; rank 0 alone uses it."""
        if not cfg.serving.servers:
            return None
        if self._sync is None:
            self._sync = serving_sync(cfg.serving, run_.root / "weights")
        return self._sync

    # -- tasks and calibration --------------------------------------------------------------

    def task_root(self, cfg: RunConfig, run_: RunDir) -> Path:
        return Path(cfg.suites.root) if cfg.suites.root else run_.tasks

    def tasks(self, cfg: RunConfig, run_: RunDir, suite: str) -> list[Any]:
        if suite not in self._tasks:
            self._tasks[suite] = load_suite(self.task_root(cfg, run_) / suite)
        return self._tasks[suite]

    def setup(self, cfg: RunConfig, run_: RunDir) -> None:
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
            fdr.save_scales(scales, run_.calibration)  # frozen from here on: a resume reads this file
            logger.info("FDR calibration D_f: %s", scales)

    def scales(self, run_: RunDir) -> dict[str, float]:
        return fdr.load_scales(run_.calibration)

    # -- stages -----------------------------------------------------------------------------

    def train(self, cfg: RunConfig, run_: RunDir, spec: StageSpec, inputs: StageInputs, out: Path,
              log: Callable[[int, dict], None]) -> dict:
        stage = {"base": self._base, "rsr": self._rsr, "warmup": self._warmup, "rpr": self._rpr}[spec.kind]
        return stage(cfg, run_, spec, inputs, out, log)

    def _base(self, cfg: RunConfig, run_: RunDir, spec: StageSpec, inputs: StageInputs, out: Path,
              log: Callable[[int, dict], None]) -> dict:
        if not distributed.current().is_main:
            return {}  # Base is loaded or pretrained by rank 0 alone (it trains nothing sharded)
        if cfg.base.model:
            actor, tok = load_actor(cfg.base.model, device=cfg.device)
            save_actor(actor, tok, out / "actor")
            return {"source": cfg.base.model}
        shipped = shipped_base(cfg.base.pretrain)
        if shipped is not None:
            shutil.copytree(shipped, out / "actor")
            logger.info("Base: the shipped toy Base %s (its pretrain config is this run's)", shipped)
            return {"source": str(shipped)}
        cached = base_cache_path(cfg)
        if cached is not None and (cached / "config.json").is_file():
            shutil.copytree(cached, out / "actor")
            logger.info("Base: reusing the pretrained model cached in %s", cached)
            return {"source": str(cached)}
        metrics = pretrain(cfg.base.pretrain, out / "actor")
        steps, want = metrics.get("steps"), cfg.base.pretrain.max_steps
        if want and steps is not None and steps < want:
            # Stopped by base.pretrain.minutes: this Base depends on the machine's speed and load,
            # so it must not become the cached Base every later run of this config starts from.
            logger.warning("Base: pretraining stopped by its time budget (base.pretrain.minutes=%g) after %d of "
                           "max_steps=%d steps; this Base depends on the machine's speed and load and is not "
                           "cached. Raise base.pretrain.minutes for the reproducible Base",
                           cfg.base.pretrain.minutes, steps, want)
            cached = None
            metrics["time_capped"] = True
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
        world, stage_cfg = distributed.current(), spec.config
        sync = self._servers(cfg, run_)
        m = load_models(cfg, inputs.actor, trains=True, keep_unsharded=sync is None)
        actor, tok = m.actor, m.tokenizer
        optimizer = rsr.make_optimizer(actor, stage_cfg)
        planner_sampler = None
        if sync is not None:  # the servers sample the rollouts and the LLM planner, on this stage's actor
            log(0, {"phase": "sync", **sharded_push(world, sync)(actor)})
            planner_sampler = sync.sampler
        with JsonlWriter(out / "episodes.jsonl") as writer:
            stats = rsr.run_rsr(actor, tok, self.tasks(cfg, run_, "train"), stage_cfg,
                                world.rollout_fn(_recording(self._rollout_fn(cfg, tok, sync=sync), writer),
                                                 gather=sync is None),
                                make_replay_fn(stage_cfg.backend, stage_cfg.command_timeout),
                                log_fn=lambda rec: log(0, rec), optimizer=optimizer, world=world,
                                planner_sampler=planner_sampler, sampler_factory=HFSampler)
        self._save_actor(cfg, actor, tok, out)
        world.save_optimizers(run_.stage(spec), {"actor": (actor, optimizer)})
        m.release(world)
        out_stats = stats.to_dict()
        (out / "rewrites.json").write_text(json.dumps(out_stats.pop("kept"), indent=1) + "\n")
        return out_stats

    @staticmethod
    def _rollout_fn(cfg: RunConfig, tok: Any, temperature: float | None = None, sync: Any = None,
                    journal: Path | None = None) -> Callable:
        """In-process sampling, or, given a ``WeightSync``, its servers' sampler; ``journal``:
        ``make_rollout_fn``'s (a resumed stage collects only what it had not finished)."""
        rcfg = cfg.rollout if temperature is None else dataclasses.replace(cfg.rollout, temperature=temperature)
        return make_rollout_fn(tok, rcfg, None if sync is None else (lambda model, tok_: sync.sampler), journal=journal)

    @staticmethod
    def _save_actor(cfg: RunConfig, actor: Any, tok: Any, out: Path) -> None:
        """actor/ (LoRA merged in), and adapter/ alone when ``lora.save_adapter``; gathered to rank 0."""
        def save(plain: Any) -> None:
            save_actor(plain, tok, out / "actor")
            if cfg.lora.enabled and cfg.lora.save_adapter:
                save_actor(plain, tok, out / "adapter", merge_lora=False)

        distributed.current().save(actor, save)

    def _warmup(self, cfg: RunConfig, run_: RunDir, spec: StageSpec, inputs: StageInputs, out: Path,
                log: Callable[[int, dict], None]) -> dict:
        world, wcfg = distributed.current(), spec.config
        pool = rsr.sample_tasks(self.tasks(cfg, run_, "train"), wcfg.tasks, wcfg.seed)
        tasks = [t for t in pool for _ in range(wcfg.samples_per_task)]
        rcfg = dataclasses.replace(cfg.rollout, seed=wcfg.seed)
        sync = self._servers(cfg, run_)
        # The frozen RSR-1 actor samples: in this process, or on the servers, which get its weights.
        m = load_models(cfg, inputs.actor, keep_unsharded=sync is None)
        if sync is not None:
            log(0, {"phase": "sync", **sharded_push(world, sync)(m.actor)})
        sample = lambda model, _tasks, _seed: rollout.collect(  # noqa: E731
            tasks, sync.sampler if sync is not None else HFSampler(model, m.tokenizer), m.tokenizer, rcfg,
            out / "episodes.jsonl")
        episodes = world.rollout_fn(sample, gather=sync is None)(m.actor, tasks, wcfg.seed)
        m.release(world)
        m.actor = None  # gone before the critic is built: one model at a time
        critic = load_models(cfg, critic=inputs.actor).critic  # a fresh critic on the actor's backbone
        usable = [e for e in episodes if any(e.action_mask)]
        if not usable:
            raise RuntimeError("warm-up: no rollout produced an action; check the sandbox (minirsi task check)")
        rewards = score(usable, wcfg.reward, self.scales(run_))
        optimizer = adamw(critic.parameters(), wcfg.lr_critic)  # every critic parameter trains; the actor is frozen
        evs = warmup_critic(critic, usable, rewards, wcfg, optimizer=optimizer, pad_id=pad_id_of(m.tokenizer),
                            world=world)
        binary = sum(e.success for e in usable) / len(usable)
        for i, ev in enumerate(evs):
            log(i, {"phase": "warmup", "explained_variance": ev, "reward": sum(rewards) / len(rewards),
                    "binary_reward": binary})
        world.save(critic, lambda plain: save_critic(plain, out / "critic"))
        world.save_optimizers(run_.stage(spec), {"critic": (critic, optimizer)})
        world.release(critic)
        return {"episodes": len(usable), "updates": len(evs), "ev_first": evs[0] if evs else None,
                "ev_last": evs[-1] if evs else None, "binary_reward": binary}

    def _rpr(self, cfg: RunConfig, run_: RunDir, spec: StageSpec, inputs: StageInputs, out: Path,
             log: Callable[[int, dict], None]) -> dict:
        world, stage_cfg = distributed.current(), spec.config
        # with servers sampling, rank 0 keeps no unsharded actor: each push gathers one
        m = load_models(cfg, inputs.actor, inputs.critic or inputs.actor, trains=True,
                        reference=stage_cfg.kl_coef > 0, keep_unsharded=not cfg.serving.servers)
        actor, critic, tok = m.actor, m.critic, m.tokenizer
        optimizers = make_optimizers(actor, critic, stage_cfg)
        named = {"actor": (actor, optimizers.actor), "critic": (critic, optimizers.critic)}
        if inputs.optimizer is not None:  # a continuation: its source's optimizer.pt or optimizer/ (any world size)
            world.load_optimizers(inputs.optimizer.parent, named)
        # rank 0 talks to the servers; a sharded actor is gathered for each push (sharded_push)
        sync = self._servers(cfg, run_)
        push = sharded_push(world, sync) if sync is not None else None
        if push is not None:
            log(spec.step_offset, {"phase": "sync", **push(actor)})  # the servers start from this stage's actor
        with JsonlWriter(out / "episodes.jsonl") as writer:
            sample = self._rollout_fn(cfg, tok, stage_cfg.temperature, sync, journal=run_.journal(spec))
            rollout_fn = world.rollout_fn(_recording(sample, writer),
                                          gather=not cfg.serving.servers)  # servers sample: no gather per rollout
            history = run_rpr(actor, critic, tok, self.tasks(cfg, run_, "train"), stage_cfg, rollout_fn,
                              self.scales(run_), log_fn=lambda rec: log(spec.step_offset + int(rec["step"]), rec),
                              ref_model=m.reference, optimizers=optimizers, after_actor_update=push, world=world)
        self._save_actor(cfg, actor, tok, out)
        world.save(critic, lambda plain: save_critic(plain, out / "critic"))
        world.save_optimizers(run_.stage(spec), named)
        m.release(world)
        joint = [h for h in history if h.get("phase") == "joint"] or history
        last = joint[-min(3, len(joint)):]
        return {"steps": len(history), "final_binary_reward": _avg(h["binary_reward"] for h in last),
                "final_dense_reward": _avg(h["dense_reward"] for h in last),
                "final_explained_variance": _avg(h["explained_variance"] for h in last)}

    def evaluate(self, cfg: RunConfig, run_: RunDir, spec: StageSpec, actor_dir: Path, out: Path) -> dict:
        """Mean@k of ``actor_dir`` on ``eval.suites``; every rank calls it. The actor is loaded
        like a training stage's (``load_models``) and frozen: pushed to the servers, which
        sample, or rank 0 samples in-process (from its unsharded host copy when sharded)."""
        world, sync = distributed.current(), self._servers(cfg, run_)
        suites = {s: self.tasks(cfg, run_, s) for s in cfg.eval.suites}
        # Every stage is scored with the same seed: common random numbers, so the differences
        # between stages come from the policies rather than from the dice.
        run_eval = lambda actor, tok, sampler=None: evaluate(  # noqa: E731
            actor, tok, suites, k=cfg.eval.k, rollout_cfg=cfg.eval.rollout, out_dir=out,
            seed=stage_seed(cfg.seed, "eval"), sampler=sampler)
        m = load_models(cfg, actor_dir, keep_unsharded=sync is None)
        try:
            if sync is not None:
                sharded_push(world, sync)(m.actor)
                return world.on_main(lambda: run_eval(None, m.tokenizer, sync.sampler))
            plain = world.unsharded(m.actor)
            return world.on_main(lambda: run_eval(plain, m.tokenizer))
        finally:
            m.release(world)


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

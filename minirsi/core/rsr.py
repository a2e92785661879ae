"""Recursive Self-Rewrite (RSR): turn the actor's own verified successes into cleaner SFT data.

docs/method.md section 6. One RSR stage (actor only; the critic is never read or written)::

    runs      = rollout(actor, each task k times)                 # minirsi.engine.rollout.collect
    verified  = [run for run in runs if run.success]              # S = 1, the terminal gate
    cleaned   = clean(run.transcript)                             # drop failed blocks, noise, repeats
    commands  = planner.rewrite(task, cleaned)                    # shorter, cleaner trajectory
    replay    = run `commands` in a FRESH sandbox, then verify    # kept only if S = 1 again
    SFT:  L = -sum_t m_t log pi_theta(x_t | x_<t) / sum_t m_t     # cross-entropy, action tokens only

The SFT sequence of a kept rewrite is ``actions.render_session``: the public instruction, one
```` ```bash```` turn per command answered by the replay's own output, then ``TASK_COMPLETE``
(structured data in, ids out; never a re-tokenised transcript).

Cleaning (ours; the paper names the goal, not the rules), per command block of a turn:

* a turn that ran nothing (a format error, or a bare TASK_COMPLETE) is dropped;
* a block whose status in the observation is not ``[exit 0]`` (failed, ``[timed out]``,
  ``[no exit code]``) is dropped, as is every block of a turn whose sandbox died, unless it was
  *recovered*: the run later ran the same command (comment lines aside) again and it exited 0.
  A recovered failure stays, its error in the observation, so the fix between the two attempts
  is trained where its cause shows (``RSRConfig.keep_recovered``; a failure directly followed by
  its own success answered nothing and goes);
* a block identical to the block kept just before it is dropped (a repeated step), and so is
  a repeat of an earlier read-only inspection (``ls``, ``cat``, ``pwd``, ...: no redirection,
  no pipe into a writer) since it cannot change the state.

Why recovered failures stay: dropping them turns fail -> fix -> redo into fix -> command, a fix
the agent could not have known it needed (the obstacle shows only in the error). Trained on
such runs, the toy RPR-1 actor learnt to run fixes blindly and then to stop, the fix's block
counting as the step's: the episodes of RSR-2 that open with a fix rose from 31 to 143 of 432
(docs/experiments.md, "RSR-2's drop: recover-first rewrites teach blind fixes").

Cleaning can break a run (a failed command may still have had an effect); the replay catches
that, so nothing unverified is trained on.

Planners (one interface, ``Planner.rewrite(task, cleaned) -> list[str]``):

* ``LLMPlanner``: a language model (by default the actor itself, hence "self") is prompted with
  the public instruction and the cleaned transcript and answers in the action format; its
  ```` ```bash```` blocks are the rewrite.
* ``ReplayMinimiser``: starting from the cleaned commands, drops one command at a time (last
  first) and keeps the drop when a fresh replay still passes the verifier.

When the planner's rewrite fails re-verification and ``fallback_to_cleaned`` is set, the
cleaned transcript itself is replayed and verified (ours: a tiny actor is a poor planner, and
the cleaned run is a rewrite too). Several samples of one task that rewrite to the same
commands are trained on once (so easy tasks do not dominate the SFT set).

Call it::

    stats = run_rsr(actor, tokenizer, tasks, cfg, rollout_fn, replay_fn, sampler_factory=HFSampler)

where the engine builds the callables (``minirsi.engine.rollout.make_rollout_fn`` and
``make_replay_fn(cfg.backend, cfg.command_timeout)``, ``minirsi.engine.sampler.HFSampler``):
this module imports nothing outside ``minirsi.core``.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn

from minirsi.core import actions
from minirsi.core.distributed import SINGLE, World
from minirsi.core.episode import Episode, masked_mean, pad_id_of, right_pad
from minirsi.core.optim import adamw, clipped_step
from minirsi.core.scoring import chunked_scores

logger = logging.getLogger(__name__)


@dataclass
class RSRConfig:
    """One Recursive Self-Rewrite stage."""

    samples_per_task: int = 4
    """k: rollouts of the current actor per training task."""
    tasks: int = 0
    """Training tasks sampled: 0 every one, N a seeded sample of N of them (``seed``)."""
    planner: str = "llm"
    """"llm" (the actor rewrites its own cleaned run) or "replay" (ReplayMinimiser)."""
    fallback_to_cleaned: bool = True
    """When the planner's rewrite fails re-verification, try the cleaned transcript itself."""
    keep_recovered: bool = True
    """Cleaning keeps a failed block that the run later ran again successfully (its error is what
    the fix in between answered); False drops every failed block (the recover-first run)."""
    planner_max_new_tokens: int = 256
    """Most tokens the LLM planner may write."""
    planner_temperature: float = 0.0
    """LLM planner sampling temperature (0 = greedy)."""
    lr: float = 1e-5
    """SFT learning rate of this stage (AdamW)."""
    epochs: int = 2
    """SFT passes over the kept rewrites."""
    batch_size: int = 8
    """Sequences per SFT optimizer step."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip."""
    logit_chunk: int = 0
    """Positions per piece of the LM head and log-softmax in the SFT loss (``minirsi.core.scoring``:
    no (B, T, V) logits); 0: the whole sequence at once (the CPU presets)."""
    backend: str = "bwrap"
    """Sandbox backend for replays: bwrap or docker (``engine.rollout.make_replay_fn``'s; the run
    config checks it)."""
    command_timeout: float = 30.0
    """Seconds one replayed command may run."""
    seed: int = 0
    """Seeds rollouts, SFT shuffling and the planner."""

    def __post_init__(self) -> None:
        if self.planner not in ("llm", "replay"):
            raise ValueError(f"RSRConfig.planner={self.planner!r}: use 'llm' or 'replay'")
        for name in ("samples_per_task", "planner_max_new_tokens", "epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"RSRConfig.{name}={getattr(self, name)}: must be >= 1")
        if self.tasks < 0:
            raise ValueError(f"RSRConfig.tasks={self.tasks}: use 0 (every training task) or a count")
        for name in ("lr", "max_grad_norm", "command_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RSRConfig.{name}={getattr(self, name)}: must be > 0")
        if self.logit_chunk < 0:
            raise ValueError(f"RSRConfig.logit_chunk={self.logit_chunk}: use 0 (whole sequence) or a positive chunk")
        if self.planner_temperature < 0:
            raise ValueError(f"RSRConfig.planner_temperature={self.planner_temperature}: must be >= 0 (0 = greedy)")


# --------------------------------------------------------------------------- cleaning


@dataclass(frozen=True)
class Step:
    """One kept command block of a cleaned transcript and the output it printed."""

    command: str
    output: str


_READ_ONLY = {"ls", "cat", "pwd", "head", "tail", "wc", "grep", "find", "stat", "file", "echo", "tree", "du",
              "df", "id", "whoami", "which", "type", "env", "printenv", "date", "diff", "sort", "uniq", "less"}


def _read_only(command: str) -> bool:
    """A single inspection command with no redirection, no chaining into anything else."""
    command = actions.bare_command(command)
    if any(c in command for c in (">", ";", "&", "|", "`", "$(", "\n")):
        return False
    words = command.split()
    if not words or words[0] not in _READ_ONLY:
        return False
    return not (words[0] == "find" and any(w in ("-delete", "-exec", "-execdir") for w in words))


def clean_transcript(transcript: Sequence[dict[str, Any]], keep_recovered: bool = True) -> list[Step]:
    """Episode.transcript -> the kept command blocks, in order (rules in the module docstring)."""
    blocks = [(cmd.strip("\n"), out, good) for turn in transcript
              for cmd, out, good in actions.read_blocks(turn.get("commands") or [], turn.get("observation"))]
    recovered, later_ok = [False] * len(blocks), set()
    for i in reversed(range(len(blocks))):  # a failure is recovered when the same command succeeds later
        cmd, _, good = blocks[i]
        if good:
            later_ok.add(actions.bare_command(cmd))
        else:
            recovered[i] = keep_recovered and actions.bare_command(cmd) in later_ok
    kept: list[Step] = []
    failed_last = False  # whether kept[-1] is a recovered failure
    seen_reads: set[str] = set()
    for (cmd, out, good), rec in zip(blocks, recovered):
        if not cmd.strip() or not (good or rec):
            continue
        if kept and kept[-1].command == cmd:
            if good and failed_last:  # the failure was followed by its own success: nothing answered it
                kept[-1], failed_last = Step(cmd, out), False
            continue
        if _read_only(cmd):
            if cmd in seen_reads:
                continue
            seen_reads.add(cmd)
        kept.append(Step(cmd, out))
        failed_last = not good
    return kept


# --------------------------------------------------------------------------- replay


@dataclass
class Replay:
    """A command list run in a fresh sandbox, then verified."""

    commands: list[str]
    outputs: list[str]
    exit_codes: list[int | None]
    success: bool
    passed: int
    total: int


ReplayFn = Callable[[Any, Sequence[str]], Replay]
"""``replay_fn(task, commands) -> Replay``: a fresh sandbox per call (the default:
``minirsi.engine.rollout.make_replay_fn``)."""

SamplerFactory = Callable[[nn.Module, Any], Any]
"""``sampler_factory(model, tokenizer) -> sampler``: an in-process sampler of ``model`` for the LLM
planner (``minirsi.engine.sampler.HFSampler``)."""


# --------------------------------------------------------------------------- planners


class Planner(Protocol):
    def rewrite(self, task: Any, cleaned: Sequence[Step]) -> list[str]:
        """A shorter, cleaner command list that should still solve ``task``."""
        ...


class ReplayMinimiser:
    """Greedy: try dropping each command (last first); keep a drop when a fresh replay still
    passes the verifier. Costs len(cleaned) + 1 replays; the result is 1-minimal (no single
    command can be removed)."""

    def __init__(self, replay_fn: ReplayFn):
        self.replay_fn = replay_fn

    def rewrite(self, task: Any, cleaned: Sequence[Step]) -> list[str]:
        commands = [s.command for s in cleaned]
        if not self.replay_fn(task, commands).success:
            return commands  # cleaning broke the run; nothing to minimise (re-verification rejects it)
        for i in reversed(range(len(commands))):
            trial = commands[:i] + commands[i + 1:]
            if self.replay_fn(task, trial).success:
                commands = trial
        return commands


PLANNER_INSTRUCTION = (
    "{instruction}\n\nA run that solved this task ran these commands (with their output):\n{steps}\n"
    "Solve the task again with as few commands as possible."
)
"""The LLM planner's user message: the public instruction and the cleaned run, nothing else
(no verifier, no oracle solution). Its reply is read with ``actions.parse_action``."""


class LLMPlanner:
    """Prompt a language model (by default the actor) with the task and the cleaned run; its
    ```` ```bash```` blocks are the rewrite."""

    def __init__(self, model: nn.Module, tokenizer: Any, max_new_tokens: int = 256,
                 temperature: float = 0.0, seed: int = 0, sampler: Any = None, obs_chars: int = 200,
                 sampler_factory: SamplerFactory | None = None):
        self.tokenizer = tokenizer
        if sampler is None:
            if sampler_factory is None:
                raise ValueError("LLMPlanner: pass a sampler, or a sampler_factory(model, tokenizer) "
                                 "such as minirsi.engine.sampler.HFSampler")
            sampler = sampler_factory(model, tokenizer)
        self.sampler = sampler
        self.max_new_tokens, self.temperature, self.seed, self.obs_chars = max_new_tokens, temperature, seed, obs_chars
        self.stop_id = actions.special_id(tokenizer, actions.IM_END)  # the end of every ChatML turn

    def prompt_text(self, task: Any, cleaned: Sequence[Step]) -> str:
        # the tail of each output: where results and errors show
        steps = "\n".join(f"$ {s.command}\n{s.output[-self.obs_chars:]}".rstrip() for s in cleaned)
        return PLANNER_INSTRUCTION.format(instruction=task.instruction, steps=steps)

    def rewrite(self, task: Any, cleaned: Sequence[Step]) -> list[str]:
        prompt = actions.render_prompt_ids(self.tokenizer, self.prompt_text(task, cleaned))
        self.seed += 1
        (sample,) = self.sampler.generate([prompt], self.max_new_tokens, self.temperature, [self.stop_id], self.seed)
        return actions.parse_action(actions.decode_action(self.tokenizer, sample.token_ids)).commands


# --------------------------------------------------------------------------- SFT


@dataclass
class _Turn:
    commands: list[str]
    output: str
    exit_code: int | None


@dataclass
class _Session:
    instruction: str
    turns: list[_Turn]


def render_rewrite(tokenizer: Any, task: Any, replay: Replay) -> tuple[list[int], list[int], list[int]]:
    """A verified replay -> (token_ids, action_mask, turn_ids) via ``actions.render_session``."""
    turns = [_Turn([c], o, e) for c, o, e in zip(replay.commands, replay.outputs, replay.exit_codes)]
    return actions.render_session(tokenizer, _Session(task.instruction, turns))


def sft_loss(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             action_mask: torch.Tensor, normalizer: torch.Tensor | None = None, logit_chunk: int = 0) -> torch.Tensor:
    """L = -sum_t m_t log pi(x_t | x_<t) / sum_t m_t, all (B, T) inputs; token mean over the
    batch's action tokens (prompt, observation and padding never enter). ``normalizer``
    replaces sum_t m_t (a sharded step passes N / W, minirsi.core.distributed). ``logit_chunk`` > 0:
    the log-probs from ``scoring.chunked_scores`` (the same values, no (B, T, V) logits)."""
    if logit_chunk:
        logprobs, _ = chunked_scores(model, input_ids, attention_mask, 1.0, logit_chunk)  # (B, T)
        return masked_mean(-logprobs[:, 1:], action_mask[:, 1:], normalizer)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()  # (B, T-1, V)
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none")  # (B, T-1)
    return masked_mean(nll, action_mask[:, 1:], normalizer)


def make_optimizer(model: nn.Module, cfg: RSRConfig) -> torch.optim.Optimizer:
    """AdamW at ``cfg.lr`` over the trainable parameters (LoRA: the adapters only)."""
    return adamw(model.parameters(), cfg.lr)


def sft(model: nn.Module, examples: Sequence[tuple[list[int], list[int]]], cfg: RSRConfig, pad_id: int,
        optimizer: torch.optim.Optimizer | None = None, world: World = SINGLE) -> list[float]:
    """Cross-entropy on action tokens: ``cfg.epochs`` seeded-shuffled passes, AdamW at ``cfg.lr``
    (``optimizer``, when given, is used and keeps its state for the caller to checkpoint).

    examples: (token_ids, action_mask) pairs. Returns the loss of every optimizer step.
    Sharded (``world``): every rank builds the same batch and trains on its rows of it."""
    if not examples:
        return []
    opt = optimizer if optimizer is not None else make_optimizer(model, cfg)
    rng = random.Random(cfg.seed)
    losses = []
    model.train()
    for _ in range(cfg.epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        for s in range(0, len(order), cfg.batch_size):
            batch = [examples[i] for i in order[s:s + cfg.batch_size]]
            ids, att, act = right_pad([x for x, _ in batch], pad_id, [m for _, m in batch])
            device = next(model.parameters()).device
            if world.size == 1:
                loss = sft_loss(model, ids.to(device), att.to(device), act.to(device), logit_chunk=cfg.logit_chunk)
            else:  # this rank's rows, normalised by N / W
                mine = world.local({"input_ids": ids, "attention_mask": att, "action_mask": act})
                n = world.normalizer(mine["action_mask"][:, 1:].sum().clamp(min=1))
                loss = sft_loss(model, *(mine[k].to(device) for k in ("input_ids", "attention_mask", "action_mask")),
                                normalizer=n, logit_chunk=cfg.logit_chunk)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            clipped_step(opt, cfg.max_grad_norm)
            losses.append(float(world.all_sum(loss.detach())) / world.size)  # the whole batch's loss
    return losses


# --------------------------------------------------------------------------- the stage


@dataclass
class RSRStats:
    """What one RSR stage did (all counts are runs, i.e. episodes)."""

    runs_sampled: int = 0
    runs_verified: int = 0
    """Sampled runs the verifier passed (S = 1)."""
    rewritten: int = 0
    """Verified runs the planner turned into a non-empty command list."""
    reverified: int = 0
    """Rewrites (planner or cleaned fallback) that passed again in a fresh sandbox."""
    from_fallback: int = 0
    """Of ``reverified``, how many are the cleaned transcript (the planner's rewrite failed)."""
    sft_examples: int = 0
    """Distinct (task, commands) rewrites trained on."""
    mean_turns_before: float = 0.0
    """Mean turns of the verified runs."""
    mean_turns_after: float = 0.0
    """Mean turns of the re-verified rewrites, one per verified run like ``mean_turns_before``
    (one turn per command + the final TASK_COMPLETE turn)."""
    sft_loss_first: float = float("nan")
    sft_loss_last: float = float("nan")
    seconds: float = 0.0
    kept: list[dict[str, Any]] = field(default_factory=list)
    """Per trained-on rewrite: task_id, commands, source ("planner" | "cleaned")."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sample_tasks(tasks: Sequence[Any], n: int, seed: int) -> list[Any]:
    """``n`` of ``tasks`` drawn without replacement (seeded, in pool order); all when n is 0."""
    if not n or n >= len(tasks):
        return list(tasks)
    keep = set(random.Random(seed).sample(range(len(tasks)), n))
    return [t for i, t in enumerate(tasks) if i in keep]


def make_planner(cfg: RSRConfig, actor: nn.Module | None, tokenizer: Any, replay_fn: ReplayFn,
                 sampler: Any = None, sampler_factory: SamplerFactory | None = None) -> Planner:
    """``cfg.planner``'s planner; the LLM planner samples ``actor`` in-process
    (``sampler_factory(actor, tokenizer)``), or ``sampler``."""
    if cfg.planner == "replay":
        return ReplayMinimiser(replay_fn)
    return LLMPlanner(actor, tokenizer, cfg.planner_max_new_tokens, cfg.planner_temperature, cfg.seed, sampler=sampler,
                      sampler_factory=sampler_factory)


def run_rsr(
    actor: nn.Module,
    tokenizer: Any,
    train_tasks: Sequence[Any],
    cfg: RSRConfig,
    rollout_fn: Callable[[nn.Module, Sequence[Any], int], list[Episode]],
    replay_fn: ReplayFn,
    planner: Planner | None = None,
    log_fn: Callable[[dict[str, Any]], None] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    world: World = SINGLE,
    planner_sampler: Any = None,
    sampler_factory: SamplerFactory | None = None,
) -> RSRStats:
    """One RSR stage on ``actor`` (fine-tuned in place). The critic is not an argument: RSR
    cannot touch it.

    Args:
        rollout_fn: ``rollout_fn(actor, tasks, seed) -> episodes``
            (``minirsi.engine.rollout.make_rollout_fn``).
        replay_fn: a fresh sandbox + the verifier per call
            (``minirsi.engine.rollout.make_replay_fn(cfg.backend, cfg.command_timeout)``).
        planner: defaults to ``cfg.planner`` (LLMPlanner on the actor, or ReplayMinimiser).
        optimizer: the SFT optimizer (default: ``make_optimizer``); pass one to checkpoint it.
        world: a sharded run (minirsi.core.distributed): rank 0 samples (``rollout_fn`` is then
            ``world.rollout_fn(...)``), rewrites and replays with an unsharded copy of the actor,
            every rank gets the SFT examples and trains on its share of each batch.
        planner_sampler: where the default LLM planner samples (inference servers holding the
            actor's weights); then no unsharded copy is gathered for it. Every rank passes one
            or none alike (the gather is a collective).
        sampler_factory: without ``planner_sampler``, how the default LLM planner samples the
            actor in-process: ``sampler_factory(actor, tokenizer)`` (``engine.sampler.HFSampler``).
    """
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    cache: dict[tuple[str, tuple[str, ...]], Replay] = {}

    def replay(task: Any, commands: Sequence[str]) -> Replay:
        # Each distinct (task, commands) is replayed once, each time in a fresh sandbox.
        key = (task.task_id, tuple(commands))
        if key not in cache:
            cache[key] = replay_fn(task, commands)
        return cache[key]

    by_id = {t.task_id: t for t in train_tasks}
    pool = sample_tasks(train_tasks, cfg.tasks, cfg.seed)
    tasks = [t for t in pool for _ in range(cfg.samples_per_task)]
    was_training = actor.training
    actor.eval()
    episodes = rollout_fn(actor, tasks, cfg.seed)
    # the LLM planner samples from rank 0's plain copy, or on the servers
    plain = world.unsharded(actor) if planner_sampler is None else None
    stats, examples = world.on_main(lambda: _rewrite(episodes, planner or make_planner(cfg, plain, tokenizer, replay,
                                                                                       planner_sampler, sampler_factory),
                                                     replay, by_id, tokenizer, cfg))
    actor.train(was_training)
    stats.sft_examples = len(examples)
    losses = sft(actor, list(examples.values()), cfg, pad_id_of(tokenizer), optimizer, world)
    if losses:
        stats.sft_loss_first, stats.sft_loss_last = losses[0], losses[-1]
    stats.seconds = time.perf_counter() - t0
    logger.info("RSR: sampled %d, verified %d, rewritten %d, re-verified %d (%d cleaned), turns %.2f -> %.2f, "
                "SFT loss %.3f -> %.3f", stats.runs_sampled, stats.runs_verified, stats.rewritten,
                stats.reverified, stats.from_fallback, stats.mean_turns_before, stats.mean_turns_after,
                stats.sft_loss_first, stats.sft_loss_last)
    if log_fn is not None:
        log_fn({k: v for k, v in stats.to_dict().items() if k != "kept"})
    return stats


def _rewrite(episodes: Sequence[Episode], planner: Planner, replay: ReplayFn, by_id: dict[str, Any],
             tokenizer: Any, cfg: RSRConfig) -> tuple[RSRStats, dict[tuple[str, tuple[str, ...]], tuple[list[int], list[int]]]]:
    """Verified runs -> cleaned -> rewritten -> re-verified -> distinct SFT examples."""
    stats = RSRStats(runs_sampled=len(episodes))
    verified = [e for e in episodes if e.success]
    stats.runs_verified = len(verified)
    stats.mean_turns_before = sum(e.turns for e in verified) / len(verified) if verified else 0.0

    examples: dict[tuple[str, tuple[str, ...]], tuple[list[int], list[int]]] = {}
    turns_after: list[int] = []
    with torch.no_grad():
        for ep in verified:
            task = by_id[ep.task_id]
            cleaned = clean_transcript(ep.transcript, cfg.keep_recovered)
            commands = planner.rewrite(task, cleaned) if cleaned else []
            stats.rewritten += bool(commands)
            result, source = (replay(task, commands), "planner") if commands else (None, "planner")
            if (result is None or not result.success) and cfg.fallback_to_cleaned and cleaned:
                result, source = replay(task, [s.command for s in cleaned]), "cleaned"
            if result is None or not result.success:
                continue
            stats.reverified += 1
            stats.from_fallback += source == "cleaned"
            turns_after.append(len(result.commands) + 1)
            key = (task.task_id, tuple(result.commands))
            if key not in examples:
                ids, mask, _ = render_rewrite(tokenizer, task, result)
                examples[key] = (ids, mask)
                stats.kept.append({"task_id": task.task_id, "commands": list(result.commands), "source": source})
    stats.mean_turns_after = sum(turns_after) / len(turns_after) if turns_after else 0.0
    return stats, examples

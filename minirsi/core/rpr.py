"""Recursive Policy-Refine (RPR): PPO on the shell agent with TB-GAE and an inherited critic.

docs/method.md section 6. One RPR step is::

    episodes = rollout(actor, tasks)                      # minirsi.engine.rollout.collect, behind a callable
    r        = FDR or SPR of each episode                 # on its last action token (episode.collate)
    V_old    = critic(x);  logp_old = log pi_theta(x)     # no grad, before any update
    A, R     = TB-GAE(r, V_old, action_mask, turn_ids, gamma_turn, lam_turn)
    A        = (A - mean(A)) / std(A)                     # only if whiten_advantages (off by default)
    ppo_epochs x minibatches (x grad_accum micro-batches):
        L = L_clip + c_v L_V + beta KL(pi_theta || pi_ref) - c_H H

with, over action tokens t only (m_t = 1), each a token mean over the minibatch (N tokens)::

    rho_t   = exp(log pi_theta(a_t) - logp_old_t)
    L_clip  = -sum_t m_t w_t min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t) / N
    w_t     = min(exp(logp_old_t - logp_sampler_t), C)   (no grad; w_t = 1 when tis_cap is 0)
    L_V     = clipped value loss, minirsi.core.critic.value_loss
    KL      = sum_t m_t k3_t / N,  k3_t = exp(d_t) - d_t - 1,  d_t = log pi_ref(a_t) - log pi_theta(a_t)
    H       = sum_t m_t H(pi_theta(. | x_<t)) / N

Choices the paper leaves open, ours:

* Token mean over the minibatch (not a per-sequence mean): every action token weighs the
  same, so long episodes are not down-weighted.
* The joint loss is backpropagated one model at a time in each micro-batch: the actor's
  forward and backward, then the critic's (as veRL updates actor and critic in turn). The two
  share no parameter, so the gradients are those of ``L_clip + c_v L_V`` at once, bit for bit,
  while only one model's activations (and logits) are alive at a time. Gradient accumulation divides every
  micro-batch by the minibatch's N, so accumulating equals one big minibatch exactly.
* logp_old is recomputed by the training model at the start of the step (as veRL does), not
  the sampler's log-probs: the sampler may differ numerically (another kernel, vLLM). The gap
  is logged, ``logprob_gap = mean_t |logp_train - logp_sample|`` (paper: 4.66e-3 to 4.98e-3).
* Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"): the rollouts were drawn by the sampler, not by the
  trainer's pi_old, so each action token's surrogate is weighted by the ratio of the two,
  capped at C (``tis_cap``) so a token the sampler found much likelier than the trainer does
  cannot dominate the batch. Logged: ``tis_capped_frac``, the share of action tokens whose
  ratio exceeded C, beside ``logprob_gap``. On by default (C = 2) when rollouts come from
  inference servers (``tis_cap`` None, resolved by the recipe), off in-process.
* KL uses the k3 estimator (unbiased for KL(pi_theta || pi_ref), always >= 0); off by default
  (beta = 0). The reference is the LoRA-disabled actor when the actor is a peft model,
  otherwise a frozen copy of the actor taken when the stage starts.
* Advantages are not whitened by default (``whiten_advantages``): once every episode of a batch
  gets the same reward (a pool the actor has mastered), the advantages are only the critic's
  small errors, and dividing them by their std turns that noise into unit-size pushes. On one
  toy task (bench/ladder.py) whitened PPO went 0.66 -> 1.00 success and then collapsed to 0.03
  in two steps (step KL 0.45); unwhitened it went 0.21 -> 0.99 and stayed there.
* Groups (``samples_per_task`` G, ``drop_uniform_groups``): a step may draw fewer tasks and
  roll each out G times. A task whose G episodes all end alike (all solved, all failed) teaches
  the actor little beyond the critic's errors on it; with ``drop_uniform_groups`` such tasks
  leave the update (DAPO's dynamic sampling), and a step in which no task has both outcomes
  updates the critic only. ``oversample`` draws extra groups so that the step still has
  ``episodes_per_step / G`` mixed groups to train on: the pool filtered to the edge of the
  actor's competence. ``pool_sampling="edge"`` moves the draw itself there: tasks are drawn
  by bucket (``pool_buckets``: difficulty by default), each bucket as often as its groups so
  far were mixed (``EdgeStream``). Success is logged over every episode rolled out (``binary_reward``) and,
  by bucket, weighed to what a uniform draw of the pool would measure (``pool_success``).
* Calibration: the first ``critic_calibration_updates`` steps of a phase update the critic only
  (each on fresh rollouts of the frozen actor, as veRL's ``critic_warmup``); ``steps`` joint
  steps follow, so a phase runs calibration + steps rollouts.

Metrics logged per update (one dict per step; formulas above): ``reward`` (the trained-on
reward), ``dense_reward`` (mean FDR), ``binary_reward`` (mean S), ``turns``, ``kl_ref``,
``approx_kl`` (k3 estimate of KL(pi_old || pi_theta) on the rollout's tokens, measured on each
minibatch before its step),
``clip_frac`` (share of action tokens with |rho - 1| > eps), ``explained_variance`` (of V_old
against R, minirsi.core.critic), ``entropy``, ``logprob_gap``, losses, gradient norms (before
clipping), action tokens, seconds in rollout and in update; with TIS ``tis_capped_frac``; with
an ``after_actor_update`` hook its metrics (the weight sync's ``sync_s``, ``sync_bytes``, ...).

Call it::

    history = run_rpr(actor, critic, tokenizer, tasks, RPRConfig(), rollout_fn, scales)
"""

from __future__ import annotations

import copy
import logging
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
from torch import nn

from minirsi.core.critic import ValueModel, critic_step, explained_variance, value_loss
from minirsi.core.distributed import SINGLE, World
from minirsi.core.episode import Episode, collate, masked_mean, minibatches, pad_id_of, trimmed
from minirsi.core.fdr import family_dense_reward
from minirsi.core.optim import adamw, clipped_step
from minirsi.core.scoring import chunked_scores, logprobs_from_logits
from minirsi.core.spr import success_prioritized_reward
from minirsi.core.tb_gae import tb_gae

logger = logging.getLogger(__name__)

RolloutFn = Callable[[nn.Module, Sequence[Any], int], list[Episode]]
"""``rollout_fn(actor, tasks, seed) -> episodes``: one episode per task entry (tasks may
repeat). ``minirsi.engine.rollout.make_rollout_fn`` builds the default (HFSampler +
rollout.collect); a vLLM-backed sampler slots in by passing another callable."""


@dataclass
class RPRConfig:
    """One Recursive Policy-Refine stage (PPO with TB-GAE and an inherited critic)."""

    gamma_turn: float = 1.0
    """gamma_turn: TB-GAE discount applied once per turn boundary (not per token)."""
    lam_turn: float = 0.95
    """lambda_turn: TB-GAE trace decay applied once per turn boundary."""
    clip_eps: float = 0.2
    """epsilon: PPO ratio clip, rho in [1 - eps, 1 + eps]."""
    value_clip: float = 0.2
    """epsilon_v: value clip around V_old; 0 turns value clipping off."""
    value_coef: float = 1.0
    """c_v: weight of L_V in the joint loss (actor and critic have separate optimizers, so it
    only rescales the critic's gradient)."""
    kl_coef: float = 0.0
    """beta: weight of KL(pi_theta || pi_ref) (k3 estimator); 0 = no reference policy."""
    entropy_coef: float = 0.0
    """c_H: entropy bonus weight; entropy is always logged."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    target_kl: float = 0.0
    """Early stop: once a minibatch's approx_kl (KL(pi_old || pi_theta), ``approx_kl``, measured
    before its update) exceeds ``target_kl``, the actor takes no more optimizer steps this RPR
    step (the critic's minibatches go on). 0 = off. Lets a stage use a larger ``lr_actor``
    without the policy running away from the rollouts it learns from."""
    minibatch_size: int = 8
    """Episodes per optimizer step."""
    grad_accum: int = 1
    """Micro-batches per minibatch (gradient accumulation, bounds memory)."""
    lr_actor: float = 1e-5
    """Actor learning rate for this stage (AdamW)."""
    lr_critic: float = 1e-5
    """Critic learning rate for this stage (AdamW)."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip, per model."""
    lr_warmup_updates: int = 0
    """Linear warm-up of the actor's learning rate over its first optimizer steps (counted by
    the optimizer's own state, so a resumed or continued stage goes on where it stopped);
    0 = none. Adam's first steps move every parameter by ~lr whatever the gradient's size,
    which on a small model can swing some token probabilities by orders of magnitude."""
    episodes_per_step: int = 16
    """Rollouts per RPR step (tasks are cycled in a seeded shuffled order, repeating as needed)."""
    samples_per_task: int = 1
    """G: rollouts of each drawn task per step, so a step holds ``episodes_per_step / G`` tasks
    (must divide it). G > 1 puts a task's successes and failures in the same update."""
    drop_uniform_groups: bool = False
    """Leave out of the update every task whose G episodes all succeeded or all failed (their
    success rate is logged all the same). With G > 1 only; module docstring."""
    oversample: int = 1
    """With ``drop_uniform_groups``: roll out this many times ``episodes_per_step`` (the extra
    groups drawn from the same stream) and train on the first ``episodes_per_step / G`` groups
    with both outcomes: the pool filtered, step by step, to the tasks the actor solves sometimes
    (DAPO's dynamic sampling, with a bounded draw instead of "until the batch is full")."""
    pool_sampling: str = "uniform"
    """How a step draws its tasks. "uniform": a seeded shuffle of the pool (``task_stream``).
    "edge": by bucket (``pool_buckets``), each bucket as often as its groups so far held both
    outcomes (``EdgeStream``): draws move to the tasks the actor solves sometimes, and away from
    buckets it always or never solves, which every bucket keeps being tried on.
    Logged either way: ``pool_success``, what a uniform draw would measure (``EdgeStream.pool_success``;
    with uniform draws, the step's success)."""
    pool_buckets: str = "difficulty"
    """With ``pool_sampling="edge"``: the task fields, comma-separated, that make a bucket
    ("difficulty", "family,difficulty"). Fewer buckets learn their weights from fewer steps."""
    steps: int = 20
    """Joint (actor + critic) PPO steps, after the calibration updates."""
    critic_calibration_updates: int = 4
    """Critic-only steps that open the phase (paper: 4), on fresh rollouts of the frozen actor."""
    reward: str = "spr"
    """Training reward: "fdr" (P / D_f) or "spr" (S + P / (P + D'_f)); docs/method.md section 2."""
    advantage: str = "tb_gae"
    """Advantage estimator. "tb_gae": TB-GAE (the method). "token_gae": the paper's ablation,
    plain per-token GAE over the action tokens, every action token its own step with gamma 1 and
    lambda = ``lam_turn`` per token (the usual LLM-PPO setting), so credit decays with the number
    of tokens instead of turns. (Observation tokens are skipped in both, so the ablation isolates
    the turn-level decay; our choice, the paper does not define its baseline further.)"""
    whiten_advantages: bool = False
    """Normalise A to zero mean, unit variance over the batch's action tokens (common in LLM
    PPO; off by default: it amplifies the noise of a batch whose rewards are all equal, module
    docstring)."""
    temperature: float = 1.0
    """Sampling temperature; training log-probs use logits / temperature to match it."""
    tis_cap: float | None = None
    """C: truncated importance sampling on the sampler's log-probs, each action token weighted
    by min(exp(logp_old - logp_sampler), C) (module docstring). 0: off. None: the recipe
    picks 2.0 when rollouts come from servers (``serving.servers``) and 0 in-process, where the
    same weights sample and score; ``run_rpr`` called directly treats None as 0."""
    forward_chunk: int = 8
    """Sequences per no-grad forward pass (old log-probs, values, reference); the passes take
    the sequences longest first, each cut to its rows' longest length. At scale 1: one
    8192-token sequence's activations per pass (``minirsi plan`` counts it)."""
    logit_chunk: int = 0
    """Positions per piece of the LM head + log-softmax + entropy (``minirsi.core.scoring``: no
    (B, T, V) logits, recomputed per piece in backward); 0: the whole sequence at once, from
    the model's logits (the CPU presets; their results were made this way). The scale configs
    set 1024."""
    seed: int = 0
    """Seeds task order, minibatch shuffles and rollouts."""

    @property
    def bucket_fields(self) -> list[str]:
        """``pool_buckets`` as a list of task fields."""
        return [f.strip() for f in self.pool_buckets.split(",")]

    def __post_init__(self) -> None:
        for name in ("gamma_turn", "lam_turn"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"RPRConfig.{name}={getattr(self, name)}: must be in [0, 1]")
        if not 0.0 < self.clip_eps < 1.0:
            raise ValueError(f"RPRConfig.clip_eps={self.clip_eps}: must be in (0, 1), e.g. 0.2")
        for name in ("value_clip", "value_coef", "kl_coef", "entropy_coef", "target_kl"):
            if getattr(self, name) < 0:
                raise ValueError(f"RPRConfig.{name}={getattr(self, name)}: must be >= 0")
        if self.lr_warmup_updates < 0:
            raise ValueError(f"RPRConfig.lr_warmup_updates={self.lr_warmup_updates}: must be >= 0")
        for name in ("ppo_epochs", "minibatch_size", "grad_accum", "episodes_per_step", "forward_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"RPRConfig.{name}={getattr(self, name)}: must be >= 1")
        if self.grad_accum > self.minibatch_size:
            raise ValueError(f"RPRConfig.grad_accum={self.grad_accum} > minibatch_size={self.minibatch_size}: "
                             "a micro-batch needs at least one episode; lower grad_accum")
        if self.samples_per_task < 1 or self.episodes_per_step % self.samples_per_task:
            raise ValueError(f"RPRConfig.samples_per_task={self.samples_per_task}: must be >= 1 and divide "
                             f"episodes_per_step={self.episodes_per_step}")
        if self.oversample < 1 or (self.oversample > 1 and not self.drop_uniform_groups):
            raise ValueError(f"RPRConfig.oversample={self.oversample}: must be >= 1, and > 1 only with "
                             "drop_uniform_groups=true (the extra groups are there to be filtered)")
        if self.pool_sampling not in ("uniform", "edge"):
            raise ValueError(f"RPRConfig.pool_sampling={self.pool_sampling!r}: use 'uniform' or 'edge'")
        if not all(f in ("family", "difficulty") for f in self.bucket_fields):
            raise ValueError(f"RPRConfig.pool_buckets={self.pool_buckets!r}: use task fields 'family' and/or "
                             "'difficulty', comma-separated")
        if self.pool_sampling == "edge" and self.samples_per_task < 2:
            raise ValueError("RPRConfig.pool_sampling='edge' needs samples_per_task >= 2 (it weighs buckets by "
                             "how often a task's group holds both outcomes)")
        if self.drop_uniform_groups and self.samples_per_task < 2:
            raise ValueError("RPRConfig.drop_uniform_groups needs samples_per_task >= 2 (a group of one "
                             "episode is always uniform)")
        for name in ("steps", "critic_calibration_updates", "logit_chunk"):
            if getattr(self, name) < 0:
                raise ValueError(f"RPRConfig.{name}={getattr(self, name)}: must be >= 0")
        for name in ("lr_actor", "lr_critic", "max_grad_norm", "temperature"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RPRConfig.{name}={getattr(self, name)}: must be > 0")
        if self.reward not in ("fdr", "spr"):
            raise ValueError(f"RPRConfig.reward={self.reward!r}: use 'fdr' or 'spr'")
        if self.advantage not in ("tb_gae", "token_gae"):
            raise ValueError(f"RPRConfig.advantage={self.advantage!r}: use 'tb_gae' (the method) or 'token_gae' "
                             "(the per-token GAE ablation)")
        if self.tis_cap is not None and self.tis_cap != 0 and not self.tis_cap >= 1:
            raise ValueError(f"RPRConfig.tis_cap={self.tis_cap}: use 0 (off), None (auto) or a cap C >= 1, e.g. 2")


class Optimizers(NamedTuple):
    actor: torch.optim.Optimizer
    critic: torch.optim.Optimizer


def make_optimizers(actor: nn.Module, critic: ValueModel, cfg: RPRConfig) -> Optimizers:
    """AdamW per model with the stage's own learning rates."""
    return Optimizers(adamw(actor.parameters(), cfg.lr_actor), adamw(critic.parameters(), cfg.lr_critic))


# --------------------------------------------------------------------------- pure losses


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_eps: float,
    normalizer: float | torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate L_clip (module docstring), token mean over action tokens.

    Args:
        logprobs: log pi_theta(a_t), (B, T), with grad.
        old_logprobs: logp_old, (B, T).
        advantages: A, (B, T).
        action_mask: m, (B, T).
        clip_eps: eps.
        normalizer: N (see ``critic.value_loss``).
        is_weights: w (B, T), truncated importance weights (``truncated_is_weights``); None: 1.
    Returns:
        (loss, clip_frac): clip_frac = share of action tokens with |rho - 1| > eps (no grad).
    """
    m = action_mask.bool()
    log_ratio = torch.where(m, logprobs - old_logprobs, torch.zeros_like(logprobs))  # (B, T), 0 off-action
    ratio = torch.exp(log_ratio)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    if is_weights is not None:
        surrogate = surrogate * is_weights.detach()
    loss = -masked_mean(surrogate, m, normalizer)
    clip_frac = masked_mean(((ratio - 1).abs() > clip_eps).float(), m).detach()
    return loss, clip_frac


def truncated_is_weights(
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    cap: float,
) -> tuple[torch.Tensor, float]:
    """TIS weights w_t = min(exp(logp_old_t - logp_sampler_t), C) and the capped share.

    old_logprobs (trainer, pi_old), sampler_logprobs (the rollout's), action_mask: (B, T).
    Returns (w (B, T), no grad, 1 off action tokens; share of action tokens with ratio > C).
    Example: logp_old - logp_sampler = [0, ln 3, -ln 2] on three action tokens, C = 2 ->
    w = [1, 2, 0.5], capped share 1/3.
    """
    m = action_mask.bool()
    log_ratio = torch.where(m, old_logprobs - sampler_logprobs, torch.zeros_like(old_logprobs)).detach()
    ratio = torch.exp(log_ratio)  # (B, T)
    capped = float(masked_mean((ratio > cap).float(), m))
    return ratio.clamp(max=cap), capped


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """k3 estimate of KL(pi_theta || pi_ref), token mean over action tokens.

    k3_t = exp(d_t) - d_t - 1 with d_t = log pi_ref(a_t) - log pi_theta(a_t), a_t ~ pi_theta:
    unbiased (E[exp(d)] = 1), never negative, lower variance than k1 = -d (Schulman, "Approximating
    KL divergence", 2020). logprobs and ref_logprobs: (B, T).
    """
    m = action_mask.bool()
    d = torch.where(m, ref_logprobs - logprobs, torch.zeros_like(logprobs))  # (B, T)
    return masked_mean(torch.exp(d) - d - 1, m, normalizer)


def approx_kl(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """k3 estimate of KL(pi_old || pi_theta) on tokens sampled from pi_old, token mean.

    k3_t = (r_t - 1) - log r_t with r_t = pi_theta(a_t) / pi_old(a_t): unbiased because
    E_old[r] = 1, never negative. The rollout's tokens come from pi_old, so this is the
    direction the samples support. (``kl_penalty``'s form, exp(-log r) + log r - 1, is the
    estimator for samples from pi_theta; on pi_old's samples its mean is chi^2 - KL, and a token
    whose log-prob fell by 3 nats would count 16.1 instead of 2.05.) (B, T) inputs.
    """
    # kl_penalty's k3 with the two policies swapped: d = log pi_theta - log pi_old = log r
    return kl_penalty(old_logprobs, logprobs, action_mask, normalizer)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H(pi(. | x_<t)) = -sum_v p_v log p_v, (B, T, V) -> (B, T)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def whiten(advantages: torch.Tensor, action_mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(A - mean) / (std + eps) over action tokens; non-action positions stay 0. (B, T)."""
    m = action_mask.bool()
    a = advantages[m]
    if a.numel() < 2:
        return torch.where(m, advantages - (a.mean() if a.numel() else 0.0), torch.zeros_like(advantages))
    out = (advantages - a.mean()) / (a.std(unbiased=False) + eps)
    return torch.where(m, out, torch.zeros_like(out))


def policy_forward(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float,
    with_entropy: bool = False, entropy_grad: bool = True, logit_chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs log pi(x_t | x_<t) at ``temperature`` (``scoring.logprobs_from_logits``,
    in one piece), and optionally entropies.

    input_ids, attention_mask: (B, T). Returns (logprobs (B, T), entropy (B, T) or None), both 0
    at position 0. ``entropy_grad=False`` computes the entropy as a metric only (no graph: saves
    a few (B, T, V) activations). ``logit_chunk`` > 0: the same values from
    ``scoring.chunked_scores``, ``logit_chunk`` positions at a time, without (B, T, V) logits.
    """
    if logit_chunk:
        return chunked_scores(model, input_ids, attention_mask, temperature, logit_chunk, with_entropy, entropy_grad)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
    logprobs = logprobs_from_logits(logits, input_ids, temperature, chunk_size=None)  # (B, T)
    if not with_entropy:
        return logprobs, None
    with nullcontext() if entropy_grad else torch.no_grad():
        entropy = entropy_from_logits(logits[:, :-1].float() / temperature)  # (B, T-1)
        return logprobs, torch.cat([logprobs.new_zeros(logprobs.shape[0], 1), entropy], dim=1)


def _nograd_logprobs(model: nn.Module, batch: dict[str, torch.Tensor], cfg: RPRConfig,
                     ctx: Callable[[], Any] = nullcontext, world: World = SINGLE) -> torch.Tensor:
    with ctx():
        return world.forward_rows(lambda ids, am: policy_forward(model, ids, am, cfg.temperature,
                                                                 logit_chunk=cfg.logit_chunk)[0],
                                  batch, cfg.forward_chunk)


def _reference(actor: nn.Module, ref_model: nn.Module | None) -> tuple[nn.Module, Callable[[], Any]]:
    """The KL reference: an explicit model, else the actor with its LoRA adapters disabled."""
    if ref_model is not None:
        return ref_model, nullcontext
    if hasattr(actor, "disable_adapter"):
        return actor, actor.disable_adapter
    raise ValueError("kl_coef > 0 needs a reference: pass ref_model (a frozen copy) or use a LoRA actor")


# --------------------------------------------------------------------------- one PPO step


def prepare_batch(
    actor: nn.Module,
    critic: ValueModel,
    episodes: Sequence[Episode],
    rewards: Sequence[float],
    cfg: RPRConfig,
    pad_id: int = 0,
    ref_model: nn.Module | None = None,
    world: World = SINGLE,
) -> dict[str, torch.Tensor]:
    """Collate episodes and add everything PPO needs, computed once before any update.

    Adds to ``episode.collate``'s tensors (all (B, T)): ``sampler_logprobs`` (the sampler's),
    ``old_logprobs`` (recomputed by ``actor``), ``old_values`` (V_old), ``advantages`` (TB-GAE,
    whitened if ``cfg.whiten_advantages``), ``returns`` (R = A + V_old, before whitening) and,
    when ``cfg.kl_coef > 0``, ``ref_logprobs``. Every rank gets the whole batch; ``world`` splits
    the no-grad passes' rows over the ranks (minirsi.core.distributed).
    """
    batch = collate(episodes, rewards, pad_id=pad_id, device=next(actor.parameters()).device)
    batch["sampler_logprobs"] = batch.pop("old_logprobs")
    was_training = actor.training
    actor.eval()  # no dropout in the "old policy"; restored below
    batch["old_logprobs"] = _nograd_logprobs(actor, batch, cfg, world=world)
    if cfg.tis_cap:
        batch["is_weights"] = truncated_is_weights(batch["old_logprobs"], batch["sampler_logprobs"],
                                                   batch["action_mask"], cfg.tis_cap)[0]
    if cfg.kl_coef > 0:
        model, ctx = _reference(actor, ref_model)
        batch["ref_logprobs"] = _nograd_logprobs(model, batch, cfg, ctx, world)
    actor.train(was_training)
    batch["old_values"] = world.forward_rows(critic, batch, cfg.forward_chunk)  # V_old
    if cfg.advantage == "tb_gae":
        advantages, returns = tb_gae(batch["rewards"], batch["old_values"], batch["action_mask"],
                                     batch["turn_ids"], cfg.gamma_turn, cfg.lam_turn)
    else:  # per-token GAE: every action token a step of its own (TB-GAE equals GAE in that case)
        steps = batch["action_mask"].long().cumsum(1)  # (B, T), non-decreasing
        advantages, returns = tb_gae(batch["rewards"], batch["old_values"], batch["action_mask"], steps,
                                     1.0, cfg.lam_turn)
    batch["returns"] = returns
    batch["advantages"] = whiten(advantages, batch["action_mask"]) if cfg.whiten_advantages else advantages
    return batch


def ppo_update(
    actor: nn.Module,
    critic: ValueModel,
    batch: dict[str, torch.Tensor],
    cfg: RPRConfig,
    optimizers: Optimizers,
    ref_model: nn.Module | None = None,
    update_actor: bool = True,
    seed: int | None = None,
    world: World = SINGLE,
) -> dict[str, float]:
    """``cfg.ppo_epochs`` passes over ``batch`` (from ``prepare_batch``) in minibatches of
    ``cfg.minibatch_size`` episodes, each accumulated over ``cfg.grad_accum`` micro-batches.

    ``update_actor=False`` is a critic calibration update (``calibration_update``): the same
    minibatches, the critic's step only; the actor is not read. ``ref_model`` is used only when
    the batch has no ``ref_logprobs`` yet. ``seed`` (default ``cfg.seed``) seeds the minibatch
    shuffle; run_rpr passes a new one each step. Returns metrics averaged over all action tokens
    seen.

    Sharded (``world``, minirsi.core.distributed): every rank holds the whole batch, draws the same
    minibatches, and trains on its rows of each micro-batch (``world.local``) with the loss
    normaliser all-reduced (``world.normalizer``), so the update equals the one-process one.
    """
    if not update_actor:
        return calibration_update(critic, batch, cfg, optimizers.critic, seed, world)
    mask_all = batch["action_mask"]
    if cfg.kl_coef > 0 and "ref_logprobs" not in batch:
        model, ctx = _reference(actor, ref_model)
        batch["ref_logprobs"] = _nograd_logprobs(model, batch, cfg, ctx, world)
    sums: dict[str, float] = {k: 0.0 for k in ("policy_loss", "value_loss", "clip_frac", "entropy",
                                               "approx_kl", "kl_ref")}
    norms = {"grad_norm_actor": 0.0, "grad_norm_critic": 0.0}
    seen, n_steps, actor_steps = 0.0, 0, 0
    stopped = False  # target_kl reached: the actor is only read from then on
    gen = torch.Generator().manual_seed(cfg.seed if seed is None else seed)
    actor.train()
    critic.train()
    lengths = batch["attention_mask"].sum(1)  # orders micro-batches inside a (random) minibatch
    for _ in range(cfg.ppo_epochs):
        for micro in minibatches(mask_all.shape[0], cfg.minibatch_size, cfg.grad_accum, gen, lengths):
            # this rank's rows of each micro-batch, cut after their longest sequence (all rows at world size 1)
            parts = [world.local(trimmed(batch, idx)) for idx in micro]
            n_tok = world.normalizer(sum(mb["action_mask"].sum() for mb in parts).clamp(min=1))  # N of this minibatch
            optimizers.actor.zero_grad(set_to_none=True)
            optimizers.critic.zero_grad(set_to_none=True)
            mb_kl, mb_w = 0.0, 0.0
            for i, mb in enumerate(parts):
                world.grad_sync([actor, critic], last=i == len(parts) - 1)  # defer_grad_sync: reduce in the last only
                m = mb["action_mask"]
                with (nullcontext() if not stopped else torch.no_grad()):
                    logprobs, entropy = policy_forward(actor, mb["input_ids"], mb["attention_mask"],
                                                       cfg.temperature, with_entropy=True,
                                                       entropy_grad=cfg.entropy_coef > 0,
                                                       logit_chunk=cfg.logit_chunk)
                    l_clip, clip_frac = policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], m,
                                                    cfg.clip_eps, n_tok, mb.get("is_weights"))
                    l_h = masked_mean(entropy, m, n_tok)
                    l_kl = kl_penalty(logprobs, mb["ref_logprobs"], m, n_tok) if cfg.kl_coef > 0 else l_clip * 0
                    l_actor = l_clip + cfg.kl_coef * l_kl - cfg.entropy_coef * l_h
                if not stopped:  # the two models in turn: the actor's graph is gone before the critic's exists
                    l_actor.backward()
                values = critic(mb["input_ids"], mb["attention_mask"])  # (b, T)
                l_v = value_loss(values, mb["old_values"], mb["returns"], m, cfg.value_clip, n_tok)
                (cfg.value_coef * l_v).backward()
                w = float(m.sum())
                sums["policy_loss"] += float(l_clip.detach()) * float(n_tok)
                sums["value_loss"] += float(l_v.detach()) * float(n_tok)
                sums["entropy"] += float(l_h.detach()) * float(n_tok)
                sums["kl_ref"] += float(l_kl.detach()) * float(n_tok)
                sums["clip_frac"] += float(clip_frac) * w
                kl = float(approx_kl(logprobs.detach(), mb["old_logprobs"], m))
                sums["approx_kl"] += kl * w
                mb_kl, mb_w = mb_kl + kl * w, mb_w + w
                seen += w
            if not stopped and cfg.target_kl > 0:
                mb_kl, mb_w = world.all_sum([mb_kl, mb_w])  # every rank stops alike
            if not stopped and cfg.target_kl > 0 and mb_kl / max(mb_w, 1.0) > cfg.target_kl:
                stopped = True  # this minibatch's gradient is dropped, and all later ones
                optimizers.actor.zero_grad(set_to_none=True)
            if not stopped:
                if cfg.lr_warmup_updates:
                    _warmup_lr(optimizers.actor, cfg.lr_actor, cfg.lr_warmup_updates)
                norms["grad_norm_actor"] += clipped_step(optimizers.actor, cfg.max_grad_norm)
                actor_steps += 1
            norms["grad_norm_critic"] += clipped_step(optimizers.critic, cfg.max_grad_norm)
            n_steps += 1
    totals = world.all_sum([*sums.values(), seen])
    sums, seen = dict(zip(sums, totals[:-1])), totals[-1]
    metrics = {k: v / max(seen, 1.0) for k, v in sums.items()}
    # Before clipping, the mean over each model's own optimizer steps.
    metrics["grad_norm_actor"] = norms["grad_norm_actor"] / max(actor_steps, 1)
    metrics["grad_norm_critic"] = norms["grad_norm_critic"] / max(n_steps, 1)
    metrics["actor_updates"] = float(actor_steps)
    metrics["explained_variance"] = explained_variance(batch["returns"], batch["old_values"], mask_all)
    metrics["action_tokens"] = float(mask_all.sum())
    return metrics


def calibration_update(
    critic: ValueModel,
    batch: dict[str, torch.Tensor],
    cfg: RPRConfig,
    optimizer: torch.optim.Optimizer,
    seed: int | None = None,
    world: World = SINGLE,
) -> dict[str, float]:
    """A critic calibration update: ``ppo_update``'s passes and minibatches, each a
    ``critic.critic_step`` (the warm-up's step) on L_V; the actor is not read. Returns the
    critic's metrics: ``value_loss``, ``grad_norm_critic``, ``explained_variance`` (of V_old),
    ``action_tokens``, and ``actor_updates`` = 0."""
    mask_all = batch["action_mask"]
    gen = torch.Generator().manual_seed(cfg.seed if seed is None else seed)  # the draws ppo_update would make
    critic.train()
    lengths = batch["attention_mask"].sum(1)
    loss, seen, norm, n_steps = 0.0, 0.0, 0.0, 0
    for _ in range(cfg.ppo_epochs):
        for micro in minibatches(mask_all.shape[0], cfg.minibatch_size, cfg.grad_accum, gen, lengths):
            parts = [world.local(trimmed(batch, idx)) for idx in micro]
            tokens = sum(mb["action_mask"].sum() for mb in parts)  # this rank's action tokens
            n_tok = world.normalizer(tokens.clamp(min=1))
            l_v, g = critic_step(critic, optimizer, parts, n_tok, cfg.value_clip, cfg.max_grad_norm,
                                 cfg.value_coef, world)
            loss, seen, norm, n_steps = loss + l_v * float(n_tok), seen + float(tokens), norm + g, n_steps + 1
    loss, seen = world.all_sum([loss, seen])  # the token mean over every rank's rows, as ppo_update's
    return {"value_loss": loss / max(seen, 1.0), "grad_norm_critic": norm / max(n_steps, 1),
            "actor_updates": 0.0,
            "explained_variance": explained_variance(batch["returns"], batch["old_values"], mask_all),
            "action_tokens": float(mask_all.sum())}


def _warmup_lr(optimizer: torch.optim.Optimizer, lr: float, warmup: int) -> None:
    """Set lr * min(1, (n + 1) / warmup) for the optimizer's next step, n = steps taken so far
    (Adam's per-parameter ``step`` state; 0 before the first step)."""
    n = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if step is not None:
                n = max(n, int(step))
    for group in optimizer.param_groups:
        group["lr"] = lr * min(1.0, (n + 1) / warmup)


def logprob_gap(batch: dict[str, torch.Tensor]) -> float:
    """mean over action tokens of |logp_train - logp_sample| (old_logprobs vs sampler_logprobs)."""
    m = batch["action_mask"]
    return float(masked_mean((batch["old_logprobs"] - batch["sampler_logprobs"]).abs(), m))


# --------------------------------------------------------------------------- the stage


def score(episodes: Sequence[Episode], kind: str, scales: dict[str, float],
          scales_prime: dict[str, float] | None = None) -> list[float]:
    """FDR or SPR of each episode (minirsi.core.fdr / minirsi.core.spr)."""
    if kind == "fdr":
        return [float(family_dense_reward(e.passed, e.family, scales)) for e in episodes]
    if kind == "spr":
        return [float(success_prioritized_reward(e.success, e.passed, e.family, scales, scales_prime))
                for e in episodes]
    raise ValueError(f"score: reward kind {kind!r}; use 'fdr' or 'spr'")


def task_stream(tasks: Sequence[Any], n: int, seed: int, group: int = 1) -> Iterator[list[Any]]:
    """Endless lists of ``n`` tasks: ``n / group`` draws from a seeded shuffle of ``tasks``
    (reshuffled when used up), each drawn task repeated ``group`` times in a row."""
    if not tasks:
        raise ValueError("RPR needs at least one training task")
    rng = random.Random(seed)
    pool: list[Any] = []
    while True:
        out = []
        while len(out) < n:
            if not pool:
                pool = list(tasks)
                rng.shuffle(pool)
            out.extend([pool.pop()] * group)
        yield out


def bucket_of(task: Any, fields: Sequence[str] = ("difficulty",)) -> tuple[str, ...]:
    """The bucket ``EdgeStream`` weighs a task by: the values of its ``fields`` (family =
    task.toml's category, difficulty)."""
    return tuple(str(getattr(task, f, "")) for f in fields)


class EdgeStream:
    """Lists of ``n`` tasks, ``n / group`` draws each repeated ``group`` times, that follow the
    edge of the actor's competence: bucket b (``bucket_of``) is drawn with probability
    proportional to (m_b + 1) / (n_b + 2), where n_b of its groups observed so far (``observe``)
    held m_b with both outcomes (the posterior mean of that share under a uniform prior). A
    bucket never tried weighs 1/2; one whose every group was uniform fades as 1 / (n_b + 2)
    without being dropped, so a bucket the actor starts to solve comes back. Inside a bucket
    tasks come from a seeded shuffle, reshuffled when used up.

    ``pool_success()``: the success a uniform draw of the pool would measure, post-stratified:
    the sum over buckets of pool share x the bucket's success in the latest observed step that
    drew it (a bucket not drawn this step keeps its last figure; one never drawn yet is left
    out and the shares of the others renormalised). Weighting each episode by share / draw
    probability instead (importance weights) is unbiased in every step but carries the noise of
    how many groups each bucket happened to get: on the default run's RPR stages its spread
    over joint steps was 7-11 points against 4.5-8 post-stratified, and seed 2's four
    calibration steps read 45.3% for an actor measured at 32.3% on the whole pool (34.2%
    post-stratified; the easy bucket had drawn 22 of the 64 groups, 16 expected)."""

    def __init__(self, tasks: Sequence[Any], n: int, seed: int, group: int = 1,
                 fields: Sequence[str] = ("difficulty",)):
        if not tasks:
            raise ValueError("RPR needs at least one training task")
        self.n, self.group, self.rng = n, group, random.Random(seed)
        self.members: dict[tuple[str, ...], list[Any]] = {}
        for task in tasks:
            self.members.setdefault(bucket_of(task, fields), []).append(task)
        self.keys = sorted(self.members)
        self.share = {k: len(self.members[k]) / len(tasks) for k in self.keys}
        self.bucket = {task.task_id: bucket_of(task, fields) for task in tasks}
        self.groups = dict.fromkeys(self.keys, 0)
        self.mixed = dict.fromkeys(self.keys, 0)
        self.queue: dict[tuple[str, ...], list[Any]] = {k: [] for k in self.keys}
        self.probs: dict[tuple[str, ...], float] = {}
        self.success: dict[tuple[str, ...], float] = {}  # bucket -> success in the last step that drew it

    def __iter__(self) -> EdgeStream:
        return self

    def __next__(self) -> list[Any]:
        weights = [(self.mixed[k] + 1) / (self.groups[k] + 2) for k in self.keys]
        total = sum(weights)
        self.probs = {k: w / total for k, w in zip(self.keys, weights)}
        out: list[Any] = []
        for key in self.rng.choices(self.keys, weights=weights, k=-(-self.n // self.group)):
            if not self.queue[key]:
                self.queue[key] = list(self.members[key])
                self.rng.shuffle(self.queue[key])
            out.extend([self.queue[key].pop()] * self.group)
        return out[: self.n]

    def observe(self, episodes: Sequence[Episode], uniform: set[str] | None = None) -> None:
        """Count each task's group of ``episodes`` (one step's draw): one group, mixed if it held
        both outcomes (``uniform``: the ids of the uniform ones, ``uniform_groups(episodes)`` if
        not given); and each drawn bucket's success, for ``pool_success``."""
        uniform = uniform_groups(episodes) if uniform is None else uniform
        for task_id in dict.fromkeys(e.task_id for e in episodes):
            key = self.bucket.get(task_id)
            if key is not None:
                self.groups[key] += 1
                self.mixed[key] += task_id not in uniform
        outcomes: dict[tuple[str, ...], list[bool]] = {}
        for e in episodes:
            if e.task_id in self.bucket:
                outcomes.setdefault(self.bucket[e.task_id], []).append(bool(e.success))
        self.success.update({k: sum(v) / len(v) for k, v in outcomes.items()})

    def pool_success(self) -> float:
        seen = [k for k in self.keys if k in self.success]
        total = sum(self.share[k] for k in seen)
        return sum(self.share[k] * self.success[k] for k in seen) / total if total else 0.0


def uniform_groups(episodes: Sequence[Episode]) -> set[str]:
    """Task ids whose episodes all succeeded or all failed (no contrast to learn from)."""
    outcomes: dict[str, set[bool]] = {}
    for e in episodes:
        outcomes.setdefault(e.task_id, set()).add(bool(e.success))
    return {task_id for task_id, seen in outcomes.items() if len(seen) == 1}


def first_groups(indices: Sequence[int], episodes: Sequence[Episode], n_groups: int) -> list[int]:
    """The ``indices`` whose episode's task is among the first ``n_groups`` tasks they hold (in
    order of first appearance): what an oversampled step trains on."""
    order: list[str] = []
    for i in indices:
        if episodes[i].task_id not in order:
            order.append(episodes[i].task_id)
    chosen = set(order[:n_groups])
    return [i for i in indices if episodes[i].task_id in chosen]


def run_rpr(
    actor: nn.Module,
    critic: ValueModel,
    tokenizer: Any,
    train_tasks: Sequence[Any],
    cfg: RPRConfig,
    rollout_fn: RolloutFn,
    scales: dict[str, float],
    log_fn: Callable[[dict[str, Any]], None] | None = None,
    ref_model: nn.Module | None = None,
    scales_prime: dict[str, float] | None = None,
    optimizers: Optimizers | None = None,
    after_actor_update: Callable[[nn.Module], dict[str, float]] | None = None,
    world: World = SINGLE,
) -> list[dict[str, Any]]:
    """One RPR phase: ``cfg.critic_calibration_updates`` critic-only steps, then ``cfg.steps``
    joint PPO steps. Updates ``actor`` and ``critic`` in place; returns one metrics dict per
    step (``phase`` = "calibrate" | "joint"), each also passed to ``log_fn``.

    ``optimizers`` (default: ``make_optimizers``) lets a continuation keep its AdamW state;
    ``ref_model`` is the KL reference (default: see the module docstring; a sharded run passes
    its own sharded copy). ``world`` shards the update (minirsi.core.distributed); ``rollout_fn`` is
    then ``world.rollout_fn(...)``, so every rank sees the same episodes.
    ``after_actor_update(actor) -> metrics`` runs after every joint step's update, before the
    next rollout (the weight sync to inference servers, ``minirsi.engine.weight_sync``); its metrics
    join the step's record. Steps that leave the actor unchanged (calibration, and with
    ``drop_uniform_groups`` a step without contrast) do not call it."""
    torch.manual_seed(cfg.seed)
    if cfg.kl_coef > 0 and ref_model is None and not hasattr(actor, "disable_adapter"):
        ref_model = copy.deepcopy(actor).eval().requires_grad_(False)  # pi_ref = the actor as the stage starts
    optimizers = optimizers or make_optimizers(actor, critic, cfg)
    n_draw = cfg.episodes_per_step * cfg.oversample
    edge = (EdgeStream(train_tasks, n_draw, cfg.seed, cfg.samples_per_task, cfg.bucket_fields)
            if cfg.pool_sampling == "edge" else None)
    stream = edge or task_stream(train_tasks, n_draw, cfg.seed, cfg.samples_per_task)
    history: list[dict[str, Any]] = []
    n_calib = cfg.critic_calibration_updates
    for step in range(n_calib + cfg.steps):
        phase = "calibrate" if step < n_calib else "joint"
        t0 = time.perf_counter()
        step_seed = cfg.seed * 100_003 + step
        episodes = rollout_fn(actor, next(stream), step_seed)
        t1 = time.perf_counter()
        usable = [e for e in episodes if any(e.action_mask)]  # a sandbox that died before any action
        if not usable:
            raise RuntimeError(f"RPR step {step}: no episode has an action token; check the sampler/sandbox")
        rewards = score(usable, cfg.reward, scales, scales_prime)
        fdr = score(usable, "fdr", scales)
        uniform = uniform_groups(usable)
        if edge is not None:
            edge.observe(usable, uniform)
        pool_success = edge.pool_success() if edge is not None else sum(e.success for e in usable) / len(usable)
        uniform = uniform if cfg.drop_uniform_groups else set()  # without the filter every group trains
        kept = first_groups([i for i, e in enumerate(usable) if e.task_id not in uniform], usable,
                            cfg.episodes_per_step // cfg.samples_per_task)
        contrast = bool(kept)  # no task with both outcomes: the critic still learns, the actor waits
        kept = kept if contrast else list(range(len(usable)))
        train_eps = [usable[i] for i in kept]
        batch = prepare_batch(actor, critic, train_eps, [rewards[i] for i in kept], cfg, pad_id_of(tokenizer),
                              ref_model, world)
        moved = phase == "joint" and contrast  # the actor takes this step's update
        metrics = ppo_update(actor, critic, batch, cfg, optimizers, ref_model, update_actor=moved,
                             seed=step_seed, world=world)
        t2 = time.perf_counter()
        synced = after_actor_update(actor) if after_actor_update is not None and moved else {}
        if cfg.tis_cap:
            metrics["tis_capped_frac"] = truncated_is_weights(batch["old_logprobs"], batch["sampler_logprobs"],
                                                              batch["action_mask"], cfg.tis_cap)[1]
        record: dict[str, Any] = {
            "step": step, "phase": phase,
            "reward": sum(rewards) / len(rewards),
            "dense_reward": sum(fdr) / len(fdr),
            "binary_reward": sum(e.success for e in usable) / len(usable),
            "pool_success": pool_success,
            "turns": sum(e.turns for e in usable) / len(usable),
            "logprob_gap": logprob_gap(batch),
            "episodes": len(usable), "dropped_episodes": len(episodes) - len(usable),
            **({"trained_episodes": len(train_eps) if contrast else 0} if cfg.drop_uniform_groups else {}),
            **metrics, **synced,
            "rollout_s": t1 - t0, "update_s": t2 - t1,
        }
        history.append(record)
        logger.info("RPR %s step %d: reward %.3f S %.3f EV %.3f KL %.4f clip %.3f gap %.2e", phase, step,
                    record["reward"], record["binary_reward"], record["explained_variance"],
                    record.get("approx_kl", 0.0), record.get("clip_frac", 0.0), record["logprob_gap"])
        if log_fn is not None:
            log_fn(record)
    return history

"""Probes whose answer is known: the bottom rungs of the ladder that proves PPO learns.

A learning bug (a critic that has seen the action it is the baseline for, a KL estimate with
the wrong sign, a loss on the wrong tokens) leaves every plumbing test green. These probes run
the real training path, ``HFSampler`` -> ``Episode`` -> ``rpr.prepare_batch`` (critic values,
TB-GAE, whitening) -> ``rpr.ppo_update``, on problems whose best policy is known, so a fault shows
up as a curve that does not rise. Walk up the ladder until a rung fails; the fault lies between
it and the rung below (README, "Proving that RPR learns").

Rung 1, the one-token bandit: a fixed prompt, one sampled token, reward 1 iff it is one of the
``rewarded`` ids (30 of 300: chance 0.1 for a near-uniform random model). The optimal policy
puts all its mass on the rewarded set; ``p_rewarded`` measures that mass exactly from the logits.

Rung 2, the delayed bandit (``obs_len > 0``): the same decision is the first turn's action, then
``obs_len`` observation tokens (action mask 0), then a second one-token turn whose choice does
not matter; the reward sits on the last action token, so TB-GAE must carry it back across a
turn boundary and over the observation tokens to the token that decided it.

Rung 2b, the credit-assignment bandit (``later_turns=4, later_tokens=8``): the turn-0 decision
is followed by 4 turns, each ``obs_len`` observation tokens and ``later_tokens`` action tokens
whose choices do not matter; the reward comes after the last. TB-GAE decays the credit once per
turn, (gamma_turn lam_turn)^4; per-token GAE (``RPRConfig.advantage="token_gae"``) once per
action token, lam^32 (tests/test_learning.py measures what that costs).

The critic rung (``reward_values=(10.0, 11.0)``): the same one-token bandit, but every episode
scores 10 and the right choice 11. With V = 0 (``ZeroCritic``) every advantage is ~10: each
sampled token is pushed up, and the 1-point difference that decides the bandit is a small
signal in that noise. A critic that has learned V ~ 10.1 leaves advantages of ~-0.1 and ~0.9,
the same problem as rewards 0 and 1.

Call it::

    curve = bandit(actor, critic, RPRConfig(lr_actor=1e-3), steps=40, rewarded=range(30, 60))
    steps_to(curve, 0.9)                     # the first step at which P(rewarded) >= 0.9
"""

from __future__ import annotations

import random
from typing import Sequence

import torch
from torch import nn

from minirsi.core.critic import ValueModel, WarmupConfig, warmup_critic
from minirsi.core.episode import Episode
from minirsi.core.rpr import RPRConfig, make_optimizers, ppo_update, prepare_batch
from minirsi.engine.sampler import HFSampler


def p_rewarded(actor: nn.Module, context: Sequence[int], rewarded: Sequence[int]) -> float:
    """The policy's exact probability of sampling a rewarded token after ``context``."""
    with torch.no_grad():
        ids = torch.tensor([list(context)], device=next(actor.parameters()).device)
        probs = torch.softmax(actor(input_ids=ids).logits[0, -1].float(), dim=-1)
    return float(probs[list(rewarded)].sum())


def bandit_episodes(
    sampler: HFSampler, prompt: Sequence[int], rewarded: set[int], n: int, seed: int, obs_len: int = 0,
    later_turns: int | None = None, later_tokens: int = 1, reward_values: tuple[float, float] = (0.0, 1.0),
) -> tuple[list[Episode], list[float]]:
    """``n`` bandit episodes sampled at temperature 1 and their rewards (module docstring).

    Turn 0 is one sampled token, the decision. Each of the ``later_turns`` turns that follow
    (default: 1 when ``obs_len`` > 0, else 0) is ``obs_len`` random observation tokens (action
    mask 0) and ``later_tokens`` sampled tokens whose choice does not matter. The reward is
    ``reward_values[1]`` if the decision is in ``rewarded``, else ``reward_values[0]``.
    """
    if later_turns is None:
        later_turns = 1 if obs_len else 0
    first = sampler.generate([list(prompt)] * n, 1, 1.0, [], seed=seed)
    rng = random.Random(seed)
    episodes, rewards = [], []
    for i, s in enumerate(first):
        a0 = s.token_ids[0]
        episodes.append(Episode(task_id=f"bandit{i}", family="bandit", difficulty="easy",
                                token_ids=list(prompt) + [a0], logprobs=[None] * len(prompt) + [s.logprobs[0]],
                                action_mask=[0] * len(prompt) + [1], turn_ids=[0] * (len(prompt) + 1),
                                turns=1 + later_turns, success=a0 in rewarded, passed=int(a0 in rewarded),
                                total=1))
        rewards.append(float(reward_values[a0 in rewarded]))
    for k in range(1, later_turns + 1):  # turn k: an observation, then tokens whose choice is irrelevant
        for e in episodes:
            obs = [rng.randrange(1, 30) for _ in range(obs_len)]  # ids outside any rewarded range used here
            e.token_ids += obs
            e.logprobs += [None] * obs_len
            e.action_mask += [0] * obs_len
            e.turn_ids += [k] * obs_len
        after = sampler.generate([e.token_ids for e in episodes], later_tokens, 1.0, [], seed=seed + k)
        for e, s in zip(episodes, after):
            e.token_ids += s.token_ids
            e.logprobs += s.logprobs
            e.action_mask += [1] * len(s.token_ids)
            e.turn_ids += [k] * len(s.token_ids)
    return episodes, rewards


class ZeroCritic(nn.Module):
    """The V = 0 control: a critic whose every value is 0 and stays 0 (its one parameter gets a
    zero gradient, so the value loss still back-propagates and AdamW has something to hold)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device) + 0.0 * self.unused


def warm_up_on_bandit(
    actor: nn.Module, critic: ValueModel, cfg: WarmupConfig, n: int = 256, seed: int = 10_000, **layout,
) -> list[float]:
    """The Warm-up Critic Model on the bandit: ``critic.warmup_critic`` over ``n`` episodes of the
    frozen ``actor`` (``layout``: ``bandit_episodes``'s keywords: ``rewarded``, ``prompt``,
    ``obs_len``, ``later_turns``, ``later_tokens``, ``reward_values``). Returns the EV per update."""
    rewarded = set(layout.pop("rewarded", range(30, 60)))
    prompt = layout.pop("prompt", (1, 2, 3, 4, 5))
    actor.eval()
    episodes, rewards = bandit_episodes(HFSampler(actor, prefix_cache=False), prompt, rewarded, n, seed, **layout)
    return warmup_critic(critic, episodes, rewards, cfg)


def steps_to(curve: Sequence[float], target: float) -> int | None:
    """The first joint step after which P(rewarded) >= ``target`` (0 = before any), or None."""
    return next((i for i, p in enumerate(curve) if p >= target), None)


def bandit(
    actor: nn.Module,
    critic: nn.Module,
    cfg: RPRConfig,
    steps: int = 40,
    rewarded: Sequence[int] = range(30, 60),
    prompt: Sequence[int] = (1, 2, 3, 4, 5),
    episodes_per_step: int = 64,
    calibration: int = 3,
    obs_len: int = 0,
    seed: int = 0,
    later_turns: int | None = None,
    later_tokens: int = 1,
    reward_values: tuple[float, float] = (0.0, 1.0),
) -> list[float]:
    """``calibration`` critic-only steps, then ``steps`` PPO steps on the bandit.

    Returns p_rewarded before the first joint step and after each one (``steps + 1`` values).
    ``critic`` is a ``ValueModel`` or ``ZeroCritic``; the layout keywords are ``bandit_episodes``'s.
    """
    torch.manual_seed(seed)
    reward_set = set(rewarded)
    optimizers = make_optimizers(actor, critic, cfg)
    curve = []
    for step in range(calibration + steps):
        joint = step >= calibration
        if joint and not curve:
            curve.append(p_rewarded(actor, prompt, rewarded))
        actor.eval()
        episodes, rewards = bandit_episodes(HFSampler(actor, prefix_cache=False), prompt, reward_set,
                                            episodes_per_step, seed * 1000 + step, obs_len, later_turns,
                                            later_tokens, reward_values)
        batch = prepare_batch(actor, critic, episodes, rewards, cfg)
        ppo_update(actor, critic, batch, cfg, optimizers, update_actor=joint, seed=seed * 1000 + step)
        if joint:
            curve.append(p_rewarded(actor, prompt, rewarded))
    return curve

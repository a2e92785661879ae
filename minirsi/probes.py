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

Call it::

    curve = bandit(actor, critic, RPRConfig(lr_actor=1e-3), steps=40, rewarded=range(30, 60))
"""

from __future__ import annotations

import random
from typing import Sequence

import torch
from torch import nn

from minirsi.critic import ValueModel
from minirsi.episode import Episode
from minirsi.rpr import RPRConfig, make_optimizers, ppo_update, prepare_batch
from minirsi.sampler import HFSampler


def p_rewarded(actor: nn.Module, context: Sequence[int], rewarded: Sequence[int]) -> float:
    """The policy's exact probability of sampling a rewarded token after ``context``."""
    with torch.no_grad():
        ids = torch.tensor([list(context)], device=next(actor.parameters()).device)
        probs = torch.softmax(actor(input_ids=ids).logits[0, -1].float(), dim=-1)
    return float(probs[list(rewarded)].sum())


def bandit_episodes(
    sampler: HFSampler, prompt: Sequence[int], rewarded: set[int], n: int, seed: int, obs_len: int = 0,
) -> tuple[list[Episode], list[float]]:
    """``n`` bandit episodes sampled at temperature 1 and their rewards (module docstring)."""
    first = sampler.generate([list(prompt)] * n, 1, 1.0, [], seed=seed)
    rng = random.Random(seed)
    episodes, rewards = [], []
    for i, s in enumerate(first):
        a0 = s.token_ids[0]
        ids, lps = list(prompt) + [a0], [None] * len(prompt) + [s.logprobs[0]]
        mask, turns = [0] * len(prompt) + [1], [0] * (len(prompt) + 1)
        if obs_len:
            obs = [rng.randrange(1, 30) for _ in range(obs_len)]  # ids outside any rewarded range used here
            ids, lps, mask, turns = ids + obs, lps + [None] * obs_len, mask + [0] * obs_len, turns + [1] * obs_len
        episodes.append(Episode(task_id=f"bandit{i}", family="bandit", difficulty="easy", token_ids=ids,
                                logprobs=lps, action_mask=mask, turn_ids=turns, turns=1,
                                success=a0 in rewarded, passed=int(a0 in rewarded), total=1))
        rewards.append(float(a0 in rewarded))
    if obs_len:  # the second turn: one more token after the observation, its choice irrelevant
        second = sampler.generate([e.token_ids for e in episodes], 1, 1.0, [], seed=seed + 1)
        for e, s in zip(episodes, second):
            e.token_ids.append(s.token_ids[0])
            e.logprobs.append(s.logprobs[0])
            e.action_mask.append(1)
            e.turn_ids.append(1)
            e.turns = 2
    return episodes, rewards


def bandit(
    actor: nn.Module,
    critic: ValueModel,
    cfg: RPRConfig,
    steps: int = 40,
    rewarded: Sequence[int] = range(30, 60),
    prompt: Sequence[int] = (1, 2, 3, 4, 5),
    episodes_per_step: int = 64,
    calibration: int = 3,
    obs_len: int = 0,
    seed: int = 0,
) -> list[float]:
    """``calibration`` critic-only steps, then ``steps`` PPO steps on the bandit.

    Returns p_rewarded before the first joint step and after each one (``steps + 1`` values).
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
                                            episodes_per_step, seed * 1000 + step, obs_len)
        batch = prepare_batch(actor, critic, episodes, rewards, cfg)
        ppo_update(actor, critic, batch, cfg, optimizers, update_actor=joint, seed=seed * 1000 + step)
        if joint:
            curve.append(p_rewarded(actor, prompt, rewarded))
    return curve

"""PPO learns: the bottom rungs of the probe ladder (minirsi/probes.py), through the real path
(HFSampler -> prepare_batch -> TB-GAE -> ppo_update) with the inherited-critic set-up.

Each test failed on the code before the critic's alignment fix: the critic read V_t after it
had seen x_t, so the decisive token's advantage cancelled (one-token bandit, 40 steps, 3 seeds:
p_rewarded 0.17, 0.63, 0.21 against >= 0.99 now; tutorials/06_value_alignment.py prints both).
"""

from __future__ import annotations

import pytest
import torch

from minirsi.critic import build_critic
from minirsi.probes import bandit
from minirsi.rpr import RPRConfig
from tiny import tiny_qwen


def _run(seed: int, obs_len: int) -> list[float]:
    actor = tiny_qwen(seed=seed)
    critic = build_critic(actor)
    cfg = RPRConfig(lr_actor=1e-3, lr_critic=1e-3, gamma_turn=1.0, lam_turn=0.95, seed=seed)
    return bandit(actor, critic, cfg, steps=40, episodes_per_step=64, calibration=3, obs_len=obs_len, seed=seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ppo_learns_the_one_token_bandit(seed):
    """30 rewarded ids of 300: from chance (<= 0.15) to >= 0.9 within 40 steps, critic on."""
    torch.set_num_threads(1)
    curve = _run(seed, obs_len=0)
    assert curve[0] <= 0.15, curve
    assert max(curve) >= 0.9, curve
    assert curve[-1] >= 0.9, curve


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ppo_learns_a_decision_whose_reward_comes_a_turn_later(seed):
    """The rewarded choice is turn 0's token; 4 observation tokens and a second turn follow, and
    the reward sits on the second turn's token: TB-GAE must carry it back over the observation
    and across the boundary (gamma_turn lam_turn = 0.95) to the token that decided it."""
    torch.set_num_threads(1)
    curve = _run(seed, obs_len=4)
    assert curve[0] <= 0.15, curve
    assert curve[-1] >= 0.9, curve

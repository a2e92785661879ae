"""Truncated importance sampling on the sampler's log-probs: weights, capped share, gradient."""

from __future__ import annotations

import math

import pytest
import torch

from minirsi.core.rpr import RPRConfig, policy_loss, truncated_is_weights


def _case():
    # One sequence, 5 positions: prompt (0), three action tokens, one observation token.
    # logp_old - logp_sampler = [., 0, ln 3, -ln 2, 5]; with C = 2 the ratios 1, 3, 0.5 become
    # weights 1, 2 (capped), 0.5; the observation's ratio e^5 is never read.
    mask = torch.tensor([[0, 1, 1, 1, 0]])
    sampler = torch.tensor([[0.0, -1.0, -2.0, -0.5, -3.0]])
    old = sampler + torch.tensor([[0.0, 0.0, math.log(3), -math.log(2), 5.0]])
    return old, sampler, mask


def test_weights_are_the_capped_ratio_on_action_tokens_only():
    old, sampler, mask = _case()
    w, capped = truncated_is_weights(old, sampler, mask, cap=2.0)
    assert w.tolist()[0] == pytest.approx([1.0, 1.0, 2.0, 0.5, 1.0])
    assert capped == pytest.approx(1 / 3)
    w10, capped10 = truncated_is_weights(old, sampler, mask, cap=10.0)  # nothing above 10
    assert w10.tolist()[0] == pytest.approx([1.0, 1.0, 3.0, 0.5, 1.0]) and capped10 == 0.0


def test_weights_carry_no_gradient_to_either_log_prob():
    old, sampler, mask = _case()
    old.requires_grad_(True)
    sampler.requires_grad_(True)
    w, _ = truncated_is_weights(old, sampler, mask, cap=2.0)
    assert not w.requires_grad


def test_gradient_of_the_weighted_surrogate():
    # logprobs = old_logprobs (first epoch): rho = 1, nothing clipped by PPO, so
    # L = -sum_t m_t w_t rho_t A_t / N and dL/dlogp_t = -w_t rho_t A_t / N = -w_t A_t / 3.
    old, sampler, mask = _case()
    adv = torch.tensor([[0.0, 1.0, -2.0, 4.0, 7.0]])
    w, _ = truncated_is_weights(old, sampler, mask, cap=2.0)
    logprobs = old.clone().requires_grad_(True)
    loss, _ = policy_loss(logprobs, old, adv, mask, clip_eps=0.2, is_weights=w)
    loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -1.0 / 3, 4.0 / 3, -2.0 / 3, 0.0])
    assert float(loss.detach()) == pytest.approx(-(1 * 1 + 2 * -2 + 0.5 * 4) / 3)


def test_ppo_clipping_still_applies_under_the_weights():
    # rho = e^0.5 > 1 + eps with A > 0: the clipped branch is taken, so no gradient; the loss
    # is -w (1 + eps) A / N.
    old, sampler, mask = _case()
    adv = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]])
    w, _ = truncated_is_weights(old, sampler, mask, cap=2.0)
    logprobs = (old + 0.5).requires_grad_(True)
    loss, clip_frac = policy_loss(logprobs, old, adv, mask, clip_eps=0.2, is_weights=w)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-2.0 * 1.2 / 3)
    assert logprobs.grad.abs().sum() == 0 and float(clip_frac) == 1.0


def test_without_weights_the_loss_is_unchanged():
    old, sampler, mask = _case()
    adv = torch.tensor([[0.0, 1.0, -2.0, 4.0, 7.0]])
    ones = torch.ones_like(old)
    a, _ = policy_loss(old + 0.1, old, adv, mask, 0.2)
    b, _ = policy_loss(old + 0.1, old, adv, mask, 0.2, is_weights=ones)
    assert float(a) == float(b)


@pytest.mark.parametrize("cap", [0.5, -1.0])
def test_a_cap_below_one_is_rejected(cap):
    with pytest.raises(ValueError, match="tis_cap"):
        RPRConfig(tis_cap=cap)
    RPRConfig(tis_cap=0.0)  # off
    RPRConfig(tis_cap=None)  # auto

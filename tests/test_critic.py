"""The critic: value loss and explained variance (hand-worked, masking), the value's alignment
(V_t never sees x_t), build / save / load (handoff, format version), and the warm-up: every
critic parameter trains, no actor parameter moves, explained variance rises."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirsi.core.critic import (
    ValueModel,
    WarmupConfig,
    build_critic,
    explained_variance,
    fingerprint,
    load_critic,
    save_critic,
    value_loss,
    warmup_critic,
)
from minirsi.core.episode import Episode
from tiny import VOCAB, tiny_qwen


# ----------------------------------------------------------------------------- the math


def test_value_loss_hand_worked():
    # eps_v = 0.5, V_old = 0, R = 2:
    #   t0: V = 0.4 (inside the clip)  -> 0.5 * (0.4-2)^2                = 0.5 * 2.56 = 1.28
    #   t1: V = 3.0 -> V_clip = 0.5    -> 0.5 * max((3-2)^2, (0.5-2)^2) = 0.5 * 2.25 = 1.125
    #   t2: observation (masked), its huge error is ignored
    # token mean: (1.28 + 1.125) / 2 = 1.2025 ; unclipped: (1.28 + 0.5) / 2 = 0.89
    v = torch.tensor([[0.4, 3.0, 1e4]])
    vold = torch.zeros(1, 3)
    r = torch.full((1, 3), 2.0)
    m = torch.tensor([[1.0, 1.0, 0.0]])
    assert value_loss(v, vold, r, m, 0.5).item() == pytest.approx(1.2025)
    assert value_loss(v, vold, r, m, None).item() == pytest.approx(0.89)
    assert value_loss(v, vold, r, m, 0.5, normalizer=4).item() == pytest.approx(2.405 / 4)


def test_explained_variance_hand_worked():
    r = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(r, r, m) == pytest.approx(1.0)  # perfect critic
    assert explained_variance(r, torch.full_like(r, 7.0), m) == pytest.approx(0.0)  # constant
    # V = 0 for R = (1, 2, 3): Var(R - V) = Var(R) -> 0 ; V = R - (1, 0, -1)*1: Var = 2/3 / (2/3)
    v = torch.tensor([[2.0, 2.0, 2.0, 0.0]])  # R - V = (-1, 0, 1): Var = 2/3 = Var(R) -> EV = 0
    assert explained_variance(r, v, m) == pytest.approx(0.0)
    v = torch.tensor([[3.0, 2.0, 1.0, 0.0]])  # R - V = (-2, 0, 2): Var = 8/3 -> EV = 1 - 4 = -3
    assert explained_variance(r, v, m) == pytest.approx(-3.0)
    assert explained_variance(torch.ones(1, 3), torch.zeros(1, 3), torch.ones(1, 3)) != explained_variance(
        torch.ones(1, 3), torch.zeros(1, 3), torch.ones(1, 3))  # NaN: no variance to explain


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_explained_variance_ignores_non_action_positions(seed):
    g = torch.Generator().manual_seed(seed)
    m = (torch.rand(3, 10, generator=g) < 0.5).float()
    m[0, :2] = 1.0
    r, v = torch.randn(3, 10, generator=g), torch.randn(3, 10, generator=g)
    noise = 1e3 * torch.randn(3, 10, generator=g) * (1 - m)
    assert explained_variance(r + noise, v - noise, m) == explained_variance(r, v, m)


# ----------------------------------------------------------------------------- build / handoff


def test_build_critic_copies_the_backbone_and_starts_at_zero():
    actor = tiny_qwen()
    a0 = fingerprint(actor)
    critic = build_critic(actor)
    assert isinstance(critic, ValueModel)
    for name, p in actor.model.state_dict().items():
        assert torch.equal(p, critic.backbone.state_dict()[name]), name
    ids = torch.randint(1, VOCAB, (2, 7))
    values = critic(ids, torch.ones_like(ids))
    assert values.shape == (2, 7) and torch.all(values == 0)
    # a separate copy: training the critic leaves the actor bit-identical
    with torch.no_grad():
        for p in critic.parameters():
            p.add_(1.0)
    assert fingerprint(actor) == a0


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 11))
def test_value_at_a_position_never_sees_that_token_or_later_ones(seed, t):
    """docs/method.md section 4: V_t is the value before x_t is sampled. Changing x_t and everything
    after it must leave V_0..V_t exactly as they were (and V_0 = 0: no context yet)."""
    torch.manual_seed(seed)
    critic = build_critic(tiny_qwen(seed=seed % 3), head_init_std=0.5)
    ids = torch.randint(1, VOCAB, (2, 12))
    changed = ids.clone()
    changed[:, t:] = (ids[:, t:] + torch.randint(1, VOCAB - 1, ids[:, t:].shape)) % VOCAB  # every one differs
    am = torch.ones_like(ids)
    with torch.no_grad():
        v, v2 = critic(ids, am), critic(changed, am)
    assert torch.equal(v[:, : t + 1], v2[:, : t + 1])
    assert torch.all(v[:, 0] == 0)
    if t + 1 < 12:
        assert not torch.equal(v[:, t + 1:], v2[:, t + 1:])  # V_{t+1} has seen x_t: it moves


def test_a_version_1_critic_is_refused_with_the_fix(tmp_path):
    critic = build_critic(tiny_qwen())
    save_critic(critic, tmp_path / "critic")
    meta_path = tmp_path / "critic" / "critic.json"
    meta = json.loads(meta_path.read_text())
    assert meta["version"] == 2 and meta["value_position"] == "t-1"
    meta["version"] = 1
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="version-1 critic.*re-run the warm-up"):
        load_critic(tmp_path / "critic")


def test_save_load_roundtrip_is_bit_identical(tmp_path):
    critic = build_critic(tiny_qwen(), head_init_std=0.05)
    ids = torch.randint(1, VOCAB, (2, 9))
    save_critic(critic, tmp_path / "critic")
    back = load_critic(tmp_path / "critic")
    assert fingerprint(back) == fingerprint(critic)
    assert torch.equal(back(ids, torch.ones_like(ids)), critic(ids, torch.ones_like(ids)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="save_critic"):
        load_critic(tmp_path / "empty")


def test_build_critic_from_checkpoint_dir_and_config(tmp_path):
    actor = tiny_qwen()
    actor.save_pretrained(tmp_path / "actor")
    critic = build_critic(tmp_path / "actor")
    for name, p in actor.model.state_dict().items():
        assert torch.equal(p, critic.backbone.state_dict()[name]), name
    assert build_critic(actor.config).head.in_features == 64
    with pytest.raises(ValueError, match="checkpoint directory"):
        build_critic(tmp_path / "missing")


# ----------------------------------------------------------------------------- warm-up


def learnable_episodes(n: int, seed: int) -> tuple[list[Episode], list[float]]:
    """Episodes whose reward is predictable from their tokens: the prompt holds a "key" token
    (10 or 20), and the reward is 1 for key 10, 0 for key 20. Two turns with an observation
    between them, so TB-GAE crosses one turn boundary."""
    rng = random.Random(seed)
    eps, rewards = [], []
    for _ in range(n):
        key = rng.choice([10, 20])
        prompt = [key] + [rng.randrange(30, VOCAB) for _ in range(3)]
        a0 = [rng.randrange(30, VOCAB) for _ in range(rng.randint(2, 4))]
        obs = [rng.randrange(30, VOCAB) for _ in range(rng.randint(2, 5))]
        a1 = [rng.randrange(30, VOCAB) for _ in range(rng.randint(2, 4))]
        ids = prompt + a0 + obs + a1
        mask = [0] * len(prompt) + [1] * len(a0) + [0] * len(obs) + [1] * len(a1)
        turns = [0] * (len(prompt) + len(a0)) + [1] * (len(obs) + len(a1))
        lps = [-1.0 if m else None for m in mask]
        eps.append(Episode(task_id=f"k{key}", family="f", difficulty="easy", token_ids=ids, logprobs=lps,
                           action_mask=mask, turn_ids=turns, turns=2, success=key == 10,
                           passed=int(key == 10), total=1))
        rewards.append(1.0 if key == 10 else 0.0)
    return eps, rewards


def test_warmup_trains_every_critic_parameter_and_no_actor_parameter():
    """docs/method.md section 5: the warm-up trains the whole critic (backbone and head) on rollouts
    of a frozen actor. The recipe freezes the actor with requires_grad_(False); a critic built
    from it must not inherit that (the first version trained 65 of 93,377 parameters)."""
    actor = tiny_qwen()
    actor.eval().requires_grad_(False)
    a0 = fingerprint(actor)
    critic = build_critic(actor)
    before = {k: v.clone() for k, v in critic.state_dict().items()}
    episodes, rewards = learnable_episodes(24, seed=1)
    warmup_critic(critic, episodes, rewards, WarmupConfig(minibatch_size=6, lr_critic=1e-3, gamma_turn=1.0, lam_turn=0.95,
                                                                seed=0))
    assert fingerprint(actor) == a0
    assert not any(p.requires_grad for p in actor.parameters())
    unchanged = [k for k, v in critic.state_dict().items() if torch.equal(v, before[k])]
    assert unchanged == [], unchanged


def test_warmup_config_rejects_bad_values():
    with pytest.raises(ValueError, match="warmup.epochs=0"):
        WarmupConfig(epochs=0)
    with pytest.raises(ValueError, match="warmup.gamma_turn=1.5"):
        WarmupConfig(gamma_turn=1.5)
    with pytest.raises(ValueError, match="warmup.reward='x'"):
        WarmupConfig(reward="x")


def test_a_direct_warmup_needs_the_discount_of_the_rpr_stage_it_serves():
    actor = tiny_qwen()
    episodes, rewards = learnable_episodes(8, seed=0)
    with pytest.raises(ValueError, match="WarmupConfig.gamma_turn is None"):
        warmup_critic(build_critic(actor), episodes, rewards, WarmupConfig(lam_turn=0.95))
    with pytest.raises(ValueError, match="WarmupConfig.lam_turn is None"):
        warmup_critic(build_critic(actor), episodes, rewards, WarmupConfig(gamma_turn=0.9))


def test_warmup_raises_explained_variance():
    episodes, rewards = learnable_episodes(96, seed=0)
    critic = build_critic(tiny_qwen())
    cfg = WarmupConfig(minibatch_size=6, grad_accum=2, lr_critic=3e-3, gamma_turn=1.0, lam_turn=0.95,
                       value_clip=0.0, seed=0)
    evs = warmup_critic(critic, episodes, rewards, cfg)
    assert len(evs) == 16  # one update per minibatch, one epoch
    # zero head: V = 0 at the start, so EV starts at 0 (exactly: Var(R - 0) = Var(R))
    assert evs[0] == pytest.approx(0.0, abs=1e-6)
    late = sum(evs[-4:]) / 4
    assert late > 0.5, evs

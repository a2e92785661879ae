"""RPR: the PPO losses (hand-worked cases, masking properties), one PPO update on a tiny random
Qwen3, the config, and (slow) an RPR phase on a toy task that raises mean reward."""

from __future__ import annotations

import copy
import json
import math
import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minirsi.config import ConfigError, load_config
from minirsi.core.critic import build_critic, fingerprint, value_loss
from minirsi.core.episode import Episode, collate
from minirsi.core.rpr import (
    EdgeStream,
    RPRConfig,
    approx_kl,
    kl_penalty,
    make_optimizers,
    policy_forward,
    policy_loss,
    ppo_update,
    prepare_batch,
    run_rpr,
    task_stream,
    uniform_groups,
    whiten,
)
from test_rollout import model, tok  # noqa: F401  (fixtures: a ChatML tokenizer and a tiny actor on it)
from tiny import VOCAB, tiny_qwen


# ----------------------------------------------------------------------------- helpers


def synthetic_episode(rng: random.Random, n_turns: int) -> Episode:
    """prompt (5 tokens), then per turn an action (3-6 tokens) and, except after the last, an
    observation (2-8 tokens); turn_ids follow episode.py; log-probs are made-up sampler values."""
    ids, mask, turns, lps = [rng.randrange(1, VOCAB) for _ in range(5)], [0] * 5, [0] * 5, [None] * 5
    for k in range(n_turns):
        n = rng.randint(3, 6)
        ids += [rng.randrange(1, VOCAB) for _ in range(n)]
        mask += [1] * n
        turns += [k] * n
        lps += [-rng.random() * 3 for _ in range(n)]
        if k < n_turns - 1:
            n = rng.randint(2, 8)
            ids += [rng.randrange(1, VOCAB) for _ in range(n)]
            mask += [0] * n
            turns += [k + 1] * n
            lps += [None] * n
    return Episode(task_id="t", family="f", difficulty="easy", token_ids=ids, logprobs=lps,
                   action_mask=mask, turn_ids=turns, turns=n_turns, success=False, passed=0, total=1)


def synthetic_batch(n: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """A collated batch with made-up advantages / returns / old values / old log-probs."""
    rng = random.Random(seed)
    eps = [synthetic_episode(rng, rng.randint(1, 3)) for _ in range(n)]
    b = collate(eps, [rng.random() for _ in eps])
    g = torch.Generator().manual_seed(seed)
    m = b["action_mask"]
    b["sampler_logprobs"] = b["old_logprobs"]
    b["old_logprobs"] = b["old_logprobs"] * m
    b["advantages"] = torch.randn(m.shape, generator=g) * m
    b["returns"] = torch.randn(m.shape, generator=g) * m
    b["old_values"] = torch.zeros(m.shape)
    return b


# ----------------------------------------------------------------------------- pure losses


def test_policy_loss_hand_worked():
    # Two action tokens (eps = 0.2):
    #   t0: rho = e^{log 1.5} = 1.5, A = +1 -> min(1.5, 1.2) = 1.2      (clipped)
    #   t1: rho = e^{log 0.5} = 0.5, A = +2 -> min(1.0, 1.6) = 1.0      (|rho-1| > eps, counted as clipped)
    #   t2: observation token, anything there is ignored
    # L = -(1.2 + 1.0) / 2 = -1.1 ; clip_frac = 2 / 2 = 1
    lp = torch.tensor([[math.log(1.5), math.log(0.5), 100.0]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 2.0, 1e6]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, cf = policy_loss(lp, old, adv, mask, 0.2)
    assert loss.item() == pytest.approx(-1.1)
    assert cf.item() == pytest.approx(1.0)
    # Negative advantage, rho = 0.5: min(0.5 * -1, 0.8 * -1) = -0.8 -> L = 0.8
    loss, cf = policy_loss(torch.tensor([[math.log(0.5)]]), torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), 0.2)
    assert loss.item() == pytest.approx(0.8)


def test_policy_loss_gradient_only_on_unclipped_action_tokens():
    lp = torch.tensor([[0.0, math.log(2.0), 0.0, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    loss, _ = policy_loss(lp, torch.zeros(1, 4), adv, mask, 0.2)
    loss.backward()
    # t0, t3: rho = 1, d(-rho A / 3)/dlp = -1/3; t1 clipped (rho = 2 > 1.2, A > 0): 0; t2 masked: 0
    assert lp.grad[0].tolist() == pytest.approx([-1 / 3, 0.0, 0.0, -1 / 3])


def test_kl_penalty_k3():
    # d = log pi_ref - log pi = log 2 -> k3 = 2 - log 2 - 1 ; masked token ignored
    lp = torch.tensor([[0.0, 5.0]])
    ref = torch.tensor([[math.log(2.0), -50.0]])
    assert kl_penalty(lp, ref, torch.tensor([[1.0, 0.0]])).item() == pytest.approx(1 - math.log(2.0))
    assert kl_penalty(lp, lp, torch.ones(1, 2)).item() == 0.0


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_losses_ignore_non_action_positions(seed):
    """Perturbing log-probs, advantages, values or returns off the action mask (observation
    and padding) never changes the policy, KL or value loss."""
    from minirsi.core.critic import value_loss

    g = torch.Generator().manual_seed(seed)
    B, T = 3, 12
    mask = (torch.rand(B, T, generator=g) < 0.5).float()
    mask[0, 0] = 1.0
    x = {k: torch.randn(B, T, generator=g) for k in ("lp", "old", "adv", "ref", "v", "vold", "r")}
    noisy = {k: torch.where(mask.bool(), v, v + 1e3 * torch.randn(B, T, generator=g)) for k, v in x.items()}

    def losses(d):
        return (policy_loss(d["lp"], d["old"], d["adv"], mask, 0.2)[0],
                kl_penalty(d["lp"], d["ref"], mask),
                value_loss(d["v"], d["vold"], d["r"], mask, 0.2))

    for a, b in zip(losses(x), losses(noisy)):
        assert torch.equal(a, b)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000))
def test_whiten_over_action_tokens(seed):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(4, 9, generator=g) < 0.6).float()
    mask[0, :2] = 1.0
    a = whiten(torch.randn(4, 9, generator=g) * 5 + 3, mask)
    sel = a[mask.bool()]
    assert abs(sel.mean().item()) < 1e-5
    assert sel.std(unbiased=False).item() == pytest.approx(1.0, rel=1e-4)
    assert torch.all(a[~mask.bool()] == 0)


def test_policy_forward_matches_models_token_logprobs():
    from minirsi.engine.models import token_logprobs

    model = tiny_qwen()
    b = synthetic_batch()
    ours, ent = policy_forward(model, b["input_ids"], b["attention_mask"], 0.7, with_entropy=True)
    theirs = token_logprobs(model, b["input_ids"], b["attention_mask"], temperature=0.7)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert ent.shape == ours.shape and torch.all(ent >= 0) and ent[0, 1] <= math.log(VOCAB) + 1e-4


# ----------------------------------------------------------------------------- one PPO update


def _cfg(**kw) -> RPRConfig:
    base = dict(minibatch_size=3, grad_accum=1, ppo_epochs=1, lr_actor=1e-3, lr_critic=1e-3, seed=0)
    base.update(kw)
    return RPRConfig(**base)


def test_ppo_update_changes_actor_and_critic():
    actor = tiny_qwen()
    critic = build_critic(actor)
    cfg = _cfg()
    a0, c0 = fingerprint(actor), fingerprint(critic)
    m = ppo_update(actor, critic, synthetic_batch(), cfg, make_optimizers(actor, critic, cfg))
    assert fingerprint(actor) != a0 and fingerprint(critic) != c0
    for key in ("policy_loss", "value_loss", "clip_frac", "entropy", "approx_kl", "explained_variance"):
        assert key in m and (math.isfinite(m[key]) or key == "explained_variance")
    assert m["entropy"] > 0


def test_ppo_update_moves_log_probs_in_the_direction_of_the_advantage():
    """One small step: action tokens with A > 0 become more likely, those with A < 0 less."""
    actor = tiny_qwen()
    critic = build_critic(actor)
    batch = synthetic_batch(n=4, seed=5)
    m = batch["action_mask"]
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]
    batch["advantages"] = sign * m  # (B, T)
    with torch.no_grad():
        before, _ = policy_forward(actor, batch["input_ids"], batch["attention_mask"], 1.0)
    batch["old_logprobs"] = before * m  # on-policy: rho = 1 at the start
    cfg = _cfg(minibatch_size=4, max_grad_norm=1e9)
    opts = make_optimizers(actor, critic, cfg)
    opts = type(opts)(torch.optim.SGD(actor.parameters(), lr=0.05), opts.critic)
    ppo_update(actor, critic, batch, cfg, opts)
    with torch.no_grad():
        after, _ = policy_forward(actor, batch["input_ids"], batch["attention_mask"], 1.0)
    change = ((after - before) * m).sum(1) / m.sum(1)  # mean log-prob change per episode
    assert torch.all(change * sign[:, 0] > 0), change


def test_target_kl_stops_the_actor_not_the_critic():
    actor = tiny_qwen()
    critic = build_critic(actor)
    batch = synthetic_batch(n=6, seed=3)
    with torch.no_grad():
        lp, _ = policy_forward(actor, batch["input_ids"], batch["attention_mask"], 1.0)
    batch["old_logprobs"] = lp * batch["action_mask"]  # on-policy: the first minibatch has KL 0
    runs = {}
    for target in (0.0, 1e-9):
        a, c = copy.deepcopy(actor), copy.deepcopy(critic)
        cfg = _cfg(minibatch_size=2, ppo_epochs=2, lr_actor=1e-2, target_kl=target)
        c0 = fingerprint(c)
        runs[target] = ppo_update(a, c, dict(batch), cfg, make_optimizers(a, c, cfg))
        assert fingerprint(c) != c0  # the critic trains on every minibatch either way
    assert runs[0.0]["actor_updates"] == 6  # 2 epochs x 3 minibatches
    # The first step moves the policy; the next minibatch measures KL > 1e-9 and stops it.
    assert runs[1e-9]["actor_updates"] == 1
    assert runs[1e-9]["approx_kl"] > 0


def test_lr_warmup_ramps_the_actor_step_by_step():
    actor = tiny_qwen()
    critic = build_critic(actor)
    cfg = _cfg(minibatch_size=2, lr_actor=1e-3, lr_warmup_updates=4)
    opts = make_optimizers(actor, critic, cfg)
    seen = []
    step = opts.actor.step

    def record(*a, **kw):
        seen.append(opts.actor.param_groups[0]["lr"])
        return step(*a, **kw)

    opts.actor.step = record
    ppo_update(actor, critic, synthetic_batch(n=6, seed=2), cfg, opts)  # 3 minibatches
    ppo_update(actor, critic, synthetic_batch(n=6, seed=3), cfg, opts)  # goes on from step 3
    assert seen == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_calibration_update_leaves_actor_bit_identical():
    actor = tiny_qwen()
    critic = build_critic(actor)
    cfg = _cfg()
    a0, c0 = fingerprint(actor), fingerprint(critic)
    ppo_update(actor, critic, synthetic_batch(), cfg, make_optimizers(actor, critic, cfg), update_actor=False)
    assert fingerprint(actor) == a0
    assert fingerprint(critic) != c0


def test_a_calibration_update_is_the_warmups_critic_step_and_never_reads_the_actor():
    """RPR's calibration and the warm-up share one critic step (critic.critic_step): the
    calibration update equals that step written out by hand (zero_grad, value_coef * L_V over
    the micro-batches, normalised by the minibatch's token count, one clipped AdamW step), and
    the actor is not even called."""
    class Unread(torch.nn.Module):
        def forward(self, *a, **k):
            raise AssertionError("a calibration update read the actor")

    cfg = _cfg(minibatch_size=6, grad_accum=2, value_coef=0.5, value_clip=0.2)
    batch = synthetic_batch(n=6, seed=5)
    batch["old_values"] = torch.randn(batch["action_mask"].shape, generator=torch.Generator().manual_seed(1))
    critic = build_critic(tiny_qwen())
    by_hand = copy.deepcopy(critic)
    opt = torch.optim.AdamW(by_hand.parameters(), lr=cfg.lr_critic, weight_decay=0.0)
    m = ppo_update(Unread(), critic, batch, cfg, make_optimizers(torch.nn.Linear(1, 1), critic, cfg), update_actor=False)
    # by hand: one minibatch of all 6 rows in 2 micro-batches (their order does not change the sum)
    n_tok = batch["action_mask"].sum()
    opt.zero_grad()
    for rows in (slice(0, 3), slice(3, 6)):
        mb = {k: v[rows] for k, v in batch.items()}
        values = by_hand(mb["input_ids"], mb["attention_mask"])
        (cfg.value_coef * value_loss(values, mb["old_values"], mb["returns"], mb["action_mask"], cfg.value_clip,
                                     n_tok)).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(by_hand.parameters(), cfg.max_grad_norm))
    opt.step()
    for (name, a), b in zip(critic.state_dict().items(), by_hand.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # AdamW hardly sees a scale on the loss: the gradient norm does (value_coef applied once)
    assert m["grad_norm_critic"] == pytest.approx(norm, rel=1e-5)
    assert m["actor_updates"] == 0 and m["value_loss"] > 0 and "approx_kl" not in m


def test_grad_accumulation_equals_one_big_minibatch():
    """grad_accum splits a minibatch but divides by the minibatch's token count, so the
    parameters after one step match the unsplit step (up to float rounding)."""
    batch = synthetic_batch(n=4, seed=3)
    outs = []
    for accum in (1, 2):
        actor = tiny_qwen()
        critic = build_critic(actor, head_init_std=0.02)
        cfg = _cfg(minibatch_size=4, grad_accum=accum, max_grad_norm=1e9)
        opts = make_optimizers(actor, critic, cfg)
        # SGD makes the step proportional to the gradient (AdamW's first step is sign-like)
        opts = type(opts)(torch.optim.SGD(actor.parameters(), lr=1.0), torch.optim.SGD(critic.parameters(), lr=1.0))
        ppo_update(actor, critic, batch, cfg, opts)
        outs.append((actor.state_dict(), critic.state_dict()))
    for sd1, sd2 in zip(outs[0], outs[1]):
        for k in sd1:
            assert torch.allclose(sd1[k], sd2[k], atol=1e-5), k


def test_padding_tokens_never_reach_the_losses():
    """Right padding: changing the pad ids after each sequence's end leaves every metric of
    the update identical (the causal model never attends forward, losses mask padding)."""
    batch = synthetic_batch(n=5, seed=1)
    pad = batch["attention_mask"] == 0
    assert pad.any()
    batch2 = {k: v.clone() for k, v in batch.items()}
    batch2["input_ids"][pad] = torch.randint(1, VOCAB, (int(pad.sum()),))
    res = []
    for b in (batch, batch2):
        actor = tiny_qwen()
        critic = build_critic(actor, head_init_std=0.02)
        cfg = _cfg(minibatch_size=5)
        res.append(ppo_update(actor, critic, b, cfg, make_optimizers(actor, critic, cfg)))
    for k in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_frac"):
        assert res[0][k] == pytest.approx(res[1][k], abs=1e-6), k


def test_length_trimmed_forward_passes_equal_the_full_width_pass():
    """Old log-probs and values are computed longest sequences first, each pass cut to its
    rows' longest length: the same numbers as one pass over the full padded width."""
    from minirsi.core.critic import compute_values
    from minirsi.core.rpr import _nograd_logprobs

    batch = synthetic_batch(n=7, seed=5)
    lengths = batch["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) > 2  # rows of several widths
    actor = tiny_qwen()
    critic = build_critic(actor, head_init_std=0.02)
    real = batch["attention_mask"].bool()
    full_lp = policy_forward(actor, batch["input_ids"], batch["attention_mask"], 0.9)[0]
    ours_lp = _nograd_logprobs(actor, batch, _cfg(forward_chunk=3, temperature=0.9))
    torch.testing.assert_close(ours_lp[real], full_lp.detach()[real], atol=1e-5, rtol=0)
    full_v = critic(batch["input_ids"], batch["attention_mask"]).detach()
    ours_v = compute_values(critic, batch, chunk=3)
    torch.testing.assert_close(ours_v[real], full_v[real], atol=1e-5, rtol=0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(1, 8), st.integers(1, 3),
       st.integers(0, 10**6))
def test_minibatches_cover_each_episode_once_with_micro_batches_by_length(lengths, size, accum, seed):
    from minirsi.core.episode import minibatches

    L = torch.tensor(lengths)
    gen = torch.Generator().manual_seed(seed)
    mbs = list(minibatches(len(lengths), size, accum, gen, L))
    seen = torch.cat([torch.cat(micro) for micro in mbs]).tolist()
    assert sorted(seen) == list(range(len(lengths)))
    for micro in mbs:
        flat = torch.cat(micro)
        assert len(flat) <= size and len(micro) <= accum
        assert L[flat].tolist() == sorted(L[flat].tolist(), reverse=True)  # only the inside is ordered


def test_minibatches_are_random_not_grouped_by_length():
    """Length-grouped minibatches are outcome-grouped on the shell tasks (short episodes are mostly
    successes): every minibatch must be a uniform random draw, and each epoch a new one."""
    from minirsi.core.episode import minibatches

    L = torch.arange(1, 33)  # 32 episodes, every length different
    gen = torch.Generator().manual_seed(0)
    spans, partitions = [], set()
    for _ in range(50):  # 50 epochs
        mbs = [torch.cat(micro) for micro in minibatches(32, 8, 1, gen, L)]
        spans += [int(L[mb].max() - L[mb].min()) for mb in mbs]
        partitions.add(tuple(sorted(tuple(sorted(mb.tolist())) for mb in mbs)))
    # A length band of 8 spans 7; 8 uniform draws from 1..32 span ~25 on average.
    assert sum(spans) / len(spans) > 20
    assert len(partitions) == 50


def test_approx_kl_hand_worked():
    # a token whose log-prob fell by 3 nats: r = e^-3, k3 = e^-3 - 1 + 3 = 2.0498 (the reversed
    # estimator, e^3 - 3 - 1, would say 16.09); an unchanged token: 0; the masked one is ignored
    lp = torch.tensor([[-4.0, -1.0, 7.0]])
    old = torch.tensor([[-1.0, -1.0, -50.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    assert approx_kl(lp, old, m).item() == pytest.approx((math.exp(-3) + 2) / 2)


def test_approx_kl_estimates_the_exact_kl_of_two_categoricals():
    """Tokens drawn from pi_old: the mean of approx_kl is KL(pi_old || pi_new) (exact sum), and
    the reversed form (kl_penalty's, for samples from pi_new) is not."""
    g = torch.Generator().manual_seed(0)
    p_old = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    p_new = torch.tensor([0.1, 0.3, 0.3, 0.2, 0.1])
    exact = float((p_old * (p_old / p_new).log()).sum())  # 0.5157
    x = torch.multinomial(p_old, 400_000, replacement=True, generator=g)[None]  # (1, N)
    lp_new, lp_old, m = p_new.log()[x], p_old.log()[x], torch.ones(x.shape)
    assert approx_kl(lp_new, lp_old, m).item() == pytest.approx(exact, rel=0.02)
    assert abs(kl_penalty(lp_new, lp_old, m).item() - exact) > 0.3  # chi^2 - KL: 1.268


def test_target_kl_stops_at_the_first_minibatch_over_the_target():
    """Constructed: the actor barely moves (lr 1e-9); the rows of the third minibatch carry old
    log-probs 2 nats above the actor's (approx KL e^-2 + 1 = 1.135 there, 0 elsewhere). With
    target 0.5 the actor takes exactly 2 steps; with 1.2 it takes all 4. The reversed estimator
    (e^2 - 3 = 4.39) would stop at 1.2 too; at 1-nat shifts it would stop where KL = 0.37."""
    from minirsi.core.episode import minibatches

    actor = tiny_qwen()
    critic = build_critic(actor)
    batch = synthetic_batch(n=8, seed=4)
    m = batch["action_mask"]
    with torch.no_grad():
        lp, _ = policy_forward(actor, batch["input_ids"], batch["attention_mask"], 1.0)
    mbs = [torch.cat(micro) for micro in minibatches(8, 2, 1, torch.Generator().manual_seed(7),
                                                     batch["attention_mask"].sum(1))]
    shift = torch.zeros(8, 1)
    shift[mbs[2]] = 2.0
    batch["old_logprobs"] = (lp + shift) * m
    runs = {}
    for target in (0.5, 1.2, 0.3):
        a, c = copy.deepcopy(actor), copy.deepcopy(critic)
        cfg = _cfg(minibatch_size=2, lr_actor=1e-9, target_kl=target)
        runs[target] = ppo_update(a, c, dict(batch), cfg, make_optimizers(a, c, cfg), seed=7)["actor_updates"]
    assert runs == {0.5: 2, 1.2: 4, 0.3: 2}


def test_kl_to_reference_is_zero_at_start_and_grows():
    actor = tiny_qwen()
    ref = copy.deepcopy(actor).requires_grad_(False)
    critic = build_critic(actor)
    cfg = _cfg(kl_coef=0.1, ppo_epochs=3, lr_actor=3e-3)
    batch = synthetic_batch()
    m = ppo_update(actor, critic, batch, cfg, make_optimizers(actor, critic, cfg), ref_model=ref)
    assert "ref_logprobs" in batch
    assert m["kl_ref"] > 0  # epochs 2 and 3 see a moved policy
    with pytest.raises(ValueError, match="reference"):
        ppo_update(tiny_qwen(), critic, synthetic_batch(), cfg, make_optimizers(actor, critic, cfg))


def test_lora_actor_reference_is_the_adapter_free_base():
    """With a peft LoRA actor and no ref_model, pi_ref is the actor with its adapters disabled:
    KL is 0 before any step (B = 0 at init) and > 0 after; only adapter weights train; the
    critic is built from the merged weights and leaves the live adapter alone."""
    from minirsi.engine.models import LoraSettings, attach_lora

    actor = attach_lora(tiny_qwen(), LoraSettings(r=4, alpha=8))
    a0 = fingerprint(actor)
    critic = build_critic(actor)
    assert fingerprint(actor) == a0
    base = {k: v.clone() for k, v in actor.state_dict().items() if "lora_" not in k}
    batch = synthetic_batch()
    cfg = _cfg(kl_coef=0.1, ppo_epochs=1, lr_actor=3e-2)
    with torch.no_grad():
        start, _ = policy_forward(actor, batch["input_ids"], batch["attention_mask"], cfg.temperature)
    m = ppo_update(actor, critic, batch, cfg, make_optimizers(actor, critic, cfg))
    assert torch.allclose(batch["ref_logprobs"], start, atol=1e-6)  # adapters at B = 0: pi_ref = pi_theta
    assert m["kl_ref"] >= 0.0
    m2 = ppo_update(actor, critic, batch, cfg, make_optimizers(actor, critic, cfg))
    assert m2["kl_ref"] > 0.0
    after = actor.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in base.items())
    assert fingerprint(actor) != a0


# ----------------------------------------------------------------------------- config


def test_token_gae_ablation_decays_per_action_token_tb_gae_per_turn():
    """prompt (2) | turn 0: 2 action tokens | observation (3) | turn 1: 2 action tokens; reward 1
    on the last; zero critic (V = 0), no whitening. TB-GAE (gamma_turn 1, lam_turn 0.5): A = 1 in
    the last turn, 0.5 in the first. Per-token GAE (gamma 1, lam 0.5 a token, observation
    skipped): A = 0.5^k with k the action tokens after t: 0.125, 0.25 | 0.5, 1."""
    ep = Episode(task_id="t", family="f", difficulty="easy", token_ids=[5, 6, 7, 8, 9, 10, 11, 12, 13],
                 logprobs=[None, None, -1.0, -1.0, None, None, None, -1.0, -1.0],
                 action_mask=[0, 0, 1, 1, 0, 0, 0, 1, 1], turn_ids=[0, 0, 0, 0, 1, 1, 1, 1, 1], turns=2,
                 success=True, passed=1, total=1)
    actor = tiny_qwen()
    critic = build_critic(actor)  # zero head: every value is 0
    act = [2, 3, 7, 8]
    got = {}
    for kind in ("tb_gae", "token_gae"):
        cfg = _cfg(gamma_turn=1.0, lam_turn=0.5, whiten_advantages=False, advantage=kind)
        got[kind] = prepare_batch(actor, critic, [ep], [1.0], cfg)["advantages"][0, act].tolist()
    assert got["tb_gae"] == pytest.approx([0.5, 0.5, 1.0, 1.0])
    assert got["token_gae"] == pytest.approx([0.125, 0.25, 0.5, 1.0])
    with pytest.raises(ValueError, match="advantage='gae'"):
        RPRConfig(advantage="gae")


def test_config_rejects_bad_values_with_fix(tmp_path):
    with pytest.raises(ValueError, match="clip_eps"):
        RPRConfig(clip_eps=1.5)
    with pytest.raises(ValueError, match="lower grad_accum"):
        RPRConfig(minibatch_size=2, grad_accum=4)
    with pytest.raises(ValueError, match="'fdr' or 'spr'"):
        RPRConfig(reward="dense")
    p = tmp_path / "rpr.yaml"
    p.write_text("lr_actor: 2.0e-5\nreward: fdr\n")
    cfg = load_config(RPRConfig, p, ["ppo_epochs=3"])
    assert (cfg.lr_actor, cfg.reward, cfg.ppo_epochs, cfg.critic_calibration_updates) == (2e-5, "fdr", 3, 4)
    with pytest.raises(ConfigError):
        load_config(RPRConfig, p, ["lam=0.9"])
    with pytest.raises(ConfigError, match="gamma_turn"):
        load_config(RPRConfig, p, ["gamma_turn=1.5"])


@given(n_tasks=st.integers(1, 7), group=st.sampled_from([1, 2, 4]), draws=st.integers(1, 4), seed=st.integers(0, 99))
@settings(max_examples=40, deadline=None)
def test_task_stream_repeats_each_drawn_task_group_times_and_cycles_the_pool(n_tasks, group, draws, seed):
    tasks = [f"t{i}" for i in range(n_tasks)]
    stream = task_stream(tasks, group * draws, seed, group)
    drawn = []
    for _ in range(3):
        step = next(stream)
        assert len(step) == group * draws
        heads = step[::group]
        assert all(step[i * group:(i + 1) * group] == [h] * group for i, h in enumerate(heads))
        drawn += heads
    full = len(drawn) // n_tasks * n_tasks  # every complete pass over the shuffle holds each task once
    for k in range(0, full, n_tasks):
        assert sorted(drawn[k:k + n_tasks]) == tasks


def _group_episodes(outcomes: dict[str, list[bool]], seed: int = 0) -> list[Episode]:
    rng, out = random.Random(seed), []
    for task_id, successes in outcomes.items():
        for ok in successes:
            e = synthetic_episode(rng, 2)
            e.task_id, e.success, e.passed = task_id, ok, int(ok)
            out.append(e)
    return out


def test_uniform_groups_are_the_tasks_without_both_outcomes():
    eps = _group_episodes({"solved": [True] * 3, "failed": [False] * 3, "mixed": [True, False, False]})
    assert uniform_groups(eps) == {"solved", "failed"}


@pytest.mark.parametrize("mixed", [True, False])
def test_drop_uniform_groups_trains_on_tasks_with_both_outcomes_only(mixed):
    """Two tasks, 4 episodes each a step: "solved" always succeeds; "other" succeeds half of
    the time (mixed) or never. Only "other"'s episodes reach the update; with no task of both
    outcomes the actor stays bit-identical and the critic still learns."""
    torch.manual_seed(0)
    actor = tiny_qwen()
    critic = build_critic(actor)
    a0, c0 = fingerprint(actor), fingerprint(critic)
    calls = []

    def rollout_fn(model, tasks, seed):
        calls.append(list(tasks))
        assert tasks[:4] == [tasks[0]] * 4 and tasks[4:] == [tasks[4]] * 4
        return _group_episodes({"solved": [True] * 4, "other": [True, False] * 2 if mixed else [False] * 4}, seed)

    cfg = _cfg(episodes_per_step=8, samples_per_task=4, drop_uniform_groups=True, steps=1,
               critic_calibration_updates=0, lr_actor=1e-3, reward="fdr")
    pushed = []
    (record,) = run_rpr(actor, critic, None, ["solved", "other"], cfg, rollout_fn, scales={"f": 1.0},
                        after_actor_update=lambda model: pushed.append(1) or {})
    assert len(pushed) == int(mixed)  # an unchanged actor is not pushed to the servers
    assert record["episodes"] == 8 and record["binary_reward"] == (6 / 8 if mixed else 4 / 8)
    assert record["trained_episodes"] == (4 if mixed else 0)
    assert (fingerprint(actor) != a0) is mixed
    assert fingerprint(critic) != c0
    with pytest.raises(ValueError, match="divide"):
        RPRConfig(episodes_per_step=8, samples_per_task=3)
    with pytest.raises(ValueError, match="samples_per_task >= 2"):
        RPRConfig(drop_uniform_groups=True)


def test_oversampling_rolls_out_more_groups_and_trains_on_the_first_mixed_ones():
    """oversample=2, 2 groups a step: 4 tasks drawn (16 episodes), of which "a" and "d" have
    both outcomes and "b" "c" do not; the update sees the first 2 mixed groups, "a" and "d"."""
    torch.manual_seed(0)
    actor = tiny_qwen()
    critic = build_critic(actor)
    drawn, trained = [], []

    def rollout_fn(model, tasks, seed):
        drawn.append(list(tasks))
        outcome = {"a": [True, False] * 2, "b": [True] * 4, "c": [False] * 4, "d": [False, True] * 2}
        return _group_episodes({t: outcome[t] for t in dict.fromkeys(tasks)}, seed)

    cfg = _cfg(episodes_per_step=8, samples_per_task=4, drop_uniform_groups=True, oversample=2, steps=1,
               critic_calibration_updates=0, lr_actor=1e-3, reward="fdr")
    import minirsi.core.rpr as rpr_mod

    real = rpr_mod.prepare_batch

    def spy(actor_, critic_, episodes, *args, **kw):
        trained.append(sorted({e.task_id for e in episodes}))
        return real(actor_, critic_, episodes, *args, **kw)

    rpr_mod.prepare_batch = spy
    try:
        (record,) = run_rpr(actor, critic, None, ["a", "b", "c", "d"], cfg, rollout_fn, scales={"f": 1.0})
    finally:
        rpr_mod.prepare_batch = real
    assert len(drawn[0]) == 16 and sorted(set(drawn[0])) == ["a", "b", "c", "d"]
    assert trained == [["a", "d"]] and record["episodes"] == 16 and record["trained_episodes"] == 8
    assert record["binary_reward"] == 8 / 16
    with pytest.raises(ValueError, match="oversample"):
        RPRConfig(oversample=2)  # only with drop_uniform_groups: the extra groups are there to be filtered


def test_first_groups_keeps_whole_groups_in_order_of_appearance():
    from minirsi.core.rpr import first_groups

    eps = _group_episodes({"x": [True, False], "y": [True, False], "z": [False, True]})
    assert [eps[i].task_id for i in first_groups(range(6), eps, 2)] == ["x", "x", "y", "y"]
    assert first_groups([4, 5, 0], eps, 1) == [4, 5]


def _bucketed_pool(rates: dict[str, float], per_bucket: int = 10) -> tuple[list, dict[str, float]]:
    """Tasks in buckets by difficulty (one family), each bucket's tasks solved with its rate."""
    tasks = [SimpleNamespace(task_id=f"f-{d}-{i}", family="f", difficulty=d) for d in rates for i in range(per_bucket)]
    return tasks, {t.task_id: rates[t.difficulty] for t in tasks}


def _play(stream, rate: dict[str, float], steps: int, seed: int = 0) -> list[list[Episode]]:
    """``steps`` draws from ``stream``, each episode a success with its task's rate."""
    rng, out = random.Random(seed), []
    for _ in range(steps):
        draw = next(stream)
        eps = [SimpleNamespace(task_id=t.task_id, success=rng.random() < rate[t.task_id])
               for t in draw]
        if isinstance(stream, EdgeStream):
            stream.observe(eps)
        out.append(eps)
    return out


def test_edge_stream_draws_where_groups_are_mixed_and_keeps_trying_the_rest():
    """A probe with a known answer: buckets the actor never solves (hard), always solves
    (trivial) and solves half of the time (edge). The edge bucket's groups of 4 are mixed 7 times
    in 8, the others never: after the first steps the stream draws it most, the others still get
    draws, and over the run it yields more mixed groups than a uniform shuffle of the same pool."""
    tasks, rate = _bucketed_pool({"hard": 0.0, "trivial": 1.0, "edge": 0.5})
    edge = EdgeStream(tasks, 32, seed=0, group=4)
    edge_steps = _play(edge, rate, 12)
    uniform_steps = _play(task_stream(tasks, 32, 0, 4), rate, 12)
    assert edge.probs[("edge",)] > 3 * max(edge.probs[("hard",)], edge.probs[("trivial",)])
    assert min(edge.probs.values()) > 0.03  # nothing is dropped for good
    late = [e.task_id.split("-")[1] for step in edge_steps[6:] for e in step]
    assert {"hard", "trivial"} <= set(late)

    def mixed(steps):
        return sum(len({e.task_id for e in s}) - len(uniform_groups(s)) for s in steps)

    assert mixed(edge_steps) > 1.5 * mixed(uniform_steps)
    ids = [[e.task_id for e in s] for s in edge_steps]
    assert all(len(s) == 32 and all(s[i * 4:(i + 1) * 4] == [s[i * 4]] * 4 for i in range(8)) for s in ids)


def test_edge_streams_pool_success_estimates_what_a_uniform_draw_measures():
    """pool_success: each drawn bucket's success weighed by its share of the pool. The raw
    success of the edge stream's draws is biased toward its favourite bucket; the estimate's
    mean over many steps is the pool's true success, (0 + 1 + 0.5) / 3 = 0.5 here within
    noise, where the raw mean is off by more than that noise."""
    tasks, rate = _bucketed_pool({"hard": 0.0, "trivial": 1.0, "edge": 0.5}, per_bucket=10)
    rate["f-trivial-0"] = rate["f-trivial-1"] = 0.5  # a trivial bucket with some contrast: a lopsided draw
    truth = sum(rate.values()) / len(rate)
    edge = EdgeStream(tasks, 32, seed=1, group=4)
    steps = _play(edge, rate, 1)
    est = [edge.pool_success()]
    for _ in range(299):
        steps += _play(edge, rate, 1, seed=len(steps))
        est.append(edge.pool_success())
    raw = [sum(e.success for e in s) / len(s) for s in steps]
    assert abs(sum(est) / len(est) - truth) < 0.02
    assert abs(sum(raw) / len(raw) - truth) > 0.04


def test_edge_streams_pool_success_carries_no_noise_from_how_many_groups_a_bucket_drew():
    """A known answer: one bucket of four is always solved and the others never, so the pool's
    success is that bucket's share, 0.25, in every step once each bucket has been drawn, however
    many groups each drew. Reweighting each episode by share / draw probability (the estimate
    before this one) is right on average only: a step reads 0.25 x the solved bucket's drawn
    fraction / its draw probability."""
    tasks, rate = _bucketed_pool({"trivial": 1.0, "hard": 0.0, "hard2": 0.0, "hard3": 0.0}, per_bucket=6)
    edge = EdgeStream(tasks, 16, seed=5, group=2)
    old, new = [], []
    for _ in range(40):
        draw = next(edge)
        eps = [SimpleNamespace(task_id=t.task_id, success=rate[t.task_id] == 1.0) for t in draw]
        old.append(sum(edge.share[edge.bucket[e.task_id]] / edge.probs[edge.bucket[e.task_id]] * e.success
                       for e in eps) / len(eps))
        edge.observe(eps)
        if len(edge.success) == 4:
            new.append(edge.pool_success())
    assert len(new) > 30 and new == pytest.approx([0.25] * len(new))
    assert max(abs(x - 0.25) for x in old) > 0.1  # the old estimate moved with the draw counts


def test_edge_streams_pool_success_until_every_bucket_is_drawn():
    """A bucket never drawn is left out (the others' shares renormalised), and a bucket not
    drawn this step keeps the success of the last step that drew it."""
    tasks, _ = _bucketed_pool({"a": 0.0, "b": 0.0}, per_bucket=3)
    edge = EdgeStream(tasks, 2, seed=0, group=1)
    assert edge.pool_success() == 0.0  # nothing observed yet
    ep = lambda tid, ok: SimpleNamespace(task_id=tid, success=ok)  # noqa: E731
    edge.observe([ep("f-a-0", True), ep("f-a-1", False)])
    assert edge.pool_success() == 0.5  # only bucket a seen: its success
    edge.observe([ep("f-b-0", False), ep("f-b-1", False)])
    assert edge.pool_success() == 0.25  # a keeps 0.5, b 0.0, half the pool each
    edge.observe([ep("f-a-2", True), ep("outside-the-pool", True)])
    assert edge.pool_success() == 0.5 and edge.success == {("a",): 1.0, ("b",): 0.0}


def test_run_rpr_with_edge_sampling_trains_on_more_episodes_and_logs_the_uniform_estimate():
    """The same pool through run_rpr: with pool_sampling='edge' more of each step's draws are
    mixed groups, so more episodes reach the update, and ``pool_success`` is logged either way:
    ``binary_reward`` under a uniform draw, and under edge sampling the estimate that counts
    each step's own episodes (its stream's ``pool_success`` after observing them)."""
    tasks, rate = _bucketed_pool({"hard": 0.0, "trivial": 1.0, "edge": 0.5})
    trained = {}
    for sampling in ("uniform", "edge"):
        torch.manual_seed(0)
        actor = tiny_qwen()
        critic = build_critic(actor)
        rolled = []

        def rollout_fn(model, drawn, seed):
            rng = random.Random(seed)
            rolled.append(_group_episodes({tid: [rng.random() < rate[tid] for _ in range(4)]
                                           for tid in dict.fromkeys(t.task_id for t in drawn)}, seed))
            return rolled[-1]

        cfg = _cfg(episodes_per_step=8, samples_per_task=4, drop_uniform_groups=True, oversample=2, steps=6,
                   critic_calibration_updates=2, reward="fdr", pool_sampling=sampling)
        history = run_rpr(actor, critic, None, tasks, cfg, rollout_fn, scales={"f": 1.0})
        trained[sampling] = sum(h["trained_episodes"] for h in history)
        if sampling == "uniform":
            assert all(h["pool_success"] == h["binary_reward"] for h in history)
        else:
            replay = EdgeStream(tasks, 16, seed=0, group=4)
            for h, eps in zip(history, rolled, strict=True):
                replay.observe(eps)
                assert h["pool_success"] == replay.pool_success()
            assert len({h["pool_success"] for h in history}) > 1
    assert trained["edge"] > trained["uniform"]
    with pytest.raises(ValueError, match="pool_sampling"):
        RPRConfig(pool_sampling="greedy")


# ----------------------------------------------------------------------------- resume from the journal


class _Killed(BaseException):
    """Stands in for SIGKILL (or a dead server with on_server_failure=fail) in one process."""


class _KillAt:
    """A sampler that dies at its ``at``-th generate call."""

    def __init__(self, inner, at: int):
        self.inner, self.at, self.calls = inner, at, 0

    def clear_cache(self):
        self.inner.clear_cache()

    def generate(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise _Killed()
        return self.inner.generate(*args, **kwargs)


def _journaled_phase(model, tok, journal, monkeypatch, kill_step=None, kill_call=1):
    """run_rpr (1 calibration + 2 joint steps of 4 episodes) on the tiny model and fake sandboxes,
    journaled in ``journal``; the sampler of step ``kill_step`` dies at generate call ``kill_call``.
    Returns (history or None when killed, actor, critic, the sandboxes opened)."""
    from minirsi.engine import rollout
    from minirsi.engine.rollout import make_rollout_fn
    from minirsi.engine.sampler import HFSampler
    from test_rollout import Sandboxes, Verdict, cfg as rollout_cfg, tasks

    def verify(sandbox, task):  # P by task (the random model writes no command): rewards that differ
        passed = {"t0": 2, "t1": 1, "t2": 0}[task.task_id]
        return Verdict(passed == 2, passed, 2, {})

    opened = Sandboxes()
    monkeypatch.setattr(rollout, "open_sandbox", opened)  # what rollout._default_open calls
    monkeypatch.setattr(rollout, "verify", verify)
    actor = copy.deepcopy(model).train()
    critic = build_critic(actor)
    samplers = []

    def factory(m, t):  # one sampler per collection that is not replayed from the journal
        samplers.append(_KillAt(HFSampler(m, t), kill_call if len(samplers) == kill_step else 0))
        return samplers[-1]

    rollout_fn = make_rollout_fn(tok, rollout_cfg(max_turns=2, concurrency=2), factory, progress=False,
                                 journal=journal)
    cfg = RPRConfig(episodes_per_step=4, steps=2, critic_calibration_updates=1, minibatch_size=4, ppo_epochs=1,
                    lr_actor=1e-3, reward="fdr", seed=0)
    try:
        history = run_rpr(actor, critic, tok, tasks(3), cfg, rollout_fn, {"toy": 2.0})
    except _Killed:
        history = None
    return history, actor, critic, opened.opened


def _untimed(history) -> str:
    return json.dumps([{k: v for k, v in h.items() if k not in ("rollout_s", "update_s")} for h in history])


def test_a_killed_rpr_phase_resumes_from_its_journal_and_ends_on_the_same_weights(model, tok, tmp_path, monkeypatch):
    clean, actor_a, critic_a, _ = _journaled_phase(model, tok, tmp_path / "a", monkeypatch)
    killed, *_ = _journaled_phase(model, tok, tmp_path / "b", monkeypatch, kill_step=2, kill_call=1)
    assert killed is None and (tmp_path / "b" / "rollout-2.jsonl").read_text() == ""  # died before any episode
    resumed, actor_b, critic_b, opened = _journaled_phase(model, tok, tmp_path / "b", monkeypatch)
    assert len(opened) == 4  # steps 0 and 1 replayed from the journal: only step 2 is collected
    assert _untimed(resumed) == _untimed(clean)  # the same updates, metric for metric
    assert fingerprint(actor_a) != fingerprint(model)  # the joint steps moved the actor
    assert fingerprint(actor_b) == fingerprint(actor_a) and fingerprint(critic_b) == fingerprint(critic_a)


def test_a_step_killed_midway_collects_only_its_unfinished_episodes(model, tok, tmp_path, monkeypatch):
    from minirsi.core.episode import read_jsonl

    killed, *_ = _journaled_phase(model, tok, tmp_path, monkeypatch, kill_step=1, kill_call=3)
    step1 = tmp_path / "rollout-1.jsonl"
    before = step1.read_text()
    finished = {e.meta["index"] for e in read_jsonl(step1)}
    assert killed is None and 0 < len(finished) < 4  # 2 live episodes at a time: some had finished
    resumed, _, _, opened = _journaled_phase(model, tok, tmp_path, monkeypatch)
    assert len(resumed) == 3
    assert len(opened) == (4 - len(finished)) + 4  # the rest of step 1, then step 2
    assert step1.read_text().startswith(before)  # the finished episodes are kept as they were
    assert sorted(e.meta["index"] for e in read_jsonl(step1)) == [0, 1, 2, 3]  # none lost, none twice


# ----------------------------------------------------------------------------- end to end


def _action_logprob(world, task, command) -> float:
    """log pi(the action ```bash <command>``` <|im_end|> | the task's prompt)."""
    from minirsi.core import actions

    prompt = actions.render_prompt_ids(world.tok, task.instruction)
    ids = torch.tensor([prompt + actions.render_action_ids(world.tok, actions.action_text([command]))])
    with torch.no_grad():
        lp, _ = policy_forward(world.actor, ids, torch.ones_like(ids), 1.0)
    return float(lp[0, len(prompt):].sum())


def _log_odds_right_word(world, task) -> float:
    """log pi(echo world > /app/out.txt) - log pi(echo hello > /app/out.txt): the one choice
    that decides the task (the actor may also move mass to other paths, such as an `ls` first,
    which this ratio ignores)."""
    return (_action_logprob(world, task, "echo world > /app/out.txt")
            - _action_logprob(world, task, "echo hello > /app/out.txt"))


def _success_rate(world, task, n: int = 64, seed: int = 777) -> float:
    """Success of ``n`` episodes of ``task`` sampled with one fixed seed (not a training seed)."""
    episodes = world.rollout_fn(world.actor, [task] * n, seed)
    return sum(e.success for e in episodes) / n


@pytest.mark.slow
def test_rpr_phase_raises_mean_reward_on_a_task_with_some_success(tmp_path):
    """The toy world of test_rsr.py (real sandboxes, real verifier) on its one task "write
    `world` into /app/out.txt", where the actor succeeds about half of the time: one calibration
    step, then 4 joint PPO steps with SPR. Success over 64 episodes drawn with one fixed seed
    before and after the phase rises by >= 0.2, the right action became more likely than the
    wrong one (the low-variance view of the same progress: 0.26 -> 3.1-7.2 nats over seeds 0-3),
    and every diagnostic is logged.

    The success gate is sized, not a best-of-n: both measurements use the same sampler seed, so
    an actor that did not move (no learning) draws the very same 64 episodes and gains exactly 0.
    Measured with this phase at RPRConfig seeds 0-3: 0.53 -> 0.91-0.97; with lr_actor=1e-12
    (no learning) 0.53 -> 0.53 at every seed, where the former gate (the best of the 4 joint
    steps' mean rewards > the calibration step's + 0.05) passed at seeds 0, 1 and 2 (0.82 -> 1.21,
    0.93 -> 1.14, 0.92 -> 1.14): chance cleared it."""
    from test_rsr import toy_world  # pytest puts tests/ on sys.path (rootdir-relative imports)

    world = toy_world(tmp_path / "tasks")
    task = next(t for t in world.tasks if t.task_id == "write-world")
    critic = build_critic(world.actor)
    a0, c0 = fingerprint(world.actor), fingerprint(critic)
    odds0 = _log_odds_right_word(world, task)
    before = _success_rate(world, task)
    # 16 episodes a step and lr 1e-3: a step moves the decisive token (the word) by ~10% of
    # probability; one task, so that credit does not need the tiny model to read the instruction.
    cfg = RPRConfig(episodes_per_step=16, steps=4, critic_calibration_updates=1, lr_actor=1e-3,
                    lr_critic=1e-3, ppo_epochs=1, minibatch_size=8, reward="spr", seed=0)
    logged = []
    history = run_rpr(world.actor, critic, world.tok, [task], cfg, world.rollout_fn,
                      scales={"files": 2.0}, log_fn=logged.append)
    assert logged == history and [h["phase"] for h in history] == ["calibrate"] + ["joint"] * 4
    start = history[0]
    assert 0.2 < start["binary_reward"] < 0.9
    after = _success_rate(world, task)
    assert after >= before + 0.2, (before, after, [h["binary_reward"] for h in history])
    assert _log_odds_right_word(world, task) > odds0 + 1.5
    assert fingerprint(world.actor) != a0 and fingerprint(critic) != c0
    for h in history:
        policy = ("approx_kl", "clip_frac", "entropy", "grad_norm_actor") if h["phase"] == "joint" else ()
        for key in ("dense_reward", "binary_reward", "turns", "explained_variance", "logprob_gap", "rollout_s",
                    "update_s", "grad_norm_critic", "value_loss", *policy):
            assert key in h, key
        assert 0 <= h["logprob_gap"] < 1e-3  # the HF sampler and the trainer run the same weights
    # calibration: the critic's step alone, the actor not even read (no policy metrics)
    assert start["actor_updates"] == 0 and "approx_kl" not in start and "entropy" not in start


def test_one_optimizer_step_clips_what_the_optimizer_trains_then_steps():
    """core.optim: AdamW over the parameters that train (frozen ones left out, as a LoRA actor's
    base), and the step RSR, the warm-up and RPR share: the returned norm is the one before
    clipping, the step is taken on the clipped gradient."""
    from minirsi.core.optim import adamw, clipped_step

    frozen, trained = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    frozen.requires_grad_(False)
    opt = adamw([*frozen.parameters(), *trained.parameters()], lr=0.1)
    assert [p for g in opt.param_groups for p in g["params"]] == list(trained.parameters())
    assert opt.defaults["weight_decay"] == 0.0
    (100.0 * trained(frozen(torch.ones(1, 3)))).sum().backward()
    grads = [p.grad.clone() for p in trained.parameters()]
    full = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    before = [p.detach().clone() for p in trained.parameters()]
    assert clipped_step(opt, max_grad_norm=1.0) == pytest.approx(full)
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in trained.parameters()]))
    assert float(clipped) == pytest.approx(1.0, rel=1e-4)  # clipped in place before the step
    assert all(not torch.equal(a, p) for a, p in zip(before, trained.parameters()))

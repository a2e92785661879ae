"""TB-GAE (minirsi/core/tb_gae.py) against its per-token loop and every property of docs/method.md s.4."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minirsi.core.tb_gae import IMPLEMENTATIONS, tb_gae, tb_gae_chunked, tb_gae_plain, tb_gae_reference
import minirsi.core.tb_gae_fast as tb_gae_fast_module
from minirsi.core.tb_gae_fast import tb_gae_fast

SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

FORMS = {"reference": tb_gae_reference, "plain": tb_gae_plain, "fast": tb_gae}  # tb_gae: fast
each_form = pytest.mark.parametrize("form", list(FORMS.values()), ids=list(FORMS))
each_impl = pytest.mark.parametrize("impl", IMPLEMENTATIONS)


# --------------------------------------------------------------------------- helpers


def standard_gae(rewards: list[float], values: list[float], gamma: float, lam: float):
    """Textbook GAE(gamma, lambda) over one trajectory that terminates after its last step."""
    T = len(rewards)
    advantages = [0.0] * T
    next_value, next_advantage = 0.0, 0.0  # terminal: nothing follows the last step
    for t in reversed(range(T)):
        delta = rewards[t] + gamma * next_value - values[t]
        advantages[t] = delta + gamma * lam * next_advantage
        next_value, next_advantage = values[t], advantages[t]
    return advantages


def tolerance(rewards: torch.Tensor, values: torch.Tensor) -> float:
    """Absolute tolerance: exact-ish in float64, ~eps32 of the magnitudes in float32."""
    eps = 1e-12 if values.dtype == torch.float64 else 2e-6
    scale = 1.0 + float(rewards.abs().sum(dim=1).max()) + float(values.abs().max())
    return eps * scale * 4


def boundaries_between(turns: list[int], mask: list, t: int, n: int) -> int:
    """Number of turn changes along the action positions t .. n (both actions)."""
    acts = [u for u in range(t, n + 1) if mask[u]]
    return sum(turns[a] != turns[b] for a, b in zip(acts, acts[1:]))


@st.composite
def batches(draw, max_B: int = 4, max_T: int = 40, arbitrary_obs_ids: bool | None = None):
    """Random (rewards, values, action_mask, turn_ids, gamma_turn, lam_turn).

    Random action masks and right padding, turns of random lengths (ids with random gaps,
    sometimes huge), observation ids either consistent (non-decreasing) or arbitrary, rewards
    either on every action token or only on the last one, both float dtypes, three mask dtypes.
    """
    B = draw(st.integers(1, max_B))
    T = draw(st.integers(1, max_T))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    p_act = draw(st.sampled_from([0.2, 0.5, 0.8, 1.0]))
    p_turn = draw(st.sampled_from([0.0, 0.1, 0.3, 1.0]))
    mask = torch.rand(B, T, generator=gen) < p_act
    for b in range(B):  # right padding of random length
        pad = int(torch.randint(0, T + 1, (1,), generator=gen))
        if pad:
            mask[b, T - pad:] = False
    step = draw(st.sampled_from([1, 3, 10**9]))
    turn_ids = torch.cumsum(torch.rand(B, T, generator=gen) < p_turn, dim=1) * step
    turn_ids = turn_ids + int(torch.randint(0, 5, (1,), generator=gen))
    if arbitrary_obs_ids is None:
        arbitrary_obs_ids = draw(st.booleans())
    if arbitrary_obs_ids:  # ids off-action carry no meaning
        turn_ids = torch.where(mask, turn_ids, torch.randint(0, 50, (B, T), generator=gen))
    values = torch.randn(B, T, generator=gen, dtype=torch.float64) * draw(
        st.sampled_from([0.0, 1.0, 10.0]))
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64) * mask
    if draw(st.booleans()):  # docs/method.md: one reward, on the last action token
        keep = torch.zeros_like(mask)
        for b in range(B):
            acts = mask[b].nonzero()
            if len(acts):
                keep[b, acts[-1]] = True
        rewards = rewards * keep
    unit = st.sampled_from([0.0, 1.0]) | st.floats(0.0, 1.0)
    g, l = draw(unit), draw(unit)
    mask_dtype = draw(st.sampled_from([torch.bool, torch.float32, torch.long]))
    return (rewards.to(dtype), values.to(dtype), mask.to(mask_dtype), turn_ids, g, l)


# --------------------------------------------------------------------------- vectorised == loop


@each_impl
@SETTINGS
@given(batches())
def test_matches_per_token_loop(impl, batch):
    rewards, values, action_mask, turn_ids, g, l = batch
    A, R = tb_gae(rewards, values, action_mask, turn_ids, g, l, impl=impl)
    A_ref, R_ref = tb_gae_reference(rewards, values, action_mask, turn_ids, g, l)
    assert A.dtype == values.dtype and R.dtype == values.dtype
    tol = tolerance(rewards, values)
    torch.testing.assert_close(A, A_ref, atol=tol, rtol=0)
    torch.testing.assert_close(R, R_ref, atol=tol, rtol=0)
    off = ~action_mask.bool()
    assert (A[off] == 0).all() and (R[off] == 0).all()


@SETTINGS
@given(batches())
def test_fast_equals_plain(batch):
    # The CPU-tuned path (minirsi/core/tb_gae_fast.py) against the plain form it optimises: both
    # sum in float64 and cast once, in different orders.
    rewards, values, action_mask, turn_ids, g, l = batch
    A, R = tb_gae_fast(rewards, values, action_mask, turn_ids, g, l)
    A_plain, R_plain = tb_gae_plain(rewards, values, action_mask, turn_ids, g, l)
    tol = tolerance(rewards, values)
    torch.testing.assert_close(A, A_plain, atol=tol, rtol=0)
    torch.testing.assert_close(R, R_plain, atol=tol, rtol=0)


def training_batch(seed: int, B: int, T: int, turns: int, token_gae: bool = False):
    """A batch as training hands it to tb_gae: ``collate``'s layout (prompt, then per turn
    action tokens and observation tokens, padding repeating the last turn id), float32 action
    mask, values and rewards, the episode's reward on its last action token; with
    ``token_gae`` the turn ids are rpr.py's per-token ablation (every action its own step)."""
    gen = torch.Generator().manual_seed(seed)
    action_mask = torch.zeros(B, T)
    turn_ids = torch.zeros(B, T, dtype=torch.long)
    rewards = torch.zeros(B, T)
    for b in range(B):
        t = int(torch.randint(1, 30, (1,), generator=gen))  # prompt
        end = T - int(torch.randint(0, T // 4 + 1, (1,), generator=gen))  # right padding
        for k in range(int(torch.randint(1, turns + 1, (1,), generator=gen))):
            n_act, n_obs = (int(x) for x in torch.randint(1, T // turns + 2, (2,), generator=gen))
            if t + n_act > end:
                break
            action_mask[b, t:t + n_act] = 1.0
            turn_ids[b, t:] = k
            t += n_act
            rewards[b].zero_()
            rewards[b, t - 1] = float(torch.randn(1, generator=gen))
            turn_ids[b, t:] = k + 1 if t + n_obs < end else k  # the observation opens turn k + 1
            t += n_obs
    if token_gae:
        turn_ids = action_mask.long().cumsum(1)
    values = torch.randn(B, T, generator=gen)
    return rewards, values, action_mask, turn_ids


@pytest.mark.parametrize("token_gae", [False, True])
def test_default_is_the_fast_path_and_equals_plain_on_training_batches(token_gae):
    # What training calls (tb_gae, impl="fast" by default) is tb_gae_fast bit for bit, and the
    # plain form agrees with it to float32 rounding on batches shaped like training's.
    for seed in range(20):
        batch = training_batch(seed, B=4, T=300 + 97 * seed, turns=12, token_gae=token_gae)
        A, R = tb_gae(*batch, 0.99, 0.95)
        A_fast, R_fast = tb_gae_fast(*batch, 0.99, 0.95)
        assert torch.equal(A, A_fast) and torch.equal(R, R_fast)
        A_plain, R_plain = tb_gae(*batch, 0.99, 0.95, impl="plain")
        tol = tolerance(batch[0], batch[1])
        torch.testing.assert_close(A_plain, A, atol=tol, rtol=0)
        torch.testing.assert_close(R_plain, R, atol=tol, rtol=0)


@SETTINGS
@given(batches(), st.sampled_from([1, 2, 3, 4, 8]))
def test_chunked_prefix_path_matches_per_token_loop(batch, chunk):
    # With few turns per token tb_gae reads prefix sums chunk by chunk and expands each
    # turn's value over whole chunks (_chunk_prefix, _prefix_at, _nth, _expand_blocks); a
    # tiny chunk length makes the hypothesis batches take that path.
    rewards, values, action_mask, turn_ids, g, l = batch
    with mock.patch.object(tb_gae_fast_module, "_CHUNK", chunk):
        A, R = tb_gae(rewards, values, action_mask, turn_ids, g, l)
    A_ref, R_ref = tb_gae_reference(rewards, values, action_mask, turn_ids, g, l)
    tol = tolerance(rewards, values)
    torch.testing.assert_close(A, A_ref, atol=tol, rtol=0)
    torch.testing.assert_close(R, R_ref, atol=tol, rtol=0)


@pytest.mark.parametrize("layout", ["collate", "reward_mid_turn", "interleaved", "sparse_ids"])
def test_chunked_and_full_cumsum_paths_agree_on_long_rows(layout):
    # T = 5,000 with ~12 turns a row takes the chunked path (K + 1 <= T / 64); a huge chunk
    # length forces the full-cumsum path on the same batch. Layouts: collate's (rewards on
    # the last action of the episode), rewards inside turns (the per-token prefix-sum
    # fallback), actions interleaved with other tokens inside a turn, and sparse turn ids.
    gen = torch.Generator().manual_seed(7)
    B, T = 3, 5_000
    turn_ids = torch.cumsum(torch.rand(B, T, generator=gen) < 0.0025, dim=1)
    if layout == "interleaved":
        mask = torch.rand(B, T, generator=gen) < 0.5
    else:  # the first ~half of every turn acts, the rest observes
        pos = torch.arange(T).expand(B, T)
        start = torch.zeros(B, T, dtype=torch.long)
        start[:, 1:] = torch.where(turn_ids[:, 1:] != turn_ids[:, :-1], pos[:, 1:], 0)
        start = torch.cummax(start, dim=1).values
        mask = (pos - start) % 400 < 200
    mask[0, 4_000:] = False  # right padding on one row
    if layout == "sparse_ids":
        turn_ids = turn_ids * 10**9
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    rewards = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        acts = mask[b].nonzero()[:, 0]
        rewards[b, acts[-1]] = 1.5
        if layout == "reward_mid_turn":
            rewards[b, acts[len(acts) // 3]] = -0.5
    A, R = tb_gae(rewards, values, mask.float(), turn_ids, 0.99, 0.9)
    with mock.patch.object(tb_gae_fast_module, "_CHUNK", 10**9):
        A_full, R_full = tb_gae(rewards, values, mask.float(), turn_ids, 0.99, 0.9)
    torch.testing.assert_close(A, A_full, atol=1e-9, rtol=0)
    torch.testing.assert_close(R, R_full, atol=1e-9, rtol=0)
    A_ref, _ = tb_gae_reference(rewards[:, :1500], values[:, :1500], mask[:, :1500],
                                turn_ids[:, :1500], 0.99, 0.9)
    A_pre, _ = tb_gae(rewards[:, :1500], values[:, :1500], mask[:, :1500].float(),
                      turn_ids[:, :1500], 0.99, 0.9)
    torch.testing.assert_close(A_pre, A_ref, atol=1e-9, rtol=0)


@SETTINGS
@given(st.data())
def test_chunk_layout_says_sorted_exactly_when_rows_do_not_decrease(data):
    # _chunk_layout tests order by each chunk's max and sum, then token by token only inside
    # the chunks holding several ids and across chunk edges: a single decrease anywhere
    # (inside a chunk of equal ids, at a chunk edge, in the tail) must be caught.
    chunk = data.draw(st.sampled_from([1, 2, 3, 4, 8]))
    B, T = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 40))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    steps = (torch.rand(B, T, generator=gen) < data.draw(st.sampled_from([0.05, 0.3, 1.0])))
    key = torch.cumsum(steps.long(), dim=1) + data.draw(st.integers(-5, 5))
    if data.draw(st.booleans()):  # one decrease by d at a random position
        b, t = data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, T - 1))
        key[b, t] -= data.draw(st.integers(1, 3))
    with mock.patch.object(tb_gae_fast_module, "_CHUNK", chunk):
        layout = tb_gae_fast_module._chunk_layout(key)
    ordered = bool((key[:, 1:] >= key[:, :-1]).all())
    if T < chunk:
        assert layout is None
        return
    assert (layout is not None) == ordered
    if layout is not None:
        nC = T // chunk
        blocks = key[:, :nC * chunk].view(B, nC, chunk)
        assert torch.equal(layout.top, blocks.amax(-1))
        assert torch.equal(layout.keys, key.gather(1, layout.idx))
        # Every chunk left out of idx holds a single id (the broadcast writes it whole).
        listed = torch.zeros(B, T, dtype=torch.bool).scatter_(1, layout.idx, True)
        for b in range(B):
            for c in range(nC):
                if not listed[b, c * chunk]:
                    assert (blocks[b, c] == blocks[b, c, 0]).all()


def test_collate_layout_takes_the_broadcast_path():
    # Rows with different numbers of turns (the shorter rows end in empty blocks) and the
    # reward on each row's last action: every reward sits on a turn's last action, so tb_gae
    # must write returns by the chunk broadcast (_expand_blocks), not the prefix-sum fallback.
    gen = torch.Generator().manual_seed(3)
    B, T = 3, 4_096
    mask = torch.zeros(B, T, dtype=torch.bool)
    turn_ids = torch.zeros(B, T, dtype=torch.long)
    rewards = torch.zeros(B, T)
    for b, turns in enumerate([5, 9, 14]):
        t = 100
        for k in range(turns):
            n_act, n_obs = (int(x) for x in torch.randint(10, 120, (2,), generator=gen))
            mask[b, t:t + n_act] = True
            turn_ids[b, t:t + n_act] = k
            t += n_act
            turn_ids[b, t:] = k + 1 if k + 1 < turns else k  # observation opens the next turn
            t += n_obs
        rewards[b, mask[b].nonzero()[-1]] = 1.0 + b
    values = torch.randn(B, T, generator=gen)
    with mock.patch.object(tb_gae_fast_module, "_expand_blocks", wraps=tb_gae_fast_module._expand_blocks) as spy:
        A, R = tb_gae(rewards, values, mask, turn_ids, 0.99, 0.95)
    assert spy.call_count == 1
    with mock.patch.object(tb_gae_fast_module, "_CHUNK", 10**9):  # the gather path
        A_full, R_full = tb_gae(rewards, values, mask, turn_ids, 0.99, 0.95)
    torch.testing.assert_close(A, A_full, atol=1e-6, rtol=0)
    torch.testing.assert_close(R, R_full, atol=1e-6, rtol=0)


def test_long_float32_sequence_keeps_precision():
    # 20,000 tokens, rewards on every action token, values of size 100: a global float32
    # cumsum of the deltas would lose ~1e-2 here; the telescoped form stays near eps32.
    gen = torch.Generator().manual_seed(0)
    B, T = 2, 20_000
    mask = torch.rand(B, T, generator=gen) < 0.5
    turn_ids = torch.cumsum(torch.rand(B, T, generator=gen) < 0.01, dim=1)
    values = torch.randn(B, T, generator=gen) * 100
    rewards = torch.rand(B, T, generator=gen) * mask
    # The float64 plain form as the exact answer (equal to the loop: the tests above).
    A64, _ = tb_gae_plain(rewards.double(), values.double(), mask, turn_ids, 0.99, 0.95)
    A32, _ = tb_gae(rewards, values, mask, turn_ids, 0.99, 0.95)
    err = (A32.double() - A64.double()).abs().max().item()
    assert err < 1e-7 * float(rewards.abs().sum(dim=1).max() + values.abs().max()) * 4


@each_impl
def test_mask_dtypes_agree(impl):
    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(3, 30, generator=gen) < 0.5
    turn_ids = torch.cumsum(torch.rand(3, 30, generator=gen) < 0.2, dim=1)
    values = torch.randn(3, 30, generator=gen, dtype=torch.float64)
    rewards = torch.randn(3, 30, generator=gen, dtype=torch.float64) * mask
    outs = [tb_gae(rewards, values, mask.to(d), turn_ids, 0.9, 0.8, impl=impl) for d in
            (torch.bool, torch.float32, torch.int32, torch.long)]
    for A, R in outs[1:]:
        assert torch.equal(A, outs[0][0]) and torch.equal(R, outs[0][1])


# --------------------------------------------------------------------------- hand-worked cases


@each_form
def test_hand_worked_two_turns_with_observation(form):
    # tokens:   a0   a1   o    a2      (a = action, o = observation)
    # turn:     0    0    1    1
    # r:        0    0    0    1
    # V:        0.5  0.4  9.0  0.2     (V on the observation is never used)
    # g = 0.9, l = 0.5
    # a2 (last):        delta = 1 - 0.2 = 0.8;                     A = 0.8
    # a1 -> a2 (turn 0 -> 1, boundary):
    #                   delta = 0 + 0.9*0.2 - 0.4 = -0.22;         A = -0.22 + 0.45*0.8 = 0.14
    # a0 -> a1 (same turn): delta = 0 + 0.4 - 0.5 = -0.1;           A = -0.1 + 0.14 = 0.04
    # returns = A + V: a0 0.54, a1 0.54, a2 1.0; the observation gets 0.
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    V = torch.tensor([[0.5, 0.4, 9.0, 0.2]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1]])
    turn = torch.tensor([[0, 0, 1, 1]])
    A, R = form(r, V, mask, turn, 0.9, 0.5)
    torch.testing.assert_close(A, torch.tensor([[0.04, 0.14, 0.0, 0.8]], dtype=torch.float64))
    torch.testing.assert_close(R, torch.tensor([[0.54, 0.54, 0.0, 1.0]], dtype=torch.float64))


@each_form
def test_hand_worked_three_turns_padding_and_prompt(form):
    # tokens:  p    a0   o    a1   o    a2   a2   pad
    # turn:    0    0    1    1    2    2    2    2
    # r:       0    0    0    0    0    0    2    0       V = 1 on every action token
    # g = 1, l = 0.5
    # a2' (last):  delta = 2 - 1 = 1;                        A = 1
    # a2 -> a2':   same turn: delta = 0 + 1 - 1 = 0;          A = 0 + 1 = 1
    # a1 -> a2:    boundary: delta = 0 + 1*1 - 1 = 0;         A = 0 + 0.5*1 = 0.5
    # a0 -> a1:    boundary: delta = 0;                       A = 0.5*0.5 = 0.25
    r = torch.tensor([[0, 0, 0, 0, 0, 0, 2.0, 0]])
    V = torch.tensor([[7.0, 1, 7, 1, 7, 1, 1, 7]])
    mask = torch.tensor([[0, 1, 0, 1, 0, 1, 1, 0]], dtype=torch.bool)
    turn = torch.tensor([[0, 0, 1, 1, 2, 2, 2, 2]])
    A, R = form(r, V, mask, turn, 1.0, 0.5)
    torch.testing.assert_close(A, torch.tensor([[0, 0.25, 0, 0.5, 0, 1, 1, 0]]))
    torch.testing.assert_close(R, torch.tensor([[0, 1.25, 0, 1.5, 0, 2, 2, 0]]))


def _widen(kinds: str, r: list, V: list, turn: list, n_obs: int):
    """A hand-worked row with each observation token ("o" in ``kinds``; "p" prompt, "a" action,
    "_" padding) repeated ``n_obs`` times: (r, V, mask, turn, action positions) as tensors.
    Observation tokens change nothing at action positions, so the expected numbers stay those
    of the short row; with n_obs = 100 the row is long enough (T >= 64 (K + 1)) for tb_gae_fast
    to take its chunked path and write returns by the per-chunk broadcast (_expand_blocks)."""
    rows: dict[str, list] = {"r": [], "V": [], "m": [], "turn": []}
    acts = []
    for kind, r_t, V_t, turn_t in zip(kinds, r, V, turn):
        for _ in range(n_obs if kind == "o" else 1):
            if kind == "a":
                acts.append(len(rows["r"]))
            rows["r"].append(r_t)
            rows["V"].append(V_t)
            rows["m"].append(kind == "a")
            rows["turn"].append(turn_t)
    t = lambda x, **kw: torch.tensor([x], **kw)  # noqa: E731
    return (t(rows["r"], dtype=torch.float64), t(rows["V"], dtype=torch.float64), t(rows["m"]),
            t(rows["turn"]), torch.tensor(acts))


@each_form
@pytest.mark.parametrize("n_obs", [1, 100])
def test_hand_worked_two_turns_lam_not_one_half(form, n_obs):
    # lam_turn = 0.5 hides a swap of l and (1 - l) (they are equal there); l = 0.8 does not.
    # tokens:   a0   a1   o    a2          r: 0 0 0 1,   V: 0.5 0.4 9.0 0.2
    # turn:     0    0    1    1           g = 0.9, l = 0.8, g l = 0.72
    # a2 (last):         delta = 1 - 0.2 = 0.8;                       A = 0.8
    # a1 -> a2 (boundary): delta = 0 + 0.9*0.2 - 0.4 = -0.22;         A = -0.22 + 0.72*0.8 = 0.356
    # a0 -> a1 (same turn): delta = 0 + 0.4 - 0.5 = -0.1;             A = -0.1 + 0.356 = 0.256
    # returns = A + V: a0 0.756, a1 0.756, a2 1.0.
    # The closed form agrees: X_0 = g (1 - l) V_a2 + g l (Rtot_1 + X_1) = 0.9*0.2*0.2 + 0.72*1
    # = 0.036 + 0.72 = 0.756 (with l in place of 1 - l: 0.144 + 0.72 = 0.864).
    r, V, mask, turn, acts = _widen("aaoa", [0, 0, 0, 1.0], [0.5, 0.4, 9.0, 0.2], [0, 0, 1, 1], n_obs)
    A, R = form(r, V, mask, turn, 0.9, 0.8)
    want_A = torch.tensor([0.256, 0.356, 0.8], dtype=torch.float64)
    want_R = torch.tensor([0.756, 0.756, 1.0], dtype=torch.float64)
    torch.testing.assert_close(A[0, acts], want_A, atol=1e-12, rtol=0)
    torch.testing.assert_close(R[0, acts], want_R, atol=1e-12, rtol=0)
    assert (A[~mask.bool()] == 0).all() and (R[~mask.bool()] == 0).all()


@each_form
@pytest.mark.parametrize("n_obs", [1, 100])
def test_hand_worked_three_turns_two_rewards_gamma_and_lam_below_one(form, n_obs):
    # tokens:  p    a0   o    a1   a1'  o    a2   pad
    # turn:    0    0    1    1    1    2    2    2
    # r:       0    0.5  0    0    0    0    2    0      (a reward on turn 0's last action too)
    # V:       7    1.0  7    0.6  0.3  7    0.8  7      (V off the actions is never read)
    # g = 0.95, l = 0.8, g l = 0.76
    # a2 (last):           delta = 2 - 0.8 = 1.2;                        A = 1.2      R = 2.0
    # a1' -> a2 (boundary): delta = 0 + 0.95*0.8 - 0.3 = 0.46;            A = 0.46 + 0.76*1.2
    #                                                                      = 1.372    R = 1.672
    # a1 -> a1' (same turn): delta = 0 + 0.3 - 0.6 = -0.3;               A = -0.3 + 1.372
    #                                                                      = 1.072    R = 1.672
    # a0 -> a1 (boundary):  delta = 0.5 + 0.95*0.6 - 1.0 = 0.07;          A = 0.07 + 0.76*1.072
    #                                                                      = 0.88472  R = 1.88472
    # Closed form: X_1 = g (1 - l) V_a2 + g l (Rtot_2 + X_2) = 0.95*0.2*0.8 + 0.76*2 = 1.672;
    # X_0 = 0.95*0.2*0.6 + 0.76*(0 + 1.672) = 1.38472, R_a0 = Rtot_0 + X_0 = 1.88472.
    r, V, mask, turn, acts = _widen("paoaaoa_", [0, 0.5, 0, 0, 0, 0, 2.0, 0],
                                    [7.0, 1.0, 7, 0.6, 0.3, 7, 0.8, 7], [0, 0, 1, 1, 1, 2, 2, 2], n_obs)
    A, R = form(r, V, mask, turn, 0.95, 0.8)
    want_A = torch.tensor([0.88472, 1.072, 1.372, 1.2], dtype=torch.float64)
    want_R = torch.tensor([1.88472, 1.672, 1.672, 2.0], dtype=torch.float64)
    torch.testing.assert_close(A[0, acts], want_A, atol=1e-12, rtol=0)
    torch.testing.assert_close(R[0, acts], want_R, atol=1e-12, rtol=0)
    assert (A[~mask.bool()] == 0).all() and (R[~mask.bool()] == 0).all()


@each_form
def test_row_without_actions_is_zero(form):
    r = torch.zeros(2, 3)
    V = torch.ones(2, 3)
    mask = torch.tensor([[0, 0, 0], [0, 1, 0]])
    A, R = form(r, V, mask, torch.zeros(2, 3, dtype=torch.long), 0.9, 0.9)
    # Row 1: the single action has no successor: A = 0 - 1 = -1, R = 0.
    assert A.tolist() == [[0, 0, 0], [0, -1, 0]] and R.tolist() == [[0, 0, 0], [0, 0, 0]]


# --------------------------------------------------------------------------- docs/method.md properties


@each_form
@SETTINGS
@given(
    n_boundaries=st.integers(0, 6),
    tokens_per_turn=st.lists(st.integers(1, 5), min_size=7, max_size=7),
    obs_per_turn=st.lists(st.integers(0, 6), min_size=7, max_size=7),
    g=st.floats(0.0, 1.0), l=st.floats(0.0, 1.0), seed=st.integers(0, 1000),
)
def test_attenuation_is_gl_pow_B(form, n_boundaries, tokens_per_turn, obs_per_turn, g, l, seed):
    # A reward on the last action moves A at an action B boundaries earlier by (g l)^B,
    # whatever the observation lengths and the number of tokens per turn.
    mask, turn = [], []
    for k in range(n_boundaries + 1):
        if k:
            mask += [0] * obs_per_turn[k]
            turn += [k] * obs_per_turn[k]
        mask += [1] * tokens_per_turn[k]
        turn += [k] * tokens_per_turn[k]
    T = len(mask)
    gen = torch.Generator().manual_seed(seed)
    V = torch.randn(1, T, generator=gen, dtype=torch.float64)
    mask_t, turn_t = torch.tensor([mask]), torch.tensor([turn])
    r0 = torch.zeros(1, T, dtype=torch.float64)
    r1 = r0.clone()
    r1[0, T - 1] = 1.0
    A0, _ = form(r0, V, mask_t, turn_t, g, l)
    A1, _ = form(r1, V, mask_t, turn_t, g, l)
    credit = (A1 - A0)[0]
    for t in range(T):
        if mask[t]:
            expected = (g * l) ** (n_boundaries - turn[t])
            assert credit[t].item() == pytest.approx(expected, abs=1e-12)


@each_impl
@SETTINGS
@given(batches(max_B=3, max_T=25, arbitrary_obs_ids=False), st.data())
def test_inserting_observation_tokens_changes_nothing(impl, batch, data):
    rewards, values, action_mask, turn_ids, g, l = batch
    A, R = tb_gae(rewards, values, action_mask, turn_ids, g, l, impl=impl)
    B, T = values.shape
    rows, action_pos = [], []
    for b in range(B):
        # Insert k_t observation tokens before position t (and at the end, t = T), each with a
        # random value, reward 0 and the turn id of its left neighbour (keeps ids ordered).
        counts = data.draw(st.lists(st.integers(0, 3), min_size=T + 1, max_size=T + 1))
        row = {"r": [], "V": [], "m": [], "turn": []}
        pos = []
        for t in range(T + 1):
            for _ in range(counts[t]):
                left = int(turn_ids[b, t - 1]) if t else int(turn_ids[b, 0])
                row["r"].append(0.0)
                row["V"].append(data.draw(st.floats(-5, 5)))
                row["m"].append(0)
                row["turn"].append(left)
            if t < T:
                pos.append(len(row["r"]))
                row["r"].append(float(rewards[b, t]))
                row["V"].append(float(values[b, t]))
                row["m"].append(int(bool(action_mask[b, t])))
                row["turn"].append(int(turn_ids[b, t]))
        rows.append(row)
        action_pos.append(pos)
    T2 = max(len(row["r"]) for row in rows)
    for row in rows:  # right-pad with non-action tokens
        n = T2 - len(row["r"])
        row["r"] += [0.0] * n
        row["V"] += [0.0] * n
        row["m"] += [0] * n
        row["turn"] += [row["turn"][-1]] * n
    A2, R2 = tb_gae(
        torch.tensor([row["r"] for row in rows], dtype=values.dtype),
        torch.tensor([row["V"] for row in rows], dtype=values.dtype),
        torch.tensor([row["m"] for row in rows]),
        torch.tensor([row["turn"] for row in rows]), g, l, impl=impl)
    tol = tolerance(rewards, values) + (1e-12 if values.dtype == torch.float64 else 1e-5)
    for b in range(B):
        idx = torch.tensor(action_pos[b])
        torch.testing.assert_close(A2[b, idx], A[b], atol=tol, rtol=0)
        torch.testing.assert_close(R2[b, idx], R[b], atol=tol, rtol=0)


@each_form
@SETTINGS
@given(
    rewards=st.lists(st.floats(-3, 3), min_size=1, max_size=40), data=st.data(),
    gamma=st.floats(0.0, 1.0), lam=st.floats(0.0, 1.0),
)
def test_each_token_its_own_turn_is_standard_gae(form, rewards, data, gamma, lam):
    T = len(rewards)
    values = data.draw(st.lists(st.floats(-3, 3), min_size=T, max_size=T))
    A, R = form(torch.tensor([rewards], dtype=torch.float64),
                torch.tensor([values], dtype=torch.float64),
                torch.ones(1, T, dtype=torch.bool), torch.arange(T)[None], gamma, lam)
    expected = standard_gae(rewards, values, gamma, lam)
    assert A[0].tolist() == pytest.approx(expected, abs=1e-9)
    assert R[0].tolist() == pytest.approx([a + v for a, v in zip(expected, values)], abs=1e-9)


@SETTINGS
@given(batches(), st.integers(1, 45))
def test_chunked_equals_whole(batch, chunk_size):
    rewards, values, action_mask, turn_ids, g, l = batch
    A, R = tb_gae(rewards, values, action_mask, turn_ids, g, l)
    A_c, R_c = tb_gae_chunked(rewards, values, action_mask, turn_ids, g, l, chunk_size)
    # The carry enters as R_n - V_n: one extra rounding of V_n's size in float32.
    tol = tolerance(rewards, values) * 4
    torch.testing.assert_close(A_c, A, atol=tol, rtol=0)
    torch.testing.assert_close(R_c, R, atol=tol, rtol=0)


@SETTINGS
@given(batches(arbitrary_obs_ids=False), st.integers(1, 45))
def test_reset_at_chunk_edge_errs_by_exactly_gl_pow_B_times_A_n(batch, chunk_size):
    rewards, values, action_mask, turn_ids, g, l = batch
    rewards, values = rewards.double(), values.double()
    A, _ = tb_gae_reference(rewards, values, action_mask, turn_ids, g, l)
    A_reset, R_reset = tb_gae_chunked(rewards, values, action_mask, turn_ids, g, l,
                                      chunk_size, reset_at_chunk_edge=True)
    torch.testing.assert_close(R_reset - A_reset, values * action_mask.bool(), rtol=0,
                               atol=1e-9)
    B, T = values.shape
    mask, turns = action_mask.bool().tolist(), turn_ids.tolist()
    max_abs_A = A.abs().max().item()
    for b in range(B):
        for t in range(T):
            if not mask[b][t]:
                continue
            # Chunks are cut from the right end: [T - cs, T), [T - 2 cs, T - cs), ...
            edge = T - ((T - 1 - t) // chunk_size) * chunk_size  # first position after t's chunk
            n = next((u for u in range(edge, T) if mask[b][u]), None)
            err = (A[b, t] - A_reset[b, t]).item()
            if n is None:
                assert err == pytest.approx(0.0, abs=1e-9)
                continue
            n_boundaries = boundaries_between(turns[b], mask[b], t, n)
            expected = (g * l) ** n_boundaries * A[b, n].item()
            assert err == pytest.approx(expected, abs=1e-9)
            assert abs(err) <= (g * l) ** n_boundaries * max_abs_A + 1e-9  # the stated bound


# --------------------------------------------------------------------------- bad input


@each_form
def test_reward_on_observation_raises_with_position(form):
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 1]])
    with pytest.raises(ValueError, match=r"rewards\[0, 2\].*non-action.*last action token"):
        form(r, torch.zeros(1, 4), mask, torch.zeros(1, 4, dtype=torch.long), 1.0, 1.0)


@each_impl
def test_decreasing_turn_ids_on_actions_raise(impl):
    mask = torch.tensor([[1, 0, 1, 1]])
    turn = torch.tensor([[2, 0, 3, 1]])
    with pytest.raises(ValueError, match=r"row 0: position 3 has turn 1 after an action of turn 3"):
        tb_gae(torch.zeros(1, 4), torch.zeros(1, 4), mask, turn, 1.0, 1.0, impl=impl)


@each_form
def test_arbitrary_observation_ids_are_ignored(form):
    mask = torch.tensor([[1, 0, 1, 0, 1]])
    ordered = torch.tensor([[0, 0, 1, 1, 1]])
    scrambled = torch.tensor([[0, 99, 1, -7, 1]])
    r = torch.tensor([[0, 0, 0, 0, 1.0]])
    V = torch.tensor([[0.3, 5, 0.2, 5, 0.1]])
    assert all(torch.equal(x, y) for x, y in zip(form(r, V, mask, ordered, 0.9, 0.9),
                                                 form(r, V, mask, scrambled, 0.9, 0.9)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(gamma_turn=1.5), "gamma_turn=1.5"),
    (dict(lam_turn=-0.1), "lam_turn=-0.1"),
    (dict(lam_turn=math.nan), "lam_turn=nan"),
])
@each_form
def test_bad_scalars_raise(form, kwargs, match):
    args = dict(gamma_turn=1.0, lam_turn=1.0) | kwargs
    with pytest.raises(ValueError, match=match):
        form(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2),
             torch.zeros(1, 2, dtype=torch.long), **args)


@each_form
def test_bad_shapes_and_dtypes_raise(form):
    z = torch.zeros(1, 3)
    turn = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="action_mask has shape"):
        form(z, z, torch.ones(1, 2), turn, 1, 1)
    with pytest.raises(ValueError, match="turn_ids.long"):
        form(z, z, torch.ones(1, 3), z, 1, 1)
    with pytest.raises(ValueError, match="float32 or float64"):
        form(z, turn, torch.ones(1, 3), turn, 1, 1)
    with pytest.raises(ValueError, match="chunk_size=0"):
        tb_gae_chunked(z, z, torch.ones(1, 3), turn, 1, 1, chunk_size=0)
    with pytest.raises(ValueError, match="impl='fused'; use one of"):
        tb_gae(z, z, torch.ones(1, 3), turn, 1, 1, impl="fused")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(4, 500, generator=gen) < 0.5
    turn_ids = torch.cumsum(torch.rand(4, 500, generator=gen) < 0.05, dim=1)
    values = torch.randn(4, 500, generator=gen)
    rewards = torch.randn(4, 500, generator=gen) * mask
    A, R = tb_gae(rewards, values, mask, turn_ids, 0.99, 0.95)
    A_cuda, R_cuda = tb_gae(*(x.cuda() for x in (rewards, values, mask, turn_ids)), 0.99, 0.95)
    torch.testing.assert_close(A_cuda.cpu(), A, atol=1e-4, rtol=0)
    torch.testing.assert_close(R_cuda.cpu(), R, atol=1e-4, rtol=0)

"""TB-GAE: Turn-Boundary Skip-Observation GAE (METHOD.md section 4).

What it computes
----------------
For every action position t of a sequence let n be the next action position of the same
sequence (observation, prompt and padding tokens are skipped). With g = gamma_turn and
l = lam_turn::

    if no n:                  delta_t = r_t - V_t              A_t = delta_t
    elif turn(n) == turn(t):  delta_t = r_t + V_n - V_t        A_t = delta_t + A_n
    else (turn boundary):     delta_t = r_t + g V_n - V_t      A_t = delta_t + g l A_n
    returns                   R_t = A_t + V_t

Advantages and returns are 0 at non-action positions. Inside a turn nothing is discounted
(gamma = lambda = 1); crossing B turn boundaries multiplies credit by (g l)^B, however many
observation tokens or tokens per turn lie in between.

=============  ===========  ==================================================================
Symbol         Shape        Description
=============  ===========  ==================================================================
rewards        (B, T)       r_t; nonzero only on action tokens (METHOD.md: on the last one)
values         (B, T)       V_t, the critic's per-token baseline (float32 or float64)
action_mask    (B, T)       1 on action (generated) tokens, 0 elsewhere; bool, int or float
                            (any nonzero entry counts as an action token)
turn_ids       (B, T)       turn(t), integer; see the choices below
gamma_turn     scalar       g in [0, 1], the discount per turn boundary
lam_turn       scalar       l in [0, 1], the trace decay per turn boundary
advantages     (B, T)       A_t (0 off-action), dtype of values
returns        (B, T)       R_t = A_t + V_t (0 off-action), the critic's regression target
=============  ===========  ==================================================================

How it is vectorised (no per-token loop)
----------------------------------------
Inside a turn gamma = lambda = 1, so A_t is the plain sum of the deltas of the turn's actions
from t on, plus the discounted trace from the next turn; in that sum the values cancel in
pairs (+V_n of one delta, -V_n of the next), leaving::

    A_t = sum_{u >= t, u in turn k} r_u  -  V_t  +  X_k                            (1)
    X_k = g V_s + g l A_s   (s: first action of the next turn of the row; X_k = 0 if none)
        = g (1 - l) V_s + g l (Rtot_{k+1} + X_{k+1})     (A_s from (1) at t = s)   (2)

where Rtot_{k+1} is the sum of rewards in turn k+1, and R_t = A_t + V_t drops the -V_t.
(1) needs one cumulative sum of the rewards along the row; (2) is a linear recurrence over
turns only (~100 per sequence, not 262,144 tokens), solved by a log-depth (Hillis-Steele)
scan in float64. The positions where each turn starts, ends and first acts come from
``searchsorted`` on sorted keys, so nothing is ragged. Because the values V cancel inside a
turn instead of being summed, the only
accumulated rounding is in the reward prefix sums: |error| <~ eps(dtype) * sum_t |r_t| per
row, i.e. float32 results agree with a float64 loop to ~1e-7 of the row's reward mass, not
to ~1e-7 of a sum over 262,144 deltas. Everything is computed under ``torch.no_grad``: the
outputs are targets.

Cost: about 13 passes over the (B, T) grid (two prefix sums: actions and rewards; one gather;
the rest elementwise, validation included), plus O(K log K) work for K turns per row.
``bench/tb_gae.py`` measures it against one flip + cumsum + flip. The regime it is built for
is turns of many tokens; with every token its own turn (K = T) it stays vectorised and exact
but the turn-level binary searches and the O(K log K) scan dominate (~0.3 s of CPU for
8 x 262,144 tokens on one core, only ~5x faster than the per-token loop).

Choices METHOD.md leaves open (ours)
------------------------------------
- A nonzero reward on a non-action position raises ``ValueError`` naming the (row, position):
  it would otherwise be silently lost. Fix: put rewards on the last action token
  (``minirsi.episode.collate`` does).
- Turn ids: only their order matters (they need not start at 0 or be contiguous), and they
  must not decrease along the action positions of a row. Fast path: turn_ids non-decreasing
  along the whole row, observations and padding included (what ``collate`` produces:
  padding repeats the last turn). Otherwise the ids at non-action positions are ignored
  (replaced by the turn of the latest action, a running max) at the cost of a cummax pass;
  a decrease between two action positions raises ``ValueError`` naming the position.
- A row with no action token gets zeros. NaN/inf in values or rewards propagate (not checked).

Chunked form
------------
``tb_gae_chunked`` walks the sequence right to left in chunks of ``chunk_size`` tokens,
carrying (V_n, A_n, turn(n)) of the first action to the right of the chunk: it equals the
whole-sequence result. With ``reset_at_chunk_edge=True`` the trace is cut at each chunk edge
(A_n is carried as 0; the TD error still bootstraps from V_n, as at a truncated rollout).
Then, for an action t whose chunk is followed (across its right edge) by the action n, exactly

    A_t(reset) = A_t - (g l)^B A_n,     R_t(reset) = R_t - (g l)^B A_n,

with A the whole-sequence advantages and B the number of turn boundaries crossed going from t
to n along the action positions (the edge itself counts when turn(n) differs from the turn
of the chunk's last action; B = 0 when the edge splits a turn). Hence
|error| <= (g l)^B * max |A|; actions with no action after their chunk are exact.
tests/test_tb_gae.py proves the equality.

Call::

    from minirsi.tb_gae import tb_gae
    advantages, returns = tb_gae(rewards, values, action_mask, turn_ids,
                                 gamma_turn=1.0, lam_turn=0.95)

``tb_gae_reference`` is the plain per-token Python loop: the test and benchmark reference,
slow by design; never use it for training.
"""

from __future__ import annotations

import torch

__all__ = ["tb_gae", "tb_gae_chunked", "tb_gae_reference"]


def _check_inputs(rewards, values, action_mask, turn_ids, gamma_turn, lam_turn) -> None:
    for name, x in (("rewards", rewards), ("values", values), ("action_mask", action_mask),
                    ("turn_ids", turn_ids)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"tb_gae: {name} must be a (B, T) tensor, got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        if x.shape != values.shape:
            raise ValueError(f"tb_gae: {name} has shape {tuple(x.shape)}, values has "
                             f"{tuple(values.shape)}; every input must be (B, T)")
    if not values.is_floating_point():
        raise ValueError(f"tb_gae: values must be float32 or float64, got {values.dtype}")
    if turn_ids.is_floating_point() or turn_ids.dtype == torch.bool:
        raise ValueError(f"tb_gae: turn_ids must be an integer tensor, got {turn_ids.dtype}; "
                         "fix: pass turn_ids.long()")
    for name, x in (("gamma_turn", gamma_turn), ("lam_turn", lam_turn)):
        if not 0.0 <= float(x) <= 1.0:  # also rejects NaN
            raise ValueError(f"tb_gae: {name}={x} must lie in [0, 1]")


def _any(mask: torch.Tensor) -> bool:
    """``mask.any()`` for a bool tensor; ``bool.any()`` is ~20x slower than a uint8 max on CPU."""
    return mask.numel() > 0 and bool(mask.view(torch.uint8).max())


def _first_true(mask: torch.Tensor) -> tuple[int, int]:
    row, pos = mask.nonzero()[0].tolist()
    return row, pos


def _turn_blocks(
    turn_ids: torch.Tensor,  # (B, T)
    m: torch.Tensor,  # (B, T) bool action mask
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sorted per-row block keys and a block index for every token.

    A block is a maximal run of equal keys; all action tokens of one turn lie in one block,
    action tokens of different turns in different blocks. Returns ``key`` (B, T), sorted along
    T, ``block`` (B, T) int64, the block index in [0, K), and ``offset``: block k holds the
    tokens whose key is k + offset.
    """
    key = turn_ids
    if _any(key[:, 1:] < key[:, :-1]):
        # Slow path: ids off-action are arbitrary. Key = turn of the latest action so far.
        low = torch.iinfo(key.dtype).min
        key = torch.cummax(key.masked_fill(~m, low), dim=1).values
        bad = m & (key != turn_ids)
        if _any(bad):
            b, t = _first_true(bad)
            raise ValueError(
                f"tb_gae: turn_ids decrease along the action positions of row {b}: position "
                f"{t} has turn {int(turn_ids[b, t])} after an action of turn {int(key[b, t])}; "
                "fix: number turns in order (minirsi.episode.collate does)")
    lo = int(key[:, 0].min())
    hi = int(key[:, -1].max())
    if hi - lo <= 4 * key.shape[1]:
        # Turn ids are small integers: use them as block indices (gaps are empty blocks).
        block = key - lo if lo != 0 else key
        return key, block.long(), lo
    # Sparse ids (e.g. 0, 10**9): dense rank of the runs instead.
    block = torch.zeros_like(key, dtype=torch.long)
    block[:, 1:] = torch.cumsum(key[:, 1:] != key[:, :-1], dim=1)
    return block, block, 0


def _reverse_linear_scan(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Z_j = a_j + c_j Z_{j+1} along dim 1, Z_K = 0; log-depth (Hillis-Steele) doubling."""
    a, c = a.clone(), c.clone()
    K = a.shape[1]
    d = 1
    while d < K:
        # Now (a_j, c_j) composes elements j .. j+d-1; after this step, j .. j+2d-1. The
        # right-hand sides are evaluated into temporaries before the slices are written.
        a[:, :-d] += c[:, :-d] * a[:, d:]
        c[:, :-d] = c[:, :-d] * c[:, d:]
        d *= 2
    return a


@torch.no_grad()
def tb_gae(
    rewards: torch.Tensor,  # (B, T)
    values: torch.Tensor,  # (B, T)
    action_mask: torch.Tensor,  # (B, T)
    turn_ids: torch.Tensor,  # (B, T)
    gamma_turn: float,
    lam_turn: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TB-GAE advantages and returns, both (B, T) in values' dtype; see the module docstring."""
    _check_inputs(rewards, values, action_mask, turn_ids, gamma_turn, lam_turn)
    g, l = float(gamma_turn), float(lam_turn)
    dtype = values.dtype
    B, T = values.shape
    if B == 0 or T == 0:
        return torch.zeros_like(values), torch.zeros_like(values)
    m = action_mask.bool()  # (B, T) any nonzero entry marks an action token
    mf = m.view(torch.uint8).to(dtype)  # (B, T) 0/1 (the uint8 route is the fast cast)
    r = rewards.to(dtype)  # (B, T)

    # Rewards must sit on action tokens: never silently dropped.
    bad = r.bool() > m  # (B, T) nonzero reward where no action
    if _any(bad):
        b, t = _first_true(bad)
        raise ValueError(
            f"tb_gae: rewards[{b}, {t}] = {float(r[b, t])} sits on a non-action position; "
            "fix: put rewards on the last action token (minirsi.episode.collate does)")

    key, block, offset = _turn_blocks(turn_ids, m)  # (B, T), (B, T) int64 in [0, K), int
    K = int(block[:, -1].max()) + 1

    acts = torch.cumsum(m, dim=1, dtype=torch.int32)  # (B, T) actions so far (inclusive)
    # F_excl[t] = sum_{u < t} r_u, written straight into place (no shifted copy).
    F_excl = torch.empty_like(r)  # (B, T)
    F_excl[:, 0] = 0
    torch.cumsum(r[:, :-1], dim=1, out=F_excl[:, 1:])

    # Block k is the token range [bounds_k, bounds_{k+1}): one search for keys k .. K.
    j = torch.arange(offset, offset + K + 1, device=key.device, dtype=key.dtype)
    bounds = torch.searchsorted(key, j.expand(B, K + 1).contiguous())  # (B, K + 1) int64
    # Actions and rewards before each bound: the inclusive prefix at bound - 1 (0 at 0).
    last = (bounds - 1).clamp_(min=0)
    inside = bounds > 0
    acts_before = acts.gather(1, last) * inside  # (B, K + 1) int32
    F_before = (F_excl.gather(1, last).double() + r.gather(1, last).double()) * inside
    has_action = acts_before[:, 1:] > acts_before[:, :-1]  # (B, K) bool
    first = torch.searchsorted(acts, acts_before[:, :-1] + 1).clamp_(max=T - 1)  # (B, K)
    V_first = values.gather(1, first).double()  # (B, K) V of the turn's first action
    F_end = F_before[:, 1:]  # (B, K) rewards before each block's end
    R_tot = F_end - F_before[:, :-1]  # (B, K) Rtot_k

    # Equation (2), as Z_k = a_k + c_k Z_{k+1}: the continuation seen just before block k.
    a = torch.where(has_action, g * (1 - l) * V_first + g * l * R_tot, 0.0)
    c = torch.full_like(a, g * l).masked_fill_(~has_action, 1.0)  # empty blocks: identity
    Z = _reverse_linear_scan(a, c)
    X = torch.zeros_like(Z)
    X[:, :-1] = Z[:, 1:]  # X_k = Z_{k+1}

    # Equation (1): R_t = (F_end_k - F_excl_t) + X_k = Q_k - F_excl_t, on action tokens.
    Q = (F_end + X).to(dtype)  # (B, K)
    returns = Q.gather(1, block)  # (B, T)
    returns.sub_(F_excl).mul_(mf)
    advantages = torch.addcmul(returns, values, mf, value=-1.0)  # R_t - V_t, 0 off-action
    return advantages, returns


@torch.no_grad()
def tb_gae_chunked(
    rewards: torch.Tensor,  # (B, T)
    values: torch.Tensor,  # (B, T)
    action_mask: torch.Tensor,  # (B, T)
    turn_ids: torch.Tensor,  # (B, T)
    gamma_turn: float,
    lam_turn: float,
    chunk_size: int,
    reset_at_chunk_edge: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TB-GAE computed right to left in chunks of ``chunk_size`` tokens.

    Chunks are cut from the right end: [T - chunk_size, T), [T - 2 chunk_size, T - chunk_size),
    ..., the leftmost one possibly shorter.
    Across each chunk edge it carries, per row, the first action to the right: (V_n, A_n,
    turn(n)). The carry enters the chunk as one extra action token appended at its right end,
    with value V_n, turn turn(n) and reward R_n = A_n + V_n, whose own advantage is then
    R_n - V_n = A_n: the chunk's last action sees exactly what the whole sequence shows it.
    With ``reset_at_chunk_edge`` the extra token's reward is V_n, so its advantage is 0: the
    trace is cut at the edge while delta still bootstraps from V_n (module docstring: error
    (g l)^B A_n for a token B turn boundaries before the edge).
    """
    _check_inputs(rewards, values, action_mask, turn_ids, gamma_turn, lam_turn)
    if int(chunk_size) < 1:
        raise ValueError(f"tb_gae_chunked: chunk_size={chunk_size} must be >= 1")
    B, T = values.shape
    dtype = values.dtype
    m = action_mask if action_mask.dtype == torch.bool else action_mask != 0
    r = rewards.to(dtype)
    advantages = torch.zeros_like(values)
    returns = torch.zeros_like(values)
    has_n = torch.zeros(B, dtype=torch.bool, device=values.device)  # (B,)
    V_n = torch.zeros(B, dtype=dtype, device=values.device)  # (B,)
    A_n = torch.zeros(B, dtype=dtype, device=values.device)  # (B,)
    turn_n = torch.zeros(B, dtype=turn_ids.dtype, device=values.device)  # (B,)
    end = T
    while end > 0:
        start = max(0, end - int(chunk_size))
        m_c = m[:, start:end]
        tid_c = turn_ids[:, start:end]
        carry_r = V_n if reset_at_chunk_edge else A_n + V_n
        A_c, R_c = tb_gae(
            torch.cat([r[:, start:end], (carry_r * has_n)[:, None]], dim=1),
            torch.cat([values[:, start:end], V_n[:, None]], dim=1),
            torch.cat([m_c, has_n[:, None]], dim=1),
            # Rows without a carry get the chunk's last id: the key stays sorted.
            torch.cat([tid_c, torch.where(has_n, turn_n, tid_c[:, -1])[:, None]], dim=1),
            gamma_turn, lam_turn)
        advantages[:, start:end] = A_c[:, :-1]
        returns[:, start:end] = R_c[:, :-1]
        # New carry: the first action of this chunk, where the chunk has one.
        here = m_c.any(dim=1)  # (B,)
        idx = m_c.to(torch.uint8).argmax(dim=1, keepdim=True)  # (B, 1) first action
        V_n = torch.where(here, values[:, start:end].gather(1, idx)[:, 0], V_n)
        A_n = torch.where(here, A_c.gather(1, idx)[:, 0], A_n)
        turn_n = torch.where(here, tid_c.gather(1, idx)[:, 0], turn_n)
        has_n = has_n | here
        end = start
    return advantages, returns


def tb_gae_reference(
    rewards: torch.Tensor,  # (B, T)
    values: torch.Tensor,  # (B, T)
    action_mask: torch.Tensor,  # (B, T)
    turn_ids: torch.Tensor,  # (B, T)
    gamma_turn: float,
    lam_turn: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slow per-token loop: METHOD.md section 4 line by line, in Python floats (float64).

    Test and benchmark reference only (tests/test_tb_gae.py, bench/tb_gae.py).
    """
    g, l = float(gamma_turn), float(lam_turn)
    r, V = rewards.tolist(), values.tolist()
    mask, turn = action_mask.tolist(), turn_ids.tolist()
    B, T = values.shape
    A = [[0.0] * T for _ in range(B)]
    R = [[0.0] * T for _ in range(B)]
    for b in range(B):
        n = None  # the next action position to the right
        for t in reversed(range(T)):
            if not mask[b][t]:
                if r[b][t] != 0:
                    raise ValueError(f"tb_gae_reference: reward at non-action ({b}, {t})")
                continue
            if n is None:
                delta = r[b][t] - V[b][t]
                A[b][t] = delta
            elif turn[b][n] == turn[b][t]:
                delta = r[b][t] + V[b][n] - V[b][t]
                A[b][t] = delta + A[b][n]
            else:
                delta = r[b][t] + g * V[b][n] - V[b][t]
                A[b][t] = delta + g * l * A[b][n]
            R[b][t] = A[b][t] + V[b][t]
            n = t
    out = dict(dtype=values.dtype, device=values.device)
    return torch.tensor(A, **out).reshape(B, T), torch.tensor(R, **out).reshape(B, T)

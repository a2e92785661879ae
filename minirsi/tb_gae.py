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
(1) needs the rewards summed per turn; (2) is a linear recurrence over turns only (~100 per
sequence, not 262,144 tokens), solved by a log-depth (Hillis-Steele) scan in float64.
Everything is computed under ``torch.no_grad``: the outputs are targets.

What touches every token (the rest is O(K) per row for K turns):

- one pass each for the 0/1 action mask and the nonzero rewards, and two vectorised
  reductions over chunks of 64 turn ids (max and sum: a chunk whose sum is 64 times its max
  holds one id) that check that the ids do not decrease: only the few chunks holding a turn
  edge are compared token by token (``_chunk_layout``; exact for ids above -2**57, the ends
  of every row are checked against that bound, ids inside it are not). ``searchsorted`` then
  finds where each turn starts and ends;
- sums of the action mask over chunks of 64 tokens: a vectorised reduction, several times
  cheaper than a ``cumsum`` (a serial scan). The number of actions before a turn edge is the
  sum of the chunks before it plus a 64-token gather (``_prefix_at``); the first and last
  action of every turn are found the same way (``_nth``);
- when every nonzero reward sits on the last action token of its turn (``collate``'s layout;
  checked by clearing those tokens' flags and finding no nonzero reward left, which also
  proves that none sits off-action), Rtot_k is that one reward and all actions of turn k
  share R_t = Rtot_k + X_k: one broadcast multiply writes it over whole chunks, and only the
  chunks that hold a turn edge are filled token by token (``_expand_blocks``); then one
  ``addcmul`` gives A_t = R_t - V_t. Otherwise (rewards inside a turn) a float64 prefix sum F
  gives Rtot_k and R_t = (F_end_k + X_k) - F_excl_t;
- with more turns than chunks (every token its own turn, K ~ T) the chunk tricks do not pay
  and full ``cumsum`` passes replace them: still vectorised and exact, but the turn-level
  searches and the O(K log K) scan dominate (~0.3 s of CPU for 8 x 262,144 tokens on one
  core, only ~5x faster than the per-token loop).

Rounding: the values V cancel inside a turn instead of being summed, and reward sums are
taken in float64, so float32 results agree with a float64 loop to ~1e-7 of the row's reward
mass plus values, not to ~1e-7 of a sum over 262,144 deltas. ``bench/tb_gae.py`` measures
the whole against one flip + cumsum + flip over the same grid.

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

from typing import NamedTuple

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


class _Chunks(NamedTuple):
    """Where the block keys of the rows change, at the resolution of ``_CHUNK``-token chunks."""

    top: torch.Tensor
    """(B, nC) the largest (= last) key of each full chunk."""
    idx: torch.Tensor
    """(B, F * C) positions of the chunks that hold more than one key, and of the tail after
    the last full chunk: these are filled token by token (past T: T - 1 repeated). Rows with
    fewer than F such chunks repeat some other chunk (harmless: token by token is exact)."""
    keys: torch.Tensor
    """(B, F * C) the keys at ``idx``."""


def _chunk_layout(key: torch.Tensor) -> _Chunks | None:
    """The chunk layout of ``key`` (B, T), or None if a row decreases somewhere (or T < C).

    Each full chunk gets its max and its sum (two vectorised reductions, cheaper than one
    token-by-token comparison); a chunk whose sum is C times its max holds one key only (no key
    exceeds the max). The other chunks and the tail are gathered and checked token by token,
    and every chunk's first key against the max of the chunk before it. Exact for ids in
    (-2**57, 2**56], where 64 of them cannot overflow int64: maxima above the range return
    None (the caller then compares neighbours), and ``_turn_blocks`` checks the ends of each
    row against the lower bound; an id below it inside a row is not seen.
    """
    B, T = key.shape
    C = _CHUNK
    nC = T // C
    T0 = nC * C
    if nC == 0:
        return None
    blocks = key[:, :T0].view(B, nC, C)
    top = blocks.amax(-1)  # (B, nC)
    if int(top.max()) > _ID_RANGE[1]:
        return None  # C * top could overflow
    rough = blocks.sum(-1) != top * C  # (B, nC) holds some key below the max
    if T0 < T:  # the tail chunk (index nC) is always done token by token
        rough = torch.cat([rough, rough.new_ones(B, 1)], dim=1)
        top = torch.cat([top, key[:, -1:]], dim=1)  # its max if it is sorted (checked below)
    F = int(rough.view(torch.uint8).sum(1, dtype=torch.int32).max())
    if F == 0:
        fix = top.new_zeros(B, 0)
    else:  # descending: a row's first pick is a rough chunk whenever it has one
        fix = torch.topk(rough.view(torch.uint8), F, dim=1).indices  # (B, F)
    idx = _chunk_index(fix, T)  # (B, F * C)
    keys = key.gather(1, idx)
    part = keys.view(B, F, C)
    if _any(part[..., 1:] < part[..., :-1]):
        return None
    # Across chunk edges: first key of chunk j >= max of chunk j - 1 (a single-key chunk's
    # first key is its max).
    first = top.scatter(1, fix, part[..., 0])
    if _any(first[:, 1:] < top[:, :-1]):
        return None
    return _Chunks(top[:, :nC], idx, keys)


_ID_RANGE = (-(1 << 57), 1 << 56)
"""Turn ids in this range let ``_chunk_layout`` test chunks by sum without int64 overflow."""


def _turn_blocks(
    turn_ids: torch.Tensor,  # (B, T)
    mf: torch.Tensor,  # (B, T) 0/1 action mask
) -> tuple[torch.Tensor, int, _Chunks | None]:
    """Per-row block keys, sorted along T, the ``offset`` of block 0, and their chunk layout
    (None when T < ``_CHUNK``).

    A block is a maximal run of equal keys; all action tokens of one turn lie in one block,
    action tokens of different turns in different blocks. Block k holds the tokens whose key
    is k + offset (``key - offset`` is every token's block index in [0, K); empty blocks where
    ids skip values).
    """
    key = turn_ids
    lo, hi = int(key[:, 0].min()), int(key[:, -1].max())
    in_range = _ID_RANGE[0] < lo and hi <= _ID_RANGE[1]
    layout = _chunk_layout(key) if in_range else None
    if layout is None and _any(key[:, 1:] < key[:, :-1]):
        # Slow path: ids off-action are arbitrary. Key = turn of the latest action so far.
        low = torch.iinfo(key.dtype).min
        m = mf.bool()
        key = torch.cummax(key.masked_fill(~m, low), dim=1).values
        bad = m & (key != turn_ids)
        if _any(bad):
            b, t = _first_true(bad)
            raise ValueError(
                f"tb_gae: turn_ids decrease along the action positions of row {b}: position "
                f"{t} has turn {int(turn_ids[b, t])} after an action of turn {int(key[b, t])}; "
                "fix: number turns in order (minirsi.episode.collate does)")
        lo, hi = int(key[:, 0].min()), int(key[:, -1].max())
        in_range = _ID_RANGE[0] < lo and hi <= _ID_RANGE[1]
    if hi - lo > 4 * key.shape[1] or not in_range:
        # Sparse ids (e.g. 0, 10**9): dense rank of the runs instead.
        rank = torch.zeros_like(key, dtype=torch.long)
        rank[:, 1:] = torch.cumsum(key[:, 1:] != key[:, :-1], dim=1)
        key, lo, layout = rank, 0, None
    key = key.contiguous()  # sorted; small integers: block indices (gaps are empty blocks)
    if layout is None:
        layout = _chunk_layout(key)
    return key, lo, layout


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


_CHUNK = 64
"""Chunk length of the two-level prefix sums (``_chunk_prefix``, ``_prefix_at``)."""


def _chunk_prefix(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """Inclusive prefix sums over the chunks [j C, (j + 1) C) of each row (C = ``_CHUNK``; the
    last chunk may be shorter): (B, T) -> (B, ceil(T / C)) in ``acc``.

    Summing chunks is a vectorised reduction, several times cheaper than a full ``cumsum``
    (a serial scan); with ``_prefix_at`` it gives prefix sums at a few query positions.
    """
    B, T = x.shape
    T0 = T - T % _CHUNK
    # Chunk sums in the input's dtype (a 0/1 uint8 chunk sums to <= 64: no overflow, and no
    # converted copy of x); floats in their own precision.
    part = x.dtype if x.is_floating_point() or x.dtype == torch.uint8 else torch.int64
    sums = []
    if T0:  # a view, not a copy, when the rows are contiguous
        sums.append(x[:, :T0].reshape(B, T0 // _CHUNK, _CHUNK).sum(-1, dtype=part))
    if T0 < T:
        sums.append(x[:, T0:].sum(-1, keepdim=True, dtype=part))
    return torch.cumsum(torch.cat(sums, dim=1).to(acc), dim=1)


def _chunk_index(ci: torch.Tensor, T: int) -> torch.Tensor:
    """Flat positions (B, Q * C) of the ``_CHUNK`` tokens of chunk ``ci`` (B, Q) of each row;
    positions past the row's end repeat T - 1 (callers mask or order them out)."""
    j = torch.arange(_CHUNK, device=ci.device)
    return (ci.unsqueeze(-1) * _CHUNK + j).clamp_(max=T - 1).view(ci.shape[0], -1)


def _before_chunk(incl: torch.Tensor, ci: torch.Tensor) -> torch.Tensor:
    """The sum of the chunks before chunk ``ci`` (B, Q), from the inclusive ``incl``."""
    return incl.gather(1, (ci - 1).clamp(min=0)).masked_fill_(ci == 0, 0)


def _prefix_at(x: torch.Tensor, incl: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """sum_{u < pos} x[b, u] of x (B, T) with its ``_chunk_prefix`` ``incl``, at int64 query
    positions ``pos`` (B, Q) in [0, T]: the sum of the chunks before the query's chunk plus a
    gather of that chunk's first ``pos mod C`` tokens. Returns (B, Q) in incl's dtype."""
    B, T = x.shape
    Q = pos.shape[1]
    ci = pos // _CHUNK  # (B, Q); pos == T may point one past the last chunk
    j = torch.arange(_CHUNK, device=pos.device)
    take = j < (pos - ci * _CHUNK).unsqueeze(-1)  # (B, Q, C) tokens of the chunk before pos
    idx = _chunk_index(ci.clamp(max=incl.shape[1] - 1), T)
    part = (x.gather(1, idx).view(B, Q, _CHUNK) * take).sum(-1)  # (B, Q)
    return _before_chunk(incl, ci) + part.to(incl.dtype)


def _nth(x: torch.Tensor, incl: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Position of the n-th nonzero (1-based) in each row of the 0/1 ``x`` (B, T), for int64
    counts n (B, Q) in [1, row total] (others give some position in [0, T)); ``incl`` is
    ``_chunk_prefix(x, torch.int64)``."""
    B, T = x.shape
    Q = n.shape[1]
    ci = torch.searchsorted(incl, n).clamp_(max=incl.shape[1] - 1)  # (B, Q) the chunk holding it
    need = n - _before_chunk(incl, ci)  # 1-based inside chunk ci
    # Positions past T repeat x[T - 1]; they come after the chunk's real tokens, so the count
    # of tokens before the n-th one is unaffected.
    local = torch.cumsum(x.gather(1, _chunk_index(ci, T)).view(B, Q, _CHUNK), dim=-1, dtype=torch.int64)
    off = (local < need.unsqueeze(-1)).sum(-1)  # (B, Q) tokens of chunk ci before the n-th
    return (ci * _CHUNK + off).clamp_(max=T - 1)


def _expand_blocks(
    Q: torch.Tensor,  # (B, K) one value per block
    chunks: _Chunks,  # the chunk layout of the sorted block keys
    offset: int,  # token t is in block key[t] - offset
    mf: torch.Tensor,  # (B, T) 0/1 action mask, Q's dtype
    out: torch.Tensor,  # (B, T) written
) -> torch.Tensor:
    """``out`` = ``Q[b, key[b, t] - offset] * mf[b, t]`` (B, T) without reading every token's key.

    A chunk of ``_CHUNK`` tokens lies inside one block unless a block edge falls inside it (at
    most K per row, against T / C chunks): every full chunk gets its block value (from its
    max key) by one broadcast multiply, then the chunks that hold an edge, and the tail past
    the last full chunk, are recomputed token by token.
    """
    B, T = mf.shape
    C = _CHUNK
    nC = chunks.top.shape[1]
    T0 = nC * C
    if nC:
        value = Q.gather(1, (chunks.top - offset).long())  # (B, nC)
        torch.mul(value.unsqueeze(-1), mf[:, :T0].view(B, nC, C), out=out[:, :T0].view(B, nC, C))
    if chunks.idx.shape[1]:
        idx = chunks.idx
        out.scatter_(1, idx, Q.gather(1, (chunks.keys - offset).long()) * mf.gather(1, idx))
    return out


def _action_float(action_mask: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (B, T) = 1 where ``action_mask`` is nonzero, else 0: one pass."""
    if action_mask.dtype == torch.bool:
        return out.copy_(action_mask.view(torch.uint8))  # the uint8 route is the fast cast
    return torch.ne(action_mask, 0, out=out)


@torch.no_grad()
def tb_gae(
    rewards: torch.Tensor,  # (B, T)
    values: torch.Tensor,  # (B, T)
    action_mask: torch.Tensor,  # (B, T)
    turn_ids: torch.Tensor,  # (B, T)
    gamma_turn: float,
    lam_turn: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TB-GAE advantages and returns, both (B, T) in values' dtype; see the module docstring.

    The two are contiguous halves of one (2, B, T) allocation: keeping either keeps both."""
    _check_inputs(rewards, values, action_mask, turn_ids, gamma_turn, lam_turn)
    g, l = float(gamma_turn), float(lam_turn)
    dtype = values.dtype
    B, T = values.shape
    if B == 0 or T == 0:
        return torch.zeros_like(values), torch.zeros_like(values)
    # Both outputs in one allocation: (advantages, returns). Large blocks freed together stay
    # in the C allocator's heap; two separate ones were often handed back to the OS and
    # faulted in again on the next call (~1.4 us a 4 KiB page on the machine we measured).
    buf = torch.empty((2, B, T), dtype=dtype, device=values.device)
    mf = _action_float(action_mask, buf[0])  # (B, T) 0/1: any nonzero entry marks an action
    r = rewards.to(dtype)  # (B, T)

    key, offset, chunks = _turn_blocks(turn_ids, mf)  # (B, T) sorted; block: key - offset
    K = int(key[:, -1].max()) - offset + 1
    # Block k is the token range [bounds_k, bounds_{k+1}): one search for keys k .. K.
    j = torch.arange(offset, offset + K + 1, device=key.device, dtype=key.dtype)
    bounds = torch.searchsorted(key, j.expand(B, K + 1).contiguous())  # (B, K + 1) int64

    # Per turn: actions before each bound, the first and last action. Few turns (the regime
    # TB-GAE is for): chunked prefix sums read at the bounds; else a full cumsum.
    chunked = K + 1 <= T // _CHUNK
    if chunked:
        acts_incl = _chunk_prefix(mf, torch.int64)  # (B, T / C)
        acts_before = _prefix_at(mf, acts_incl, bounds)  # (B, K + 1) int64
    else:
        acts = torch.cumsum(mf, dim=1, dtype=torch.int64)  # (B, T) actions so far
        acts_before = acts.gather(1, (bounds - 1).clamp(min=0)) * (bounds > 0)
    has_action = acts_before[:, 1:] > acts_before[:, :-1]  # (B, K) bool
    n = torch.cat([acts_before[:, :-1] + 1, acts_before[:, 1:]], dim=1)  # (B, 2K) 1-based counts
    pos = _nth(mf, acts_incl, n) if chunked else torch.searchsorted(acts, n).clamp_(max=T - 1)
    first, last = pos.split(K, dim=1)  # (B, K) the turn's first and last action (if any)

    # Rewards. When every nonzero reward sits on the last action of its turn (collate's
    # layout; counting proves it, and with it that none sits off-action), Rtot_k is that one
    # reward and every action of turn k has the same return R_t = Rtot_k + X_k. Otherwise a
    # full prefix sum F gives Rtot_k and R_t = (F_end_k + X_k) - F_excl_t.
    r_last = torch.where(has_action, r.gather(1, last), 0.0)  # (B, K)
    # Nonzero rewards left after clearing every turn's last action? (An empty turn's ``last``
    # is the last action of an earlier turn, also cleared; with no action before it, some
    # position that keeps its flag. Only a left flag can go wrong: then the exact path runs.)
    elsewhere = r.bool()  # (B, T)
    elsewhere.scatter_(1, last, elsewhere.gather(1, last) & (acts_before[:, 1:] == 0))
    rewards_on_last = not _any(elsewhere)
    if rewards_on_last:
        R_tot = r_last.double()  # (B, K)
    else:
        bad = r.bool() > mf.bool()  # (B, T) nonzero reward where no action
        if _any(bad):
            b, t = _first_true(bad)
            raise ValueError(
                f"tb_gae: rewards[{b}, {t}] = {float(r[b, t])} sits on a non-action position; "
                "fix: put rewards on the last action token (minirsi.episode.collate does)")
        F = torch.cumsum(r, dim=1, dtype=torch.float64)  # (B, T) rewards up to t
        F_before = F.gather(1, (bounds - 1).clamp(min=0)) * (bounds > 0)  # (B, K + 1)
        R_tot = F_before[:, 1:] - F_before[:, :-1]  # (B, K)

    V_first = values.gather(1, first).double()  # (B, K) V of the turn's first action
    # Equation (2), as Z_k = a_k + c_k Z_{k+1}: the continuation seen just before block k.
    a = torch.where(has_action, g * (1 - l) * V_first + g * l * R_tot, 0.0)
    c = torch.full_like(a, g * l).masked_fill_(~has_action, 1.0)  # empty blocks: identity
    Z = _reverse_linear_scan(a, c)
    X = torch.zeros_like(Z)
    X[:, :-1] = Z[:, 1:]  # X_k = Z_{k+1}

    # Equation (1) on action tokens (0 elsewhere).
    returns = buf[1]
    if rewards_on_last and chunks is not None:
        _expand_blocks((R_tot + X).to(dtype), chunks, offset, mf, out=returns)  # (B, T)
    else:
        block = (key - offset if offset else key).long()  # (B, T) block of every token
        if rewards_on_last:
            torch.gather((R_tot + X).to(dtype), 1, block, out=returns).mul_(mf)
        else:  # F_excl_t = F_t - r_t; in float64, then cast
            returns.copy_((F_before[:, 1:] + X).gather(1, block).sub_(F).add_(r)).mul_(mf)
    # A_t = R_t - V_t, 0 off-action; written over the mask (one fresh (B, T) buffer less).
    advantages = torch.addcmul(returns, values, mf, value=-1.0, out=mf)
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

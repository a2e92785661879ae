"""TB-GAE, CPU-tuned: the closed form of ``minirsi/core/tb_gae.py`` with fewer passes over tokens.

``minirsi.core.tb_gae.tb_gae`` runs this by default (``impl="fast"``), so training does; it checks
the inputs and then calls ``tb_gae_fast``. tests/test_tb_gae.py proves it equal to
``tb_gae_plain`` and to the loop ``tb_gae_reference``; bench/tb_gae.py holds it to its targets
(docs/tb_gae-performance.md: the measurements). Read ``minirsi/core/tb_gae.py`` first: the
equations, shapes and conventions are defined there, and this file computes the same thing.

The closed form (equations (1) and (2) of ``minirsi/core/tb_gae.py``)::

    R_t = sum_{u >= t, u in turn k} r_u + X_k                 A_t = R_t - V_t        (1)
    X_k = g (1 - l) V_s + g l (Rtot_{k+1} + X_{k+1})   (s: first action of turn k + 1) (2)

with g = gamma_turn, l = lam_turn, Rtot_k the rewards of turn k. (2) runs over turns only (~100
per sequence, not 262,144 tokens), solved by a log-depth (Hillis-Steele) scan in float64.
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
  ``addcmul`` gives A_t = R_t - V_t. Otherwise (rewards inside a turn) a float64 prefix sum
  of the rewards gives Rtot_k and R_t = (reward_cumsum at the turn's end + X_k) - (the same
  before t);
- with more turns than chunks (every token its own turn, K ~ T) the chunk tricks do not pay
  and full ``cumsum`` passes replace them: still vectorised and exact, but the turn-level
  searches and the O(K log K) scan dominate (docs/tb_gae-performance.md).

Rounding: the values V cancel inside a turn instead of being summed, and reward sums are
taken in float64, so float32 results agree with a float64 loop to ~1e-7 of the row's reward
mass plus values, not to ~1e-7 of a sum over 262,144 deltas.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["tb_gae_fast"]


def _any(mask: torch.Tensor) -> bool:
    """``mask.any()`` for a bool tensor, as a uint8 max: much faster than ``bool.any()`` on CPU."""
    return mask.numel() > 0 and bool(mask.view(torch.uint8).max())


def _first_true(mask: torch.Tensor) -> tuple[int, int]:
    row, pos = mask.nonzero()[0].tolist()
    return row, pos


class _Chunks(NamedTuple):
    """Where the block keys of the rows change, at the resolution of ``_CHUNK``-token chunks."""

    top: torch.Tensor
    """(B, nC) the largest (= last) key of each full chunk."""
    idx: torch.Tensor
    """(B, n_rough * C) positions of the chunks that hold more than one key, and of the tail
    after the last full chunk: these are filled token by token (past T: T - 1 repeated). Rows
    with fewer than n_rough such chunks repeat some other chunk (harmless: token by token is
    exact)."""
    keys: torch.Tensor
    """(B, n_rough * C) the keys at ``idx``."""


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
    n_rough = int(rough.view(torch.uint8).sum(1, dtype=torch.int32).max())
    if n_rough == 0:
        fix = top.new_zeros(B, 0)
    else:  # descending: a row's first pick is a rough chunk whenever it has one
        fix = torch.topk(rough.view(torch.uint8), n_rough, dim=1).indices  # (B, n_rough)
    idx = _chunk_index(fix, T)  # (B, n_rough * C)
    keys = key.gather(1, idx)
    part = keys.view(B, n_rough, C)
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
    action: torch.Tensor,  # (B, T) 0/1 action mask
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
        is_action = action.bool()
        key = torch.cummax(key.masked_fill(~is_action, low), dim=1).values
        bad = is_action & (key != turn_ids)
        if _any(bad):
            b, t = _first_true(bad)
            raise ValueError(
                f"tb_gae: turn_ids decrease along the action positions of row {b}: position "
                f"{t} has turn {int(turn_ids[b, t])} after an action of turn {int(key[b, t])}; "
                "fix: number turns in order (minirsi.core.episode.collate does)")
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
    sum_dtype = x.dtype if x.is_floating_point() or x.dtype == torch.uint8 else torch.int64
    sums = []
    if T0:  # a view, not a copy, when the rows are contiguous
        sums.append(x[:, :T0].reshape(B, T0 // _CHUNK, _CHUNK).sum(-1, dtype=sum_dtype))
    if T0 < T:
        sums.append(x[:, T0:].sum(-1, keepdim=True, dtype=sum_dtype))
    return torch.cumsum(torch.cat(sums, dim=1).to(acc), dim=1)


def _chunk_index(ci: torch.Tensor, T: int) -> torch.Tensor:
    """Flat positions (B, n_query * C) of the ``_CHUNK`` tokens of chunk ``ci`` (B, n_query) of
    each row; positions past the row's end repeat T - 1 (callers mask or order them out)."""
    j = torch.arange(_CHUNK, device=ci.device)
    return (ci.unsqueeze(-1) * _CHUNK + j).clamp_(max=T - 1).view(ci.shape[0], -1)


def _before_chunk(incl: torch.Tensor, ci: torch.Tensor) -> torch.Tensor:
    """The sum of the chunks before chunk ``ci`` (B, n_query), from the inclusive ``incl``."""
    return incl.gather(1, (ci - 1).clamp(min=0)).masked_fill_(ci == 0, 0)


def _prefix_at(x: torch.Tensor, incl: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """sum_{u < pos} x[b, u] of x (B, T) with its ``_chunk_prefix`` ``incl``, at int64 query
    positions ``pos`` (B, n_query) in [0, T]: the sum of the chunks before the query's chunk
    plus a gather of that chunk's first ``pos mod C`` tokens. Returns (B, n_query) in incl's
    dtype."""
    B, T = x.shape
    n_query = pos.shape[1]
    ci = pos // _CHUNK  # (B, n_query); pos == T may point one past the last chunk
    j = torch.arange(_CHUNK, device=pos.device)
    take = j < (pos - ci * _CHUNK).unsqueeze(-1)  # (B, n_query, C) tokens of the chunk before pos
    idx = _chunk_index(ci.clamp(max=incl.shape[1] - 1), T)
    part = (x.gather(1, idx).view(B, n_query, _CHUNK) * take).sum(-1)  # (B, n_query)
    return _before_chunk(incl, ci) + part.to(incl.dtype)


def _nth(x: torch.Tensor, incl: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Position of the ``counts``-th nonzero (1-based) in each row of the 0/1 ``x`` (B, T), for
    int64 counts (B, n_query) in [1, row total] (others give some position in [0, T));
    ``incl`` is ``_chunk_prefix(x, torch.int64)``."""
    B, T = x.shape
    n_query = counts.shape[1]
    ci = torch.searchsorted(incl, counts).clamp_(max=incl.shape[1] - 1)  # (B, n_query) its chunk
    need = counts - _before_chunk(incl, ci)  # 1-based inside chunk ci
    # Positions past T repeat x[T - 1]; they come after the chunk's real tokens, so the count
    # of tokens before the wanted one is unaffected.
    local = torch.cumsum(x.gather(1, _chunk_index(ci, T)).view(B, n_query, _CHUNK), dim=-1,
                         dtype=torch.int64)
    off = (local < need.unsqueeze(-1)).sum(-1)  # (B, n_query) tokens of chunk ci before it
    return (ci * _CHUNK + off).clamp_(max=T - 1)


def _expand_blocks(
    per_block: torch.Tensor,  # (B, K) one value per block
    chunks: _Chunks,  # the chunk layout of the sorted block keys
    offset: int,  # token t is in block key[t] - offset
    action: torch.Tensor,  # (B, T) 0/1 action mask, per_block's dtype
    out: torch.Tensor,  # (B, T) written
) -> torch.Tensor:
    """``out`` = ``per_block[b, key[b, t] - offset] * action[b, t]`` (B, T) without reading
    every token's key.

    A chunk of ``_CHUNK`` tokens lies inside one block unless a block edge falls inside it (at
    most K per row, against T / C chunks): every full chunk gets its block value (from its
    max key) by one broadcast multiply, then the chunks that hold an edge, and the tail past
    the last full chunk, are recomputed token by token.
    """
    B, T = action.shape
    C = _CHUNK
    nC = chunks.top.shape[1]
    T0 = nC * C
    if nC:
        value = per_block.gather(1, (chunks.top - offset).long())  # (B, nC)
        torch.mul(value.unsqueeze(-1), action[:, :T0].view(B, nC, C),
                  out=out[:, :T0].view(B, nC, C))
    if chunks.idx.shape[1]:
        idx = chunks.idx
        out.scatter_(1, idx, per_block.gather(1, (chunks.keys - offset).long()) * action.gather(1, idx))
    return out


def _action_float(action_mask: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (B, T) = 1 where ``action_mask`` is nonzero, else 0: one pass."""
    if action_mask.dtype == torch.bool:
        return out.copy_(action_mask.view(torch.uint8))  # the uint8 route is the fast cast
    return torch.ne(action_mask, 0, out=out)


@torch.no_grad()
def tb_gae_fast(
    rewards: torch.Tensor,  # (B, T)
    values: torch.Tensor,  # (B, T)
    action_mask: torch.Tensor,  # (B, T)
    turn_ids: torch.Tensor,  # (B, T)
    gamma_turn: float,
    lam_turn: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TB-GAE advantages and returns, both (B, T) in values' dtype (``minirsi/core/tb_gae.py``).

    Shapes and dtypes are not checked here: ``tb_gae(..., impl="fast")`` checks them first.
    The two outputs are contiguous halves of one (2, B, T) allocation: keeping either keeps
    both."""
    gamma_turn, lam_turn = float(gamma_turn), float(lam_turn)
    dtype = values.dtype
    B, T = values.shape
    if B == 0 or T == 0:
        return torch.zeros_like(values), torch.zeros_like(values)
    # Both outputs in one allocation: the allocator keeps it for the next call
    # (docs/tb_gae-performance.md).
    buf = torch.empty((2, B, T), dtype=dtype, device=values.device)
    action = _action_float(action_mask, buf[0])  # (B, T) 0/1: any nonzero entry marks an action
    r = rewards.to(dtype)  # (B, T)

    key, offset, chunks = _turn_blocks(turn_ids, action)  # (B, T) sorted; block: key - offset
    K = int(key[:, -1].max()) - offset + 1
    # Block k is the token range [bounds_k, bounds_{k+1}): one search for keys k .. K.
    block_keys = torch.arange(offset, offset + K + 1, device=key.device, dtype=key.dtype)
    bounds = torch.searchsorted(key, block_keys.expand(B, K + 1).contiguous())  # (B, K + 1) int64

    # Per turn: actions before each bound, the first and last action. Few turns (the regime
    # TB-GAE is for): chunked prefix sums read at the bounds; else a full cumsum.
    chunked = K + 1 <= T // _CHUNK
    if chunked:
        acts_incl = _chunk_prefix(action, torch.int64)  # (B, T / C)
        acts_before = _prefix_at(action, acts_incl, bounds)  # (B, K + 1) int64
    else:
        acts = torch.cumsum(action, dim=1, dtype=torch.int64)  # (B, T) actions so far
        acts_before = acts.gather(1, (bounds - 1).clamp(min=0)) * (bounds > 0)
    has_action = acts_before[:, 1:] > acts_before[:, :-1]  # (B, K) bool
    counts = torch.cat([acts_before[:, :-1] + 1, acts_before[:, 1:]], dim=1)  # (B, 2K) 1-based
    if chunked:
        pos = _nth(action, acts_incl, counts)
    else:
        pos = torch.searchsorted(acts, counts).clamp_(max=T - 1)
    first, last = pos.split(K, dim=1)  # (B, K) the turn's first and last action (if any)

    # Rewards. When every nonzero reward sits on the last action of its turn (collate's
    # layout; counting proves it, and with it that none sits off-action), Rtot_k is that one
    # reward and every action of turn k has the same return R_t = Rtot_k + X_k. Otherwise a
    # full prefix sum of the rewards gives Rtot_k and R_t = (its value at the turn's end +
    # X_k) - (its value before t).
    r_last = torch.where(has_action, r.gather(1, last), 0.0)  # (B, K)
    # Nonzero rewards left after clearing every turn's last action? (An empty turn's ``last``
    # is the last action of an earlier turn, also cleared; with no action before it, some
    # position that keeps its flag. Only a left flag can go wrong: then the exact path runs.)
    elsewhere = r.bool()  # (B, T)
    elsewhere.scatter_(1, last, elsewhere.gather(1, last) & (acts_before[:, 1:] == 0))
    rewards_on_last = not _any(elsewhere)
    if rewards_on_last:
        turn_reward = r_last.double()  # (B, K) Rtot_k
    else:
        bad = r.bool() > action.bool()  # (B, T) nonzero reward where no action
        if _any(bad):
            b, t = _first_true(bad)
            raise ValueError(
                f"tb_gae: rewards[{b}, {t}] = {float(r[b, t])} sits on a non-action position; "
                "fix: put rewards on the last action token (minirsi.core.episode.collate does)")
        reward_cumsum = torch.cumsum(r, dim=1, dtype=torch.float64)  # (B, T) rewards up to t
        cumsum_before = reward_cumsum.gather(1, (bounds - 1).clamp(min=0)) * (bounds > 0)  # (B, K + 1)
        turn_reward = cumsum_before[:, 1:] - cumsum_before[:, :-1]  # (B, K) Rtot_k

    V_first = values.gather(1, first).double()  # (B, K) V of the turn's first action
    # Equation (2), as Z_k = a_k + c_k Z_{k+1}: the continuation seen just before block k.
    a = torch.where(has_action,
                    gamma_turn * (1 - lam_turn) * V_first + gamma_turn * lam_turn * turn_reward, 0.0)
    c = torch.full_like(a, gamma_turn * lam_turn).masked_fill_(~has_action, 1.0)  # empty: identity
    Z = _reverse_linear_scan(a, c)
    X = torch.zeros_like(Z)
    X[:, :-1] = Z[:, 1:]  # X_k = Z_{k+1}

    # Equation (1) on action tokens (0 elsewhere).
    returns = buf[1]
    if rewards_on_last and chunks is not None:
        _expand_blocks((turn_reward + X).to(dtype), chunks, offset, action, out=returns)  # (B, T)
    else:
        block = (key - offset if offset else key).long()  # (B, T) block of every token
        if rewards_on_last:
            torch.gather((turn_reward + X).to(dtype), 1, block, out=returns).mul_(action)
        else:  # reward_cumsum before t = reward_cumsum_t - r_t; in float64, then cast
            returns.copy_((cumsum_before[:, 1:] + X).gather(1, block).sub_(reward_cumsum).add_(r)).mul_(action)
    # A_t = R_t - V_t, 0 off-action; written over the mask (one fresh (B, T) buffer less).
    advantages = torch.addcmul(returns, values, action, value=-1.0, out=action)
    return advantages, returns

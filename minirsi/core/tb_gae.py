"""TB-GAE: Turn-Boundary Skip-Observation GAE (docs/method.md section 4).

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
rewards        (B, T)       r_t; nonzero only on action tokens (docs/method.md: on the last one)
values         (B, T)       V_t, the critic's per-token baseline (float32 or float64)
action_mask    (B, T)       1 on action (generated) tokens, 0 elsewhere; bool, int or float
                            (any nonzero entry counts as an action token)
turn_ids       (B, T)       turn(t), integer; see the choices below
gamma_turn     scalar       g in [0, 1], the discount per turn boundary
lam_turn       scalar       l in [0, 1], the trace decay per turn boundary
advantages     (B, T)       A_t (0 off-action), dtype of values
returns        (B, T)       R_t = A_t + V_t (0 off-action), the critic's regression target
=============  ===========  ==================================================================

Three implementations of one definition
---------------------------------------
1. ``tb_gae_reference``: the recurrence above, line by line, as a loop over the positions
   t = T-1, ..., 0, vectorised over the batch. Slow by design (T Python steps): the tests'
   ground truth.
2. ``tb_gae_plain``: the same numbers without a loop over tokens. Inside a turn nothing is
   discounted, so A_t is the plain sum of the deltas of the turn's actions from t on, plus the discounted
   trace from the next turn; in that sum the values cancel in pairs (+V_n of one delta, -V_n
   of the next), leaving::

       R_t = sum_{u >= t, u in turn k} r_u + X_k,        A_t = R_t - V_t                (1)
       X_k = g V_s + g l A_s   (s: first action of the next turn of the row; X_k = 0 if none)
           = g (1 - l) V_s + g l (Rtot_{k+1} + X_{k+1})    (A_s from (1) at t = s)      (2)

   with Rtot_k the sum of the rewards of turn k. (1) is a reverse cumulative sum over tokens;
   (2) is a recurrence over turns only (~100 per sequence, not 262,144 tokens), one step per
   turn, vectorised over the batch.
3. ``tb_gae_fast`` (``minirsi/core/tb_gae_fast.py``): (1) and (2) again, tuned for the CPU (chunked
   reductions instead of full scans, a log-depth scan over turns, one allocation for both
   outputs). ``tb_gae`` runs it by default, so training does; bench/tb_gae.py holds it to its
   targets (docs/tb_gae-performance.md), tests/test_tb_gae.py proves it equal to the other two.

Choices the method leaves open (ours)
-------------------------------------
- A nonzero reward on a non-action position raises ``ValueError`` naming the (row, position):
  it would otherwise be silently lost. Fix: put rewards on the last action token
  (``minirsi.core.episode.collate`` does).
- Turn ids: only their order matters (they need not start at 0 or be contiguous), and they
  must not decrease along the action positions of a row (else ``ValueError`` naming the
  position). Ids at non-action positions are ignored; ``collate`` keeps them non-decreasing
  along the whole row (padding repeats the last turn), which ``tb_gae_fast`` checks first.
- A row with no action token gets zeros. NaN/inf in values or rewards propagate (not checked).
- Sums are taken in float64 and cast to values' dtype at the end, so float32 results agree
  with a float64 loop to ~1e-7 of the row's reward mass plus values.

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

    from minirsi.core.tb_gae import tb_gae
    advantages, returns = tb_gae(rewards, values, action_mask, turn_ids,
                                 gamma_turn=1.0, lam_turn=0.95)                # impl="fast"
    advantages, returns = tb_gae(..., impl="plain")                            # the plain form
"""

from __future__ import annotations

import torch

from minirsi.core.tb_gae_fast import tb_gae_fast

__all__ = ["IMPLEMENTATIONS", "tb_gae", "tb_gae_chunked", "tb_gae_plain", "tb_gae_reference"]


@torch.no_grad()
def tb_gae_reference(
    rewards: torch.Tensor,  # (B, T)
    values: torch.Tensor,  # (B, T)
    action_mask: torch.Tensor,  # (B, T)
    turn_ids: torch.Tensor,  # (B, T)
    gamma_turn: float,
    lam_turn: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence, line by line: positions from the end, the batch at once, in float64.

    Test and benchmark reference only (T Python steps); training calls ``tb_gae``.
    """
    _check_inputs(rewards, values, action_mask, turn_ids, gamma_turn, lam_turn)
    is_action = action_mask != 0  # (B, T)
    _check_rewards_on_actions(rewards, is_action)
    r, V = rewards.double(), values.double()  # (B, T)
    A, R = torch.zeros_like(V), torch.zeros_like(V)  # (B, T)
    # The next action n to the right of t, per row: does it exist, V_n, A_n, turn(n).
    has_n = torch.zeros_like(is_action[:, 0])  # (B,)
    V_n, A_n = torch.zeros_like(V[:, 0]), torch.zeros_like(V[:, 0])  # (B,)
    turn_n = torch.zeros_like(turn_ids[:, 0])  # (B,)
    for t in reversed(range(V.shape[1])):
        same_turn = has_n & (turn_ids[:, t] == turn_n)  # (B,)
        boundary = has_n & ~same_turn  # n is in a later turn (ids do not decrease)
        # The recurrence's three cases as the factors of V_n (discount) and A_n (decay):
        # no n: 0 and 0;  turn(n) == turn(t): 1 and 1;  boundary: g and g l.
        discount = torch.where(same_turn, 1.0, gamma_turn * boundary.double())  # (B,)
        decay = torch.where(same_turn, 1.0, gamma_turn * lam_turn * boundary.double())  # (B,)
        delta = r[:, t] + discount * V_n - V[:, t]  # (B,)
        A_t = delta + decay * A_n  # (B,)
        act = is_action[:, t]  # (B,) non-action positions keep 0 and leave the carry alone
        A[:, t] = torch.where(act, A_t, 0.0)
        R[:, t] = torch.where(act, A_t + V[:, t], 0.0)
        has_n = has_n | act
        V_n = torch.where(act, V[:, t], V_n)
        A_n = torch.where(act, A_t, A_n)
        turn_n = torch.where(act, turn_ids[:, t], turn_n)
    return A.to(values.dtype), R.to(values.dtype)


@torch.no_grad()
def tb_gae_plain(
    rewards: torch.Tensor,  # (B, T)
    values: torch.Tensor,  # (B, T)
    action_mask: torch.Tensor,  # (B, T)
    turn_ids: torch.Tensor,  # (B, T)
    gamma_turn: float,
    lam_turn: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Equations (1) and (2) of the module docstring with cumulative sums, in float64."""
    _check_inputs(rewards, values, action_mask, turn_ids, gamma_turn, lam_turn)
    is_action = action_mask != 0  # (B, T)
    _check_rewards_on_actions(rewards, is_action)
    r, V = rewards.double(), values.double()  # (B, T)
    B, T = V.shape

    # The turn of the latest action at or before t (ids off-action ignored); at an action it
    # must be the action's own id, or the ids decreased.
    low = torch.iinfo(turn_ids.dtype).min
    latest = torch.cummax(turn_ids.masked_fill(~is_action, low), dim=1).values  # (B, T)
    bad = is_action & (latest != turn_ids)
    if bad.any():
        b, t = bad.nonzero()[0].tolist()
        raise ValueError(
            f"tb_gae: turn_ids decrease along the action positions of row {b}: position {t} "
            f"has turn {int(turn_ids[b, t])} after an action of turn {int(latest[b, t])}; "
            "fix: number turns in order (minirsi.core.episode.collate does)")
    # k: each action's turn counted 0, 1, ... along its row; K (a spare column) off-action.
    previous = torch.cat([latest.new_full((B, 1), low), latest[:, :-1]], dim=1)  # (B, T)
    acted_before = (torch.cumsum(is_action, dim=1) - is_action.long()) > 0  # (B, T)
    # (acted_before: a first action whose id happens to equal the fill value ``low``.)
    first_of_turn = is_action & ((previous != turn_ids) | ~acted_before)  # (B, T)
    k = torch.cumsum(first_of_turn, dim=1) - 1  # (B, T)
    K = int(k.max()) + 1 if k.numel() else 0
    slot = torch.where(is_action, k, K)  # (B, T)

    # Per turn (B, K + 1), zero in the spare column and past a row's last turn.
    turn_reward = V.new_zeros(B, K + 1).scatter_add_(1, slot, r)  # Rtot_k
    V_first = V.new_zeros(B, K + 1).scatter_(1, torch.where(first_of_turn, k, K), V)  # V_s of turn k
    V_first[:, K] = 0.0
    # (2): X_k from X_{k+1}, one step per turn (X = 0 after a row's last turn).
    X = V.new_zeros(B, K + 1)
    for j in reversed(range(K - 1)):
        X[:, j] = (gamma_turn * (1 - lam_turn) * V_first[:, j + 1]
                   + gamma_turn * lam_turn * (turn_reward[:, j + 1] + X[:, j + 1]))

    # (1): the rewards from t to the row's end, less those of the turns after t's turn.
    rewards_to_end = r.flip(1).cumsum(1).flip(1)  # (B, T)
    later_turns = turn_reward.flip(1).cumsum(1).flip(1) - turn_reward  # (B, K + 1)
    returns = rewards_to_end - later_turns.gather(1, slot) + X.gather(1, slot)  # (B, T)
    returns = torch.where(is_action, returns, 0.0)
    advantages = torch.where(is_action, returns - V, 0.0)
    return advantages.to(values.dtype), returns.to(values.dtype)


IMPLEMENTATIONS = ("fast", "plain")
"""Values of ``tb_gae(impl=...)``: "fast" = ``tb_gae_fast`` (the default), "plain" =
``tb_gae_plain``. Both compute the module docstring's equations."""


def tb_gae(
    rewards: torch.Tensor,  # (B, T)
    values: torch.Tensor,  # (B, T)
    action_mask: torch.Tensor,  # (B, T)
    turn_ids: torch.Tensor,  # (B, T)
    gamma_turn: float,
    lam_turn: float,
    impl: str = "fast",
) -> tuple[torch.Tensor, torch.Tensor]:
    """TB-GAE advantages and returns, both (B, T) in values' dtype; see the module docstring.

    ``impl``: "fast" (default; training's) runs ``tb_gae_fast`` from minirsi/core/tb_gae_fast.py,
    "plain" runs ``tb_gae_plain``; tests/test_tb_gae.py proves them equal."""
    if impl == "plain":
        return tb_gae_plain(rewards, values, action_mask, turn_ids, gamma_turn, lam_turn)
    if impl != "fast":
        raise ValueError(f"tb_gae: impl={impl!r}; use one of {IMPLEMENTATIONS}")
    _check_inputs(rewards, values, action_mask, turn_ids, gamma_turn, lam_turn)
    return tb_gae_fast(rewards, values, action_mask, turn_ids, gamma_turn, lam_turn)


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
    is_action = action_mask if action_mask.dtype == torch.bool else action_mask != 0
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
        act_c = is_action[:, start:end]
        tid_c = turn_ids[:, start:end]
        carry_r = V_n if reset_at_chunk_edge else A_n + V_n
        A_c, R_c = tb_gae(
            torch.cat([r[:, start:end], (carry_r * has_n)[:, None]], dim=1),
            torch.cat([values[:, start:end], V_n[:, None]], dim=1),
            torch.cat([act_c, has_n[:, None]], dim=1),
            # Rows without a carry get the chunk's last id: the key stays sorted.
            torch.cat([tid_c, torch.where(has_n, turn_n, tid_c[:, -1])[:, None]], dim=1),
            gamma_turn, lam_turn)
        advantages[:, start:end] = A_c[:, :-1]
        returns[:, start:end] = R_c[:, :-1]
        # New carry: the first action of this chunk, where the chunk has one.
        here = act_c.any(dim=1)  # (B,)
        idx = act_c.to(torch.uint8).argmax(dim=1, keepdim=True)  # (B, 1) first action
        V_n = torch.where(here, values[:, start:end].gather(1, idx)[:, 0], V_n)
        A_n = torch.where(here, A_c.gather(1, idx)[:, 0], A_n)
        turn_n = torch.where(here, tid_c.gather(1, idx)[:, 0], turn_n)
        has_n = has_n | here
        end = start
    return advantages, returns


# Input checks shared by the forms above (tb_gae_fast is reached through tb_gae, which checks).
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


def _check_rewards_on_actions(rewards: torch.Tensor, is_action: torch.Tensor) -> None:
    """Raise naming the first (row, position) of a nonzero reward off the action tokens."""
    off = (rewards != 0) & ~is_action  # (B, T)
    if off.any():
        b, t = off.nonzero()[0].tolist()
        raise ValueError(
            f"tb_gae: rewards[{b}, {t}] = {float(rewards[b, t])} sits on a non-action position; "
            "fix: put rewards on the last action token (minirsi.core.episode.collate does)")

"""One multi-turn episode, exactly as it was sampled, and how episodes become training tensors.

docs/method.md section 3. An episode is the prompt followed by turns; turn k is an action the
policy generated (token ids exactly as sampled, with the sampler's log-probs) followed by the
observation the sandbox returned (tokenized by the harness, never by the policy). The training
sequence is the concatenation of those ids, never a re-tokenisation of the transcript text.

Token bookkeeping (every list has the sequence's length T):

=============  ==========================================================================
token_ids      prompt ids, then for each turn: action ids, observation ids
logprobs       the sampler's log-prob of each action token; ``None`` on every other token
action_mask    1 on generated (action) tokens, 0 on prompt and observation tokens
turn_ids       0 on the prompt and on the first action; action k has k; the observation
               that follows action k has k + 1 (it is the context of the next turn), so
               ``turn_ids`` never decreases
=============  ==========================================================================

The last stored token is always an action token: the observation that answers the final
action (if any) is dropped from the training sequence, because nothing is learned from it and
docs/method.md asks every sequence to end on an action (where the reward sits).

Rewards are not stored per token: ``collate`` places one scalar per episode on its last action
token, which is where TB-GAE expects it.

The batching that the critic warm-up and the PPO update share lives here too: ``masked_mean``
(the token mean over action tokens of every loss and metric), ``minibatches`` (seeded random
minibatches, micro-batches ordered by length), ``trimmed`` (rows of a padded batch, cut to
their longest) and ``forward_by_length`` (no-grad passes in chunks of similar length).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from minirsi.core.atomic import atomic_open


@dataclass
class Episode:
    """A finished episode and its verifier result."""

    task_id: str
    family: str
    difficulty: str
    token_ids: list[int]
    logprobs: list[float | None]
    action_mask: list[int]
    turn_ids: list[int]
    turns: int
    """Number of actions the agent took."""
    success: bool
    """S: the verifier's strict outcome (``/logs/verifier/reward.txt``)."""
    passed: int
    """P: passed non-hygiene checks."""
    total: int
    """C: all non-hygiene checks of the task."""
    stop_reason: str = "done"
    """Why the agent stopped: done | max_turns | timeout | context | sandbox_error."""
    parse_errors: int = 0
    """Replies that parsed to no command (each answered with a format reminder)."""
    checks: dict[str, str] = field(default_factory=dict)
    """Per-check outcome: passed | failed | error | skipped (non-hygiene and hygiene)."""
    transcript: list[dict[str, Any]] = field(default_factory=list)
    """Per turn: {"action": text, "commands": [...], "observation": text}."""
    prompt_len: int = 0
    error: str | None = None
    """Set when the episode ended abnormally (a sandbox that died, a verifier crash)."""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("logprobs", "action_mask", "turn_ids"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"episode {self.task_id}: {name} has {len(getattr(self, name))} entries, "
                    f"token_ids has {n}; every per-token list must have the sequence's length"
                )

    @property
    def executed_all_passed(self) -> bool:
        """True when every check that ran passed (the paper's 48 gate-failing runs)."""
        ran = [v for v in self.checks.values() if v in ("passed", "failed", "error")]
        return bool(ran) and all(v == "passed" for v in ran)

    def to_json(self) -> str:
        # "task" leads each line so a JSONL file reads well with `jq .task`; it mirrors task_id.
        return json.dumps({"task": self.task_id, **dataclasses.asdict(self)}, ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Episode":
        known = {f.name for f in dataclasses.fields(cls)}
        d = dict(d)
        if "task_id" not in d and "task" in d:
            d["task_id"] = d["task"]
        return cls(**{k: v for k, v in d.items() if k in known})


def write_jsonl(episodes: Iterable[Episode], path: str | Path) -> None:
    """Write episodes to ``path`` (one per line), atomically: a crash leaves the old file."""
    with atomic_open(path) as f:
        for ep in episodes:
            f.write(ep.to_json() + "\n")


class JsonlWriter:
    """Append episodes to a JSONL file as they finish, flushing each line to disk, so an
    interrupted collection keeps every episode it finished."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a")

    def write(self, ep: Episode) -> None:
        self._f.write(ep.to_json() + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | Path) -> Iterator[Episode]:
    """Read episodes back; a torn last line (the process was killed mid-write) is skipped."""
    path = Path(path)
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                return  # the writer was killed mid-line; everything before it is intact
            raise ValueError(f"{path}:{i + 1}: not valid JSON; the file is corrupt") from None
        yield Episode.from_dict(d)


def right_pad(
    rows: Sequence[Sequence[int]], pad_id: int, masks: Sequence[Sequence[float]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Token rows -> ``(input_ids, attention_mask, mask)``, all ``(B, T)`` with T the longest row:
    ids padded with ``pad_id`` on the right (long), 1 on real tokens (long), and ``masks`` (one per
    row, e.g. action masks) as float, 0 on padding (None when no masks are given). The one place
    where a batch is padded: SFT, pretraining and the PPO batch all come through here."""
    if not rows:
        raise ValueError("right_pad needs at least one row")
    B, T = len(rows), max(len(r) for r in rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32) if masks is not None else None
    for i, ids in enumerate(rows):
        n = len(ids)
        input_ids[i, :n] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        if mask is not None:
            mask[i, :n] = torch.tensor(masks[i], dtype=torch.float32)
    return input_ids, attention_mask, mask


def collate(
    episodes: Sequence[Episode],
    rewards: Sequence[float] | None = None,
    pad_id: int = 0,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Right-pad episodes into ``(B, T)`` tensors for a training forward pass.

    Returns ``input_ids`` (long), ``attention_mask`` (long, 1 on real tokens), ``action_mask``
    (float, 1 on action tokens), ``turn_ids`` (long; padding repeats the last turn so the
    sequence stays non-decreasing), ``old_logprobs`` (float, sampler log-probs, 0 off-action)
    and, when ``rewards`` is given, ``rewards`` (float, the episode's scalar on its last action
    token, 0 elsewhere).
    """
    if not episodes:
        raise ValueError("collate needs at least one episode")
    input_ids, attention_mask, action_mask = right_pad([ep.token_ids for ep in episodes], pad_id,
                                                       [ep.action_mask for ep in episodes])
    B, T = input_ids.shape
    turn_ids = torch.zeros((B, T), dtype=torch.long)
    old_logprobs = torch.zeros((B, T), dtype=torch.float32)
    reward_t = torch.zeros((B, T), dtype=torch.float32)
    for i, ep in enumerate(episodes):
        n = len(ep.token_ids)
        turn_ids[i, :n] = torch.tensor(ep.turn_ids, dtype=torch.long)
        if n < T:
            turn_ids[i, n:] = ep.turn_ids[-1] if n else 0
        old_logprobs[i, :n] = torch.tensor([lp if lp is not None else 0.0 for lp in ep.logprobs])
        if rewards is not None:
            act = [t for t, m in enumerate(ep.action_mask) if m]
            if not act:
                raise ValueError(f"episode {ep.task_id} has no action token to carry its reward")
            reward_t[i, act[-1]] = float(rewards[i])
    out = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "action_mask": action_mask,
        "turn_ids": turn_ids,
        "old_logprobs": old_logprobs,
    }
    if rewards is not None:
        out["rewards"] = reward_t
    if device is not None:
        out = {k: v.to(device) for k, v in out.items()}
    return out


def masked_mean(x: torch.Tensor, mask: torch.Tensor, normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
    """sum_t m_t x_t / N over (B, T) (N = m.sum(), at least 1, unless given); positions with
    m = 0 are never read (``torch.where``, not a product, so a non-finite value there cannot
    leak in). The token mean of every loss and metric over action tokens."""
    m = mask.bool()
    n = m.sum().clamp(min=1) if normalizer is None else normalizer
    return torch.where(m, x, torch.zeros_like(x)).sum() / n


def minibatches(
    n: int, minibatch_size: int, grad_accum: int, generator: torch.Generator,
    lengths: torch.Tensor | None = None,
) -> Iterator[list[torch.Tensor]]:
    """A seeded random permutation of range(n) cut into minibatches of ``minibatch_size`` (the
    last may be smaller), each split into up to ``grad_accum`` micro-batches of index tensors.

    Minibatches are uniformly random: grouping episodes by length would group them by outcome
    (short episodes are mostly successes, long ones turn-limit failures), so each optimizer step
    would see one-signed advantages. With ``lengths`` (n,), only the order *inside* a minibatch
    is by length, so its micro-batches pad less; the minibatch, hence its gradient, is the same.
    """
    perm = torch.randperm(n, generator=generator)
    for start in range(0, n, minibatch_size):
        mb = perm[start:start + minibatch_size]
        if lengths is not None:
            mb = mb[torch.argsort(lengths[mb], descending=True, stable=True)]
        yield [c for c in torch.chunk(mb, min(grad_accum, len(mb)))]


def trimmed(batch: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows ``idx`` of a right-padded (B, T) batch, cut after their longest sequence (the
    columns past it are padding in every selected row; causal attention never lets a real
    token see them, so the result is the same as on the full width)."""
    mask = batch["attention_mask"]
    T = mask.shape[1]
    width = int(mask[idx].sum(1).max()) if len(idx) else 0
    return {k: v[idx, :width] if v.dim() == 2 and v.shape[1] == T else v[idx] for k, v in batch.items()}


def by_length(lengths: torch.Tensor, chunk: int) -> Iterator[torch.Tensor]:
    """Index tensors of up to ``chunk`` rows each, longest first (for no-grad passes)."""
    order = torch.argsort(lengths, descending=True, stable=True)
    yield from torch.split(order, chunk)


def forward_by_length(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], batch: dict[str, torch.Tensor], chunk: int
) -> torch.Tensor:
    """``fn(input_ids, attention_mask) -> (b, t)`` float32 over a right-padded batch, without
    grad, ``chunk`` sequences of similar length at a time (bounds memory), each pass cut to its
    rows' longest length; (B, T), 0 past a pass's width."""
    mask = batch["attention_mask"]
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    with torch.no_grad():
        for idx in by_length(mask.sum(1), chunk):
            sub = trimmed({"input_ids": batch["input_ids"], "attention_mask": mask}, idx)
            y = fn(sub["input_ids"], sub["attention_mask"])
            out[idx, : y.shape[1]] = y
    return out


def pad_id_of(tokenizer: object) -> int:
    """The id padding uses: the tokenizer's pad token, 0 when it has none."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else 0

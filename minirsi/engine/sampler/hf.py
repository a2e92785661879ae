"""``HFSampler``: a Hugging Face causal LM in this process, all prompts decoded together with
one KV cache and a prefix cache per row (minirsi.engine.sampler's docstring)."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch

from minirsi.engine.sampler.base import FINISH_LENGTH, FINISH_STOP, Sample, _check_args

logger = logging.getLogger(__name__)


@dataclass
class _Prefix:
    """The KV cache of one context the sampler has already encoded (kept for the next turn)."""

    ids: list[int]
    keys: list[torch.Tensor]  # per layer (n_kv_heads, len(ids), head_dim)
    values: list[torch.Tensor]
    nbytes: int


class _Slots:
    """The KV cache of one batch: per layer a preallocated (B, kv heads, S, head dim) buffer.

    A model call writes its new keys and values in place at slots [start, start + q) of buffer
    rows ``rows`` and attends over slots [0, start + q) of those rows; which of them a query may
    see is the 4-D mask's business. Writing in place (instead of ``DynamicCache``'s
    ``torch.cat`` of the whole cache at every step, and a copy of it whenever a row finishes)
    keeps a decode step's memory traffic to the slots attention reads. It duck-types the one
    method Hugging Face attention layers call on a cache, ``update``.
    """

    def __init__(self, config: Any, B: int, S: int, device: torch.device, kv: tuple[int, int, torch.dtype] | None):
        self.B, self.S, self.device = B, S, device
        n_layers = int(config.num_hidden_layers)
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers
        if kv is not None:
            for layer in range(n_layers):
                self._allocate(layer, *kv)
        self._rows, self._start = slice(0, B), 0

    def _allocate(self, layer: int, kvh: int, hd: int, dtype: torch.dtype) -> None:
        # Zeros, not empty: pad slots are masked, but garbage there could be NaN, and 0 * NaN
        # in the attention-weighted sum of values would poison the row.
        self.keys[layer] = torch.zeros((self.B, kvh, self.S, hd), dtype=dtype, device=self.device)
        self.values[layer] = torch.zeros((self.B, kvh, self.S, hd), dtype=dtype, device=self.device)

    def put_prefix(self, row: int, at: int, prefix: _Prefix) -> None:
        """Copy a kept prefix into slots [at, at + len) of ``row``."""
        for layer, (k, v) in enumerate(zip(prefix.keys, prefix.values)):
            self.keys[layer][row, :, at : at + k.shape[1]] = k
            self.values[layer][row, :, at : at + v.shape[1]] = v

    def target(self, rows: slice, start: int) -> None:
        """Where the next model call writes: buffer rows ``rows``, from slot ``start``."""
        self._rows, self._start = rows, start

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep buffer rows ``keep`` (b',) only (one copy of the buffers)."""
        self.keys = [None if k is None else k[keep] for k in self.keys]
        self.values = [None if v is None else v[keep] for v in self.values]
        self.B = len(keep)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """key_states, value_states: (b, kvh, q, hd) -> all of the rows' keys and values so far."""
        if self.keys[layer_idx] is None:
            self._allocate(layer_idx, key_states.shape[1], key_states.shape[3], key_states.dtype)
        end = self._start + key_states.shape[2]
        K, V = self.keys[layer_idx], self.values[layer_idx]
        K[self._rows, :, self._start : end] = key_states
        V[self._rows, :, self._start : end] = value_states
        return K[self._rows, :, :end], V[self._rows, :, :end]  # views: (b, kvh, end, hd)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._start


def _draw(logp: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One id per row from ``softmax`` = exp(logp) (a, V), by inverting the CDF: the first id
    whose cumulative probability exceeds u * total, u ~ U[0, 1) from ``generator``.

    The same distribution as ``torch.multinomial(p, 1)``, which is several times slower on CPU
    (docs/experiments.md, "Measurements behind the code's defaults"). The cumulative sum is
    float64, so rounding moves probability by < 1e-12; an id of probability 0 is never drawn
    (its cumulative value equals its predecessor's, and the search takes the first id strictly
    above u * total).
    """
    cdf = logp.double().exp().cumsum(dim=-1)  # (a, V)
    u = torch.rand((logp.shape[0], 1), generator=generator, dtype=torch.float64, device=logp.device)  # (a, 1)
    ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # (a, 1)
    return ids.clamp_(max=logp.shape[-1] - 1)


def _prefill_groups(lengths: list[int], call_tokens: int) -> list[tuple[int, int]]:
    """Split rows (``lengths`` sorted longest first) into slices [r0, r1) prefilled together.

    A group costs ``call_tokens`` (the fixed cost of one model call, in tokens) plus its rows
    times its longest length (each row is padded to it). Exact minimum by dynamic programming
    over the sorted rows (at most a few hundred rows, so O(B^2) is nothing).
    Example: lengths [55, 40, 29, 29, 14, 14], call_tokens 32 -> [(0, 2), (2, 6)]
    (one call of 2 x 55 and one of 4 x 29: 32 + 110 + 32 + 116 = 290 token-costs, against
    32 + 6 x 55 = 362 for a single call).
    """
    B = len(lengths)
    best = [0] + [None] * B  # best[j]: cheapest cost of rows [0, j)
    cut = [0] * (B + 1)
    for j in range(1, B + 1):
        for i in range(j):
            cost = best[i] + call_tokens + (j - i) * lengths[i]
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], B
    while j > 0:
        groups.append((cut[j], j))
        j = cut[j]
    return groups[::-1]


class HFSampler:
    """Batched sampling from a Hugging Face causal LM with a shared KV cache.

    One call decodes all prompts (in chunks of ``max_batch_size``) together. The loop is the
    model's forward with a KV cache, not ``generate``: prefill, then one forward per token for
    all rows still decoding. Each row has its own slots in one preallocated cache (``_Slots``:
    its cached prefix, if any, then its new tokens, then its sampled tokens), a 4-D attention
    mask built from each slot's position hides every pad slot and every later token, and
    position ids count from the row's own first token, so each row is computed as if alone.
    The prompts' new tokens are encoded in groups of similar length (``_prefill_groups``) so a
    short observation is not padded to the longest one; rows that stop leave the batch (their
    slots are compacted away once half the rows have stopped). Supported attention layer
    types: full and sliding-window (the masks are built here); others raise at construction.

    Prefix cache (multi-turn). In a rollout, turn k+1's prompt is turn k's prompt + the sampled
    action + the observation. With ``prefix_cache=True`` the sampler keeps, for every row it
    decoded, the KV cache of ``prompt + action[:-1]`` (everything it fed the model), and a later
    prompt that extends a kept context only encodes its new tokens (the last action token and
    the observation). Without it every turn re-encodes the whole context, which costs more than
    the decoding itself for 8-turn episodes. Kept caches belong to the current weights: call
    ``clear_cache()`` after the model changes (``rollout.collect`` clears at its start and end);
    ``max_cache_bytes`` bounds them, oldest dropped first. A kept prefix is used once (popped).

    Args:
        model: a ``PreTrainedModel`` with a causal-LM head (``AutoModelForCausalLM``).
        tokenizer: its tokenizer; only ``pad_token_id`` / ``eos_token_id`` are read (the pad id
            fills padding, which the attention mask hides, so its value never matters).
        max_batch_size: prompts are decoded in chunks of at most this many rows (None: all).
        prefix_cache: keep each row's KV cache for the next turn (see above).
        max_cache_bytes: memory bound of the kept caches.
        prefill_call_tokens: the fixed cost of one extra prefill call, in padded tokens; rows
            are grouped to minimise (calls x this + padded tokens). 32: the tiny model's per-call
            overhead on one CPU core, in tokens
            (docs/experiments.md, "Measurements behind the code's defaults").
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        max_batch_size: int | None = None,
        prefix_cache: bool = True,
        max_cache_bytes: int = 2**30,
        prefill_call_tokens: int = 32,
    ):
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: must be >= 1 or None")
        if prefill_call_tokens < 0:
            raise ValueError(f"prefill_call_tokens={prefill_call_tokens}: must be >= 0")
        config = model.config
        self._layer_kinds = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]))
        unknown = set(self._layer_kinds) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(
                f"HFSampler builds the attention masks of full and sliding-window layers only; this model has "
                f"layer types {sorted(unknown)}. Fix: serve it with vLLM and use OpenAISampler"
            )
        self._sliding_window = getattr(config, "sliding_window", None) or 0
        if "sliding_attention" in self._layer_kinds and self._sliding_window < 1:
            raise ValueError("the model has sliding_attention layers but no config.sliding_window")
        self.prefill_call_tokens = prefill_call_tokens
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.prefix_cache = prefix_cache
        self.max_cache_bytes = max_cache_bytes
        self._prefixes: dict[int, _Prefix] = {}  # insertion order = age
        self._next_key = 0
        self.cache_hits = 0
        """Prompts that reused a kept prefix (for tests and logs)."""
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else 0
        # transformers 5 renamed the ``past_key_values`` argument and output to ``cache``.
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
        params = inspect.signature(base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def clear_cache(self) -> None:
        """Forget every kept prefix (call after the weights change)."""
        self._prefixes.clear()

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        stop_token_ids: list[int],
        seed: int | None = None,
    ) -> list[Sample]:
        _check_args(prompts, max_new_tokens, temperature)
        if not prompts:
            return []
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(int(seed))
        size = self.max_batch_size or len(prompts)
        out: list[Sample] = []
        for start in range(0, len(prompts), size):
            chunk = [list(p) for p in prompts[start : start + size]]
            out += self._generate_batch(chunk, max_new_tokens, temperature, stop_token_ids, generator)
        return out

    def _take_prefix(self, prompt: list[int]) -> _Prefix | None:
        """Pop the longest kept context that is a proper prefix of ``prompt``."""
        best_key, best_len = None, 0
        for key, pre in self._prefixes.items():
            n = len(pre.ids)
            if best_len < n < len(prompt) and prompt[n - 1] == pre.ids[-1] and prompt[:n] == pre.ids:
                best_key, best_len = key, n
        return None if best_key is None else self._prefixes.pop(best_key)

    def _keep_prefix(self, ids: list[int], slots: _Slots, row: int, real: torch.Tensor) -> None:
        """Keep buffer row ``row`` of ``slots`` (its real slots: ``real``, (end,) bool) as the
        cache of ``ids``."""
        if not self.prefix_cache or not ids:
            return
        end = real.shape[0]
        keys = [k[row, :, :end][:, real, :] for k in slots.keys]  # (kvh, len, hd), copies
        values = [v[row, :, :end][:, real, :] for v in slots.values]
        if keys[0].shape[1] != len(ids):  # never expected: drop rather than keep a wrong cache
            logger.warning("prefix cache: %d cached slots for %d ids; not kept", keys[0].shape[1], len(ids))
            return
        nbytes = sum(t.numel() * t.element_size() for t in keys + values)
        self._prefixes[self._next_key] = _Prefix(ids, keys, values, nbytes)
        self._next_key += 1
        total = sum(p.nbytes for p in self._prefixes.values())
        while total > self.max_cache_bytes and self._prefixes:
            total -= self._prefixes.pop(next(iter(self._prefixes))).nbytes

    @torch.inference_mode()
    def _generate_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        stop_token_ids: list[int],
        generator: torch.Generator | None,
    ) -> list[Sample]:
        was_training = self.model.training
        self.model.eval()
        try:
            return self._decode(prompts, max_new_tokens, temperature, stop_token_ids, generator)
        finally:
            if was_training:
                self.model.train()

    def _decode(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        stop_token_ids: list[int],
        generator: torch.Generator | None,
    ) -> list[Sample]:
        """Prefill (in groups of similar length), then decode all rows one token a step.

        Slot layout of buffer row i over S = C + N + max_new_tokens slots (the ``_Slots`` cache):
        ``[pad | cached_i]`` in [0, C), ``[pad | new_i]`` right-aligned in [C, C + N), sampled
        token t at slot C + N + t. ``pos`` (B, S) holds each slot's position in its row (-1 for
        pads); the 4-D masks are built from it, so a row sees exactly its own tokens, causally.
        """
        dev = self.device
        hits = [self._take_prefix(p) if self.prefix_cache else None for p in prompts]
        self.cache_hits += sum(h is not None for h in hits)
        c = [len(h.ids) if h is not None else 0 for h in hits]  # cached tokens per prompt
        n = [len(p) - ci for p, ci in zip(prompts, c)]  # tokens to encode now, >= 1 per prompt
        # Buffer rows sorted by new length (longest first), so each prefill group is a row slice.
        order = sorted(range(len(prompts)), key=lambda i: -n[i])
        B, C, N = len(prompts), max(c), max(n)
        S = C + N + max_new_tokens
        slots = _Slots(self.model.config, B, S, dev, self._kv_shape(hits))
        pos = torch.full((B, S), -1, dtype=torch.long, device=dev)  # (B, S)
        input_ids = torch.full((B, N), self.pad_token_id, dtype=torch.long, device=dev)  # (B, N)
        for r, i in enumerate(order):
            if hits[i] is not None:
                slots.put_prefix(r, C - c[i], hits[i])
                pos[r, C - c[i] : C] = torch.arange(c[i], device=dev)
            input_ids[r, N - n[i] :] = torch.tensor(prompts[i][c[i] :], dtype=torch.long, device=dev)
            pos[r, C + N - n[i] : C + N] = torch.arange(c[i], c[i] + n[i], device=dev)

        # Prefill: groups of rows of similar new length, so short rows are not padded to the
        # longest (a group writes slots [C + N - Ng, C + N) and attends over [0, C + N)).
        outs = []
        for r0, r1 in _prefill_groups([n[i] for i in order], self.prefill_call_tokens):
            Ng = n[order[r0]]  # the group's longest new length
            x = input_ids[r0:r1, N - Ng :]  # (g, Ng)
            outs.append(self._forward(slots, slice(r0, r1), C + N - Ng, x, pos[r0:r1, : C + N], prefill=True))
        logits = torch.cat(outs)  # (B, V) each row's last-position logits

        stop = torch.tensor(sorted(set(stop_token_ids)) or [-1], dtype=torch.long, device=dev)
        ids: list[list[int]] = [[] for _ in range(B)]  # by prompt index
        lps: list[list[float]] = [[] for _ in range(B)]
        finish = [FINISH_LENGTH] * B
        rows = list(order)  # buffer row -> prompt index
        alive = torch.ones(B, dtype=torch.bool, device=dev)  # (b,) buffer rows still decoding
        end = C + N  # slots [0, end) are written
        for t in range(max_new_tokens):
            # Buffer rows that sample this step, in prompt order: the seeded draws then do not
            # depend on how the rows were grouped (the same as sampling each prompt's row in turn).
            live = sorted(alive.nonzero().squeeze(-1).tolist(), key=rows.__getitem__)
            live = torch.tensor(live, dtype=torch.long, device=dev)  # (a,)
            z = logits[live].float()  # (a, V)
            if temperature > 0:
                logp = torch.log_softmax(z / temperature, dim=-1)  # (a, V)
                next_ids = _draw(logp, generator)  # (a, 1)
            else:
                logp = torch.log_softmax(z, dim=-1)
                next_ids = logp.argmax(dim=-1, keepdim=True)
            next_lp = logp.gather(-1, next_ids).squeeze(-1)  # (a,)
            next_ids = next_ids.squeeze(-1)  # (a,)
            is_stop = torch.isin(next_ids, stop)  # (a,)
            last = t == max_new_tokens - 1
            for r, tok, lp, s in zip(live.tolist(), next_ids.tolist(), next_lp.tolist(), is_stop.tolist()):
                i = rows[r]
                ids[i].append(tok)
                lps[i].append(lp)
                if s:
                    finish[i] = FINISH_STOP
                if s or last:  # slots [0, end) of row r hold prompt + ids[:-1]: keep them for next turn
                    self._keep_prefix(prompts[i] + ids[i][:-1], slots, r, pos[r, :end] >= 0)
            alive[live[is_stop]] = False
            if last or not bool(alive.any()):
                break
            feed = torch.full((len(rows),), self.pad_token_id, dtype=torch.long, device=dev)  # (b,)
            feed[live] = next_ids
            if int(alive.sum()) <= len(rows) // 2:  # compact: finished rows cost compute every step
                keep = alive.nonzero().squeeze(-1)  # (b',)
                slots.select_rows(keep)
                pos, feed, alive = pos[keep], feed[keep], alive[keep]
                rows = [rows[r] for r in keep.tolist()]
            pos[:, end] = pos[:, end - 1] + 1  # slot end - 1 is each row's last token
            logits = self._forward(slots, slice(0, len(rows)), end, feed[:, None], pos[:, : end + 1], prefill=False)
            end += 1
        return [Sample(ids[i], lps[i], finish[i]) for i in range(B)]

    def _forward(
        self, slots: "_Slots", rows: slice, start: int, input_ids: torch.Tensor, kpos: torch.Tensor, prefill: bool
    ) -> torch.Tensor:
        """One model call for buffer rows ``rows``: ``input_ids`` (b, q) go to slots [start,
        start + q), the queries attend over slots [0, start + q) as ``kpos`` (b, start + q)
        allows. Returns the last position's logits (b, V)."""
        q = input_ids.shape[1]
        qpos = kpos[:, start:]  # (b, q) positions of the queries (-1: a pad)
        if prefill:
            allowed = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= qpos[:, :, None])  # (b, q, K)
            # A pad query sees only its own slot: a fully masked row would be NaN in attention,
            # and NaN values in a pad slot would poison the rows that mask it (0 * NaN).
            idx = torch.arange(q, device=kpos.device)
            allowed[:, idx, start + idx] = True
        else:
            allowed = (kpos >= 0)[:, None, :]  # (b, 1, K): every written slot is in the past
        masks = {}
        for kind in self._layer_kinds:
            m = allowed
            if kind == "sliding_attention":
                m = m & (qpos[:, :, None] - kpos[:, None, :] < self._sliding_window)
            masks[kind] = m[:, None]  # (b, 1, q, K)
        slots.target(rows, start)
        out = self.model(
            input_ids=input_ids,
            attention_mask=masks,
            position_ids=qpos.clamp(min=0),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: slots},
        )
        return out.logits[:, -1, :]  # (b, V)

    def _kv_shape(self, hits: list[_Prefix | None]) -> tuple[int, int, torch.dtype] | None:
        """(kv heads, head dim, dtype) from a kept prefix, else None (read at the first write)."""
        ref = next((h for h in hits if h is not None), None)
        return None if ref is None else (ref.keys[0].shape[0], ref.keys[0].shape[2], ref.keys[0].dtype)

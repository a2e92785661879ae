"""Samplers: token ids in, sampled token ids and their log-probs out.

METHOD.md section 3 asks for the exact ids the policy sampled and the sampler's log-probs, so a
sampler here never returns text that the caller would have to re-tokenise. Two backends share
one protocol::

    sampler.generate(prompts, max_new_tokens, temperature, stop_token_ids, seed) -> list[Sample]

* ``HFSampler(model, tokenizer)``: a Hugging Face causal LM in this process. All prompts are
  decoded together: left padding, an attention mask, position ids counted from each row's first
  real token, one KV cache for the whole batch; rows that stopped are dropped from the cache so
  the batch shrinks as replies end; each row's cache is kept so that the next turn's prompt
  (this one + action + observation) only encodes its new tokens (a prefix cache).
* ``OpenAISampler(base_url, model)``: any OpenAI-compatible ``/v1/completions`` server that
  takes token-id prompts and returns token ids (``vllm serve``, SGLang, or ``minirsi serve``).

Which log-probs. For temperature ``tau > 0`` a token is drawn from
``pi_tau(a | s) = softmax(z / tau)`` where ``z`` are the model's logits, and the log-prob
returned is ``log pi_tau(a | s) = log_softmax(z / tau)[a]``: the *processed* log-prob of the
distribution that was actually sampled (vLLM's ``--logprobs-mode processed_logprobs``). The
trainer must compute its log-probs with the same ``tau`` so that the PPO ratio is 1 on the
first epoch up to numerics. For ``tau == 0`` decoding is greedy (argmax) and the log-prob is
that of the untempered distribution, ``log_softmax(z)[a]``. No top-k / top-p filtering is
applied: it would make the sampled distribution differ from the one the trainer scores.

Stopping: a row ends at the first sampled id in ``stop_token_ids`` (that id is kept as the last
sampled id, ``finish_reason == "stop"``) or after ``max_new_tokens`` ids (``"length"``).

Reproducibility: with a ``seed`` every random draw comes from one ``torch.Generator`` seeded
with it, so the same prompts, batch and seed give the same ids. Across batch compositions the
ids can differ (padding changes float rounding in the logits), so a rollout is reproducible
when its whole schedule is.
"""

from __future__ import annotations

import inspect
import logging
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

logger = logging.getLogger(__name__)

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass
class Sample:
    """One generated reply."""

    token_ids: list[int]
    """The sampled ids, in order; ends with the stop id when ``finish_reason == "stop"``."""
    logprobs: list[float]
    """``log pi_tau(a_t | s_t)`` of each sampled id (see the module docstring)."""
    finish_reason: str
    """``"stop"`` (a stop id was sampled) or ``"length"`` (``max_new_tokens`` reached)."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"Sample has {len(self.token_ids)} token ids but {len(self.logprobs)} log-probs; "
                "the backend must return one log-prob per sampled id"
            )


class Sampler(Protocol):
    """Anything that turns token-id prompts into ``Sample`` replies."""

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        stop_token_ids: list[int],
        seed: int | None = None,
    ) -> list[Sample]: ...


def _check_args(prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0 (0 means greedy decoding)")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token id")


@dataclass
class _Prefix:
    """The KV cache of one context the sampler has already encoded (kept for the next turn)."""

    ids: list[int]
    keys: list[torch.Tensor]  # per layer (n_kv_heads, len(ids), head_dim)
    values: list[torch.Tensor]
    nbytes: int


class HFSampler:
    """Batched sampling from a Hugging Face causal LM with a shared KV cache.

    One call decodes all prompts (in chunks of ``max_batch_size``) together. The model sees a
    left-padded batch: each row's cached prefix (if any) right-aligned in the KV cache, then its
    new tokens right-aligned in the input, an attention mask that hides every pad slot, and
    position ids counted from the row's own first token, so each row is computed as if alone.

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
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        max_batch_size: int | None = None,
        prefix_cache: bool = True,
        max_cache_bytes: int = 2**30,
    ):
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: must be >= 1 or None")
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
            if best_len < n < len(prompt) and prompt[:n] == pre.ids:
                best_key, best_len = key, n
        return None if best_key is None else self._prefixes.pop(best_key)

    def _keep_prefix(self, ids: list[int], cache: Any, row: int, mask: torch.Tensor) -> None:
        """Keep row ``row`` of ``cache`` (its real slots: ``mask``, (S,)) as the cache of ``ids``."""
        if not self.prefix_cache or not ids:
            return
        real = mask.bool()
        keys = [layer.keys[row][:, real, :].clone() for layer in cache.layers]  # (kvh, len, hd)
        values = [layer.values[row][:, real, :].clone() for layer in cache.layers]
        if keys[0].shape[1] != len(ids):  # never expected: drop rather than keep a wrong cache
            logger.warning("prefix cache: %d cached slots for %d ids; not kept", keys[0].shape[1], len(ids))
            return
        nbytes = sum(t.numel() * t.element_size() for t in keys + values)
        self._prefixes[self._next_key] = _Prefix(ids, keys, values, nbytes)
        self._next_key += 1
        total = sum(p.nbytes for p in self._prefixes.values())
        while total > self.max_cache_bytes and self._prefixes:
            total -= self._prefixes.pop(next(iter(self._prefixes))).nbytes

    def _batch_cache(self, hits: list[_Prefix | None], C: int) -> Any:
        """A DynamicCache of C slots per row, each kept prefix right-aligned (zeros elsewhere)."""
        from transformers import DynamicCache

        ref = next(h for h in hits if h is not None)
        try:
            cache = DynamicCache(config=self.model.config)
        except TypeError:  # older transformers: no config argument
            cache = DynamicCache()
        for layer in range(len(ref.keys)):
            kvh, _, hd = ref.keys[layer].shape
            K = ref.keys[layer].new_zeros((len(hits), kvh, C, hd))  # (B, kvh, C, hd)
            V = ref.values[layer].new_zeros((len(hits), kvh, C, hd))
            for i, h in enumerate(hits):
                if h is not None:
                    K[i, :, C - len(h.ids) :] = h.keys[layer]
                    V[i, :, C - len(h.ids) :] = h.values[layer]
            cache.update(K, V, layer)
        return cache

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
        dev = self.device
        B = len(prompts)
        hits = [self._take_prefix(p) if self.prefix_cache else None for p in prompts]
        self.cache_hits += sum(h is not None for h in hits)
        c = [len(h.ids) if h is not None else 0 for h in hits]  # cached tokens per row
        new = [p[ci:] for p, ci in zip(prompts, c)]  # tokens to encode now, >= 1 per row
        C, N = max(c), max(map(len, new))
        # Layout of row i over C + N slots: [pad | cached_i] [pad | new_i], both right-aligned.
        input_ids = torch.full((B, N), self.pad_token_id, dtype=torch.long, device=dev)  # (B, N)
        attention_mask = torch.zeros((B, C + N), dtype=torch.long, device=dev)  # (B, C + N)
        position_ids = torch.zeros((B, N), dtype=torch.long, device=dev)  # (B, N)
        for i, (ci, x) in enumerate(zip(c, new)):
            n = len(x)
            input_ids[i, N - n :] = torch.tensor(x, dtype=torch.long, device=dev)
            attention_mask[i, C - ci : C] = 1
            attention_mask[i, C + N - n :] = 1
            # Positions count the row's own tokens, so a padded row sees what it would alone.
            position_ids[i, N - n :] = torch.arange(ci, ci + n, device=dev)
        stop = torch.tensor(sorted(set(stop_token_ids)) or [-1], dtype=torch.long, device=dev)

        ids: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        finish = [FINISH_LENGTH] * B
        alive = torch.arange(B, device=dev)  # original row index of each row still decoding
        cache = self._batch_cache(hits, C) if C > 0 else None
        step_input, step_pos = input_ids, position_ids
        try:
            for t in range(max_new_tokens):
                out = self.model(
                    input_ids=step_input,
                    attention_mask=attention_mask,
                    position_ids=step_pos,
                    use_cache=True,
                    logits_to_keep=1,
                    **{self._cache_kw: cache},
                )
                cache = getattr(out, self._cache_kw)
                logits = out.logits[:, -1, :].float()  # (b, V)
                if temperature > 0:
                    logp = torch.log_softmax(logits / temperature, dim=-1)  # (b, V)
                    next_ids = torch.multinomial(logp.exp(), 1, generator=generator)  # (b, 1)
                else:
                    logp = torch.log_softmax(logits, dim=-1)
                    next_ids = logp.argmax(dim=-1, keepdim=True)
                next_lp = logp.gather(-1, next_ids).squeeze(-1)  # (b,)
                next_ids = next_ids.squeeze(-1)  # (b,)
                is_stop = torch.isin(next_ids, stop)  # (b,)
                last = t == max_new_tokens - 1
                for j, (row, tok, lp, s) in enumerate(
                    zip(alive.tolist(), next_ids.tolist(), next_lp.tolist(), is_stop.tolist())
                ):
                    ids[row].append(tok)
                    lps[row].append(lp)
                    if s:
                        finish[row] = FINISH_STOP
                    if s or last:  # the cache now holds prompt + ids[:-1]: keep it for next turn
                        self._keep_prefix(prompts[row] + ids[row][:-1], cache, j, attention_mask[j])
                keep = (~is_stop).nonzero().squeeze(-1)  # (b',) rows that go on
                if keep.numel() == 0 or last:
                    break
                step_pos = step_pos[:, -1:] + 1  # (b, 1)
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(alive), 1))], dim=-1)
                step_input = next_ids.unsqueeze(-1)  # (b, 1)
                if keep.numel() < len(alive):  # drop finished rows from the batch and the cache
                    cache.batch_select_indices(keep)
                    alive, attention_mask = alive[keep], attention_mask[keep]
                    step_input, step_pos = step_input[keep], step_pos[keep]
        finally:
            if was_training:
                self.model.train()
        return [Sample(ids[i], lps[i], finish[i]) for i in range(B)]


class OpenAISamplerError(RuntimeError):
    """The completions server could not be reached or answered badly after every retry."""


_TOKEN_ID_RE = re.compile(r"^token_id:(-?\d+)$")


class OpenAISampler:
    """Sampling through an OpenAI-compatible ``/v1/completions`` endpoint.

    The request sends the prompts as lists of token ids (one request per ``generate`` call, all
    prompts in it, so the server can batch them) and asks for the token ids back through vLLM's
    extensions: ``return_token_ids`` (each choice carries ``token_ids``) and
    ``return_tokens_as_token_ids`` (``logprobs.tokens`` reads ``"token_id:123"``, the fallback
    for servers without the first). ``logprobs=0`` returns the sampled token's log-prob only.
    Start vLLM with ``--logprobs-mode processed_logprobs`` so its log-probs are those of the
    tempered distribution, as ``HFSampler`` returns (the module docstring).

    Args:
        base_url: e.g. ``http://127.0.0.1:8000`` (with or without a trailing ``/v1``).
        model: the served model name sent in each request.
        timeout: seconds for one HTTP request.
        max_retries: retries after a connection error, a timeout, 429 or a 5xx answer, with
            exponential backoff (``backoff * 2**attempt`` seconds, jittered).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        timeout: float = 600.0,
        max_retries: int = 5,
        backoff: float = 0.5,
        api_key: str | None = None,
    ):
        import requests  # imported here so the HF path does not need it

        base = base_url.rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise ValueError(f"base_url={base_url!r}: must start with http:// or https://")
        self.url = (base if base.endswith("/v1") else base + "/v1") + "/completions"
        self.model = model
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self._session = requests.Session()
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"

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
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": [list(map(int, p)) for p in prompts],
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": 1.0,
            "n": 1,
            "logprobs": 0,
            "stop_token_ids": list(stop_token_ids),
            "ignore_eos": False,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        if seed is not None:
            body["seed"] = int(seed)
        data = self._post(body)
        choices = sorted(data.get("choices", []), key=lambda c: c.get("index", 0))
        if len(choices) != len(prompts):
            raise OpenAISamplerError(
                f"{self.url}: sent {len(prompts)} prompts, got {len(choices)} choices back"
            )
        return [self._parse_choice(c, self.url) for c in choices]

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        import requests

        last = ""
        for attempt in range(self.max_retries + 1):
            try:
                r = self._session.post(self.url, json=body, timeout=self.timeout)
            except (requests.ConnectionError, requests.Timeout) as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200:
                    return r.json()
                last = f"HTTP {r.status_code}: {r.text[:500]}"
                if r.status_code != 429 and r.status_code < 500:
                    # A 4xx other than rate limiting will not get better by retrying.
                    raise OpenAISamplerError(f"{self.url} rejected the request: {last}")
            if attempt < self.max_retries:
                delay = self.backoff * (2**attempt) * (0.5 + random.random())
                logger.warning("%s: %s; retry %d/%d in %.1fs", self.url, last, attempt + 1, self.max_retries, delay)
                time.sleep(delay)
        raise OpenAISamplerError(f"{self.url}: gave up after {self.max_retries + 1} attempts; last error: {last}")

    @staticmethod
    def _parse_choice(choice: dict[str, Any], url: str) -> Sample:
        lp = choice.get("logprobs") or {}
        token_logprobs = lp.get("token_logprobs")
        if token_logprobs is None:
            raise OpenAISamplerError(f"{url}: the answer has no logprobs.token_logprobs; the server must support 'logprobs'")
        ids = choice.get("token_ids")
        if ids is None:  # servers without return_token_ids: parse "token_id:123" strings
            ids = []
            for tok in lp.get("tokens") or []:
                m = _TOKEN_ID_RE.match(str(tok))
                if m is None:
                    raise OpenAISamplerError(
                        f"{url}: token {tok!r} is not 'token_id:N'; the server must support "
                        "return_token_ids or return_tokens_as_token_ids (vLLM >= 0.10)"
                    )
                ids.append(int(m.group(1)))
        finish = choice.get("finish_reason") or FINISH_LENGTH
        return Sample([int(t) for t in ids], [float(x) for x in token_logprobs], finish)

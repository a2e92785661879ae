"""Samplers: token ids in, sampled token ids and their log-probs out.

METHOD.md section 3 asks for the exact ids the policy sampled and the sampler's log-probs, so a
sampler here never returns text that the caller would have to re-tokenise. Two backends share
one protocol::

    sampler.generate(prompts, max_new_tokens, temperature, stop_token_ids, seed) -> list[Sample]

* ``HFSampler(model, tokenizer)``: a Hugging Face causal LM in this process. All prompts are
  decoded together: left padding, an attention mask, position ids counted from each row's first
  real token, one KV cache for the whole batch; rows that stopped are dropped from the cache so
  the batch shrinks as replies end.
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


class HFSampler:
    """Batched sampling from a Hugging Face causal LM with a shared KV cache.

    Args:
        model: a ``PreTrainedModel`` with a causal-LM head (``AutoModelForCausalLM``).
        tokenizer: its tokenizer; only ``pad_token_id`` / ``eos_token_id`` are read (the pad id
            fills left padding, which the attention mask hides, so its value never matters).
        max_batch_size: prompts are decoded in chunks of at most this many rows (None: all).
    """

    def __init__(self, model: Any, tokenizer: Any = None, max_batch_size: int | None = None):
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size}: must be >= 1 or None")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
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
            chunk = prompts[start : start + size]
            out += self._generate_batch(chunk, max_new_tokens, temperature, stop_token_ids, generator)
        return out

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
        L = max(len(p) for p in prompts)
        input_ids = torch.full((B, L), self.pad_token_id, dtype=torch.long, device=dev)  # (B, L)
        attention_mask = torch.zeros((B, L), dtype=torch.long, device=dev)  # (B, L)
        for i, p in enumerate(prompts):  # left padding: every row's last real token is at L - 1
            input_ids[i, L - len(p) :] = torch.tensor(p, dtype=torch.long, device=dev)
            attention_mask[i, L - len(p) :] = 1
        # Positions count real tokens only, so a left-padded row sees the same positions as
        # it would alone; pad slots get 0 (they are masked out anyway).
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, L)
        stop = torch.tensor(sorted(set(stop_token_ids)) or [-1], dtype=torch.long, device=dev)

        ids: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        finish = [FINISH_LENGTH] * B
        alive = torch.arange(B, device=dev)  # original row index of each row still decoding
        cache = None
        step_input, step_pos = input_ids, position_ids
        try:
            for _ in range(max_new_tokens):
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
                for row, tok, lp, s in zip(alive.tolist(), next_ids.tolist(), next_lp.tolist(), is_stop.tolist()):
                    ids[row].append(tok)
                    lps[row].append(lp)
                    if s:
                        finish[row] = FINISH_STOP
                keep = (~is_stop).nonzero().squeeze(-1)  # (b',) rows that go on
                if keep.numel() == 0:
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

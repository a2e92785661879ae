"""``OpenAISampler``: one or several OpenAI-compatible ``/v1/completions`` servers, each episode
pinned to one, dead servers named (minirsi.engine.sampler's docstring)."""

from __future__ import annotations

import logging
import random
import re
import time
from typing import Any, Sequence

from minirsi.engine.sampler.base import FINISH_LENGTH, Sample, _check_args

logger = logging.getLogger(__name__)

_JITTER = random.Random()
"""The retry backoff's jitter: its own generator, so that how often a server failed (timing)
never moves the run's seeded ``random`` stream (``rundir.seed_everything``, saved in rng.pt)."""


class OpenAISamplerError(RuntimeError):
    """The completions server could not be reached or answered badly after every retry."""


class ServerDown(OpenAISamplerError):
    """A server stopped answering (connection refused or reset, timeout, 5xx after every retry)."""

    def __init__(self, server: str, message: str):
        super().__init__(message)
        self.server = server


_TOKEN_ID_RE = re.compile(r"^token_id:(-?\d+)$")
FULL_DISTRIBUTION = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                     "frequency_penalty": 0.0}
"""Every sampling field vLLM would otherwise take from the model's generation_config.json
(Qwen3's: top_k 20, top_p 0.95), at the value that leaves softmax(z / tau) whole: the
distribution the trainer scores (``OpenAISampler``)."""
ON_SERVER_FAILURE = ("fail", "retry")


def server_base(url: str) -> str:
    """``http://host:port[/v1][/]`` -> ``http://host:port``: a server's name in every message."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"server URL {url!r}: must start with http:// or https://")
    return base[: -len("/v1")] if base.endswith("/v1") else base


class OpenAISampler:
    """Sampling through one or more OpenAI-compatible ``/v1/completions`` endpoints.

    The request sends the prompts as lists of token ids and asks for the token ids back through
    vLLM's extensions: ``return_token_ids`` (each choice carries ``token_ids``) and
    ``return_tokens_as_token_ids`` (``logprobs.tokens`` reads ``"token_id:123"``, the fallback
    for servers without the first). ``logprobs=0`` returns the sampled token's log-prob only.
    Start vLLM with ``--logprobs-mode processed_logprobs`` so its log-probs are those of the
    tempered distribution, as ``HFSampler`` returns (the module docstring).

    Every sampling field is sent (``FULL_DISTRIBUTION``): vLLM fills a field a request leaves
    out from the model's generation_config.json (``CompletionRequest.to_sampling_params``,
    vLLM 0.11 and 0.33; ``scale/serving/vllm_recorded.json`` lists the fields), so Qwen3 would
    sample top-20 and return log-probs of that truncated distribution while PPO scores the full
    softmax. ``ignore_eos`` keeps vLLM from adding generation_config.json's eos ids to the
    stop ids (``SamplingParams.update_from_generation_config``): a reply ends at
    ``stop_token_ids`` or ``max_new_tokens``, as in ``HFSampler``. (``scale/serve_vllm.sh``
    also starts vLLM with ``--generation-config vllm``, which drops the sampling defaults but
    not the eos ids.)

    Several servers. A ``generate`` call splits its prompts over the servers and sends one
    request to each, concurrently. A prompt that extends a context this sampler produced
    before (an earlier prompt plus the ids sampled for it: the next turn of the same episode)
    goes to the server that produced it, so that server's prefix cache holds all but the new
    observation; new prompts go to the server with the fewest prompts in this call. A kept
    context is used once (an episode has one next turn); ``clear_cache()`` forgets them all
    (``rollout.collect`` calls it at its start and end). With a ``seed``, server i is sent
    ``seed + i``, so that two servers given the same prompt do not draw the same ids, and a
    prompt repeated in one call (a task sampled k times) goes out in k requests with their own
    seeds: vLLM seeds each prompt of a request alike, so repeats in one request would draw the
    same reply.

    A server that stops answering (after ``max_retries``) is reported by its URL, logged, and
    never used again by this sampler; then ``on_server_failure`` decides: ``"fail"`` raises
    ``ServerDown`` naming it (the other servers' replies of that call are dropped with the
    step), ``"retry"`` sends its prompts to the servers still up (their prefix caches start
    cold) and raises only when none is left. A call never returns fewer samples than prompts.

    Args:
        base_url: one URL or a list, e.g. ``http://127.0.0.1:8000`` (with or without ``/v1``).
        model: the served model name sent in each request (a LoRA sync changes it to the
            adapter's name, ``weight_sync.WeightSync``).
        timeout: seconds for one HTTP request.
        max_retries: retries after a connection error, a timeout, 429 or a 5xx answer, with
            exponential backoff (``backoff * 2**attempt`` seconds, jittered).
        on_server_failure: ``"fail"`` or ``"retry"`` (above).
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        model: str,
        timeout: float = 600.0,
        max_retries: int = 5,
        backoff: float = 0.5,
        api_key: str | None = None,
        on_server_failure: str = "fail",
    ):
        import requests  # imported here so the HF path does not need it

        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("OpenAISampler needs at least one server URL")
        self.servers = [server_base(u) for u in urls]
        if len(set(self.servers)) != len(self.servers):
            raise ValueError(f"server URLs {self.servers}: each server must be listed once")
        if on_server_failure not in ON_SERVER_FAILURE:
            raise ValueError(f"on_server_failure={on_server_failure!r}: use one of {ON_SERVER_FAILURE}")
        self.url = self.servers[0] + "/v1/completions"
        self.model = model
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.on_server_failure = on_server_failure
        self.down: dict[str, str] = {}
        """Servers that stopped answering -> the last error; never sent to again."""
        self.sent: dict[str, int] = {s: 0 for s in self.servers}
        """Prompts each server answered (tests and logs read it)."""
        self.pinned = 0
        """Prompts that went to the server holding their episode's earlier turns."""
        self._contexts: list[tuple[list[int], str]] = []  # (prompt + sampled ids, server), oldest first
        self._sessions = {}
        for server in self.servers:
            self._sessions[server] = requests.Session()  # one per server: calls run in threads
            if api_key:
                self._sessions[server].headers["Authorization"] = f"Bearer {api_key}"

    @property
    def live_servers(self) -> list[str]:
        return [s for s in self.servers if s not in self.down]

    def clear_cache(self) -> None:
        """Forget which server holds which context (the servers' caches die with the weights)."""
        self._contexts.clear()

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
        out: list[Sample | None] = [None] * len(prompts)
        served: dict[int, str] = {}  # prompt index -> the server that answered it
        pending = list(range(len(prompts)))
        route = self._route(prompts)
        while pending:
            live = self.live_servers
            if not live:
                raise OpenAISamplerError(f"every server is down: {self.down}")
            by_server: dict[str, list[int]] = {}
            for i in pending:
                server = route.get(i)
                if server not in live:  # a new prompt, or its server died: the least loaded live one
                    server = min(live, key=lambda s: (len(by_server.get(s, [])), live.index(s)))
                by_server.setdefault(server, []).append(i)
            pending = self._send(by_server, prompts, out, served, max_new_tokens, temperature, stop_token_ids, seed)
        for i, (p, s) in enumerate(zip(prompts, out)):
            self._contexts.append((list(p) + s.token_ids, served[i]))
            self.sent[served[i]] += 1
            self.pinned += route.get(i) == served[i]
        del self._contexts[: max(0, len(self._contexts) - 65536)]  # bounded: oldest dropped first
        return out  # type: ignore[return-value]

    def _route(self, prompts: list[list[int]]) -> dict[int, str]:
        """Prompt index -> the server that produced the longest kept context it extends."""
        route = {}
        for i, p in enumerate(prompts):
            best, best_len = None, 0
            for j, (ctx, _) in enumerate(self._contexts):
                n = len(ctx)
                if best_len < n <= len(p) and p[n - 1] == ctx[-1] and p[:n] == ctx:
                    best, best_len = j, n
            if best is not None:
                route[i] = self._contexts.pop(best)[1]
        return route

    def _send(self, by_server: dict[str, list[int]], prompts: list[list[int]], out: list[Sample | None],
              served: dict[int, str], max_new_tokens: int, temperature: float, stop_token_ids: list[int],
              seed: int | None) -> list[int]:
        """One request per server, concurrently; fills ``out``; returns the prompts still to do.

        With a seed, a request never holds the same prompt twice (repeats go to further
        requests, each with its own seed): vLLM seeds every prompt of a request alike, so
        repeats of one prompt in one request would draw the same reply."""
        from concurrent.futures import ThreadPoolExecutor

        jobs: list[tuple[str, list[int], int | None]] = []  # (server, prompt indices, seed)
        for server, idx in by_server.items():
            rounds: list[list[int]] = []
            if seed is None:
                rounds = [idx]
            else:
                seen: dict[tuple[int, ...], int] = {}
                for i in idx:
                    k = seen[tuple(prompts[i])] = seen.get(tuple(prompts[i]), -1) + 1
                    if k == len(rounds):
                        rounds.append([])
                    rounds[k].append(i)
            for r, part in enumerate(rounds):
                s = None if seed is None else int(seed) + self.servers.index(server) + 1_000_003 * r
                jobs.append((server, part, s))

        def call(server: str, idx: list[int], s: int | None) -> list[Sample]:
            return self._complete(server, [prompts[i] for i in idx], max_new_tokens, temperature, stop_token_ids, s)

        with ThreadPoolExecutor(len(jobs), thread_name_prefix="openai-sampler") as pool:
            futures = [(server, idx, pool.submit(call, server, idx, s)) for server, idx, s in jobs]
        failed: list[int] = []
        errors: dict[str, ServerDown] = {}
        for server, idx, fut in futures:
            try:
                samples = fut.result()
            except ServerDown as e:
                errors.setdefault(server, e)
                failed += idx
                continue
            for i, smp in zip(idx, samples):
                out[i], served[i] = smp, server
        for server, e in errors.items():
            self.down[server] = str(e)
            logger.error("server %s stopped answering (%d prompts on it): %s", server, len(by_server[server]), e)
        if errors and self.on_server_failure == "fail":
            raise ServerDown(next(iter(errors)), f"server {', '.join(errors)} stopped answering ({len(failed)} prompts "
                             "were on it; on_server_failure='retry' would move them to the servers still up): "
                             + "; ".join(str(e) for e in errors.values()))
        if errors:
            logger.warning("moving %d prompts to the servers still up: %s", len(failed), self.live_servers)
        return failed

    def _complete(self, server: str, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                  stop_token_ids: list[int], seed: int | None) -> list[Sample]:
        url = server + "/v1/completions"
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": [list(map(int, p)) for p in prompts],
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            **FULL_DISTRIBUTION,
            "n": 1,
            "logprobs": 0,
            "stop_token_ids": list(stop_token_ids),
            "ignore_eos": True,  # stop at stop_token_ids only, not also at generation_config.json's eos ids
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        if seed is not None:
            body["seed"] = int(seed)
        data = self._post(body, server)
        choices = sorted(data.get("choices", []), key=lambda c: c.get("index", 0))
        if len(choices) != len(prompts):
            raise OpenAISamplerError(f"{url}: sent {len(prompts)} prompts, got {len(choices)} choices back")
        return [self._parse_choice(c, url) for c in choices]

    def _post(self, body: dict[str, Any], server: str | None = None) -> dict[str, Any]:
        import requests

        server = server or self.servers[0]
        url = server + "/v1/completions"
        last = ""
        for attempt in range(self.max_retries + 1):
            try:
                r = self._sessions[server].post(url, json=body, timeout=self.timeout)
            except (requests.ConnectionError, requests.Timeout) as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200:
                    return r.json()
                last = f"HTTP {r.status_code}: {r.text[:500]}"
                if r.status_code != 429 and r.status_code < 500:
                    # A 4xx other than rate limiting will not get better by retrying.
                    raise OpenAISamplerError(f"{url} rejected the request: {last}")
            if attempt < self.max_retries:
                delay = self.backoff * (2**attempt) * (0.5 + _JITTER.random())
                logger.warning("%s: %s; retry %d/%d in %.1fs", url, last, attempt + 1, self.max_retries, delay)
                time.sleep(delay)
        raise ServerDown(server, f"{url}: gave up after {self.max_retries + 1} attempts; last error: {last}")

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

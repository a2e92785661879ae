"""Samplers: exact ids and processed log-probs, batching, seeds, and the OpenAI round trip."""

from __future__ import annotations

import logging
import socket

import pytest
import torch

from minirsi.engine.models import IM_END, build_tiny_actor, build_tokenizer, token_logprobs
from minirsi.engine.sampler import HFSampler, OpenAISampler, OpenAISamplerError, Sample
from minirsi.engine.sampler.hf import _draw, _prefill_groups
from minirsi.engine.serve import CompletionServer, start_in_thread

logger = logging.getLogger(__name__)

CORPUS = ["ls -la /app\ncat notes.txt | grep error\n", "echo hello > out.txt && wc -l out.txt\n"] * 20

# Log-probs of the same ids from the sampler's incremental (KV-cache, left-padded) decode and
# from one full training forward pass differ only by float32 rounding; 1e-4 is ~100x what we
# see on CPU (a few 1e-7), far below the paper's 5e-3 bf16 vLLM-vs-trainer gap.
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CORPUS, vocab_size=300)


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_actor(tok, seed=0).eval()


@pytest.fixture(scope="module")
def sampler(model, tok):
    return HFSampler(model, tok)


def _prompts(tok):
    texts = ["<|im_start|>user\nlist files<|im_end|>\n<|im_start|>assistant\n", "cat out.txt", "x"]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def test_seeded_sampling_is_reproducible_and_seed_dependent(sampler, tok):
    prompts = _prompts(tok)
    a = sampler.generate(prompts, 16, 1.0, [], seed=7)
    b = sampler.generate(prompts, 16, 1.0, [], seed=7)
    c = sampler.generate(prompts, 16, 1.0, [], seed=8)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert [s.logprobs for s in a] == [s.logprobs for s in b]
    assert [s.token_ids for s in a] != [s.token_ids for s in c]
    assert all(len(s.token_ids) == 16 and s.finish_reason == "length" for s in a)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_training_forward_pass(model, sampler, tok, temperature):
    prompts = _prompts(tok)
    samples = sampler.generate(prompts, 24, temperature, [], seed=1)
    gaps = []
    for p, s in zip(prompts, samples):
        ids = torch.tensor([p + s.token_ids])  # (1, T)
        with torch.no_grad():
            lp = token_logprobs(model, ids, temperature=temperature)[0, len(p) :]  # (n,)
        gaps.append((lp - torch.tensor(s.logprobs)).abs())
    gap = torch.cat(gaps)
    logger.info("sampler vs trainer log-prob gap at tau=%s: mean %.3e max %.3e", temperature, gap.mean(), gap.max())
    assert gap.max().item() < LOGPROB_TOL


def test_batched_greedy_equals_one_prompt_at_a_time(sampler, tok):
    """Left padding, the attention mask and position ids leave each row's decode unchanged."""
    prompts = _prompts(tok)
    batched = sampler.generate(prompts, 20, 0.0, [])
    for p, s in zip(prompts, batched):
        alone = sampler.generate([p], 20, 0.0, [])[0]
        assert alone.token_ids == s.token_ids
        assert alone.logprobs == pytest.approx(s.logprobs, abs=LOGPROB_TOL)


def test_stop_token_ends_its_row_only_and_is_kept(sampler, tok):
    prompts = _prompts(tok)
    free = sampler.generate(prompts, 12, 0.0, [])
    stop_id = free[0].token_ids[3]  # greedy row 0 will sample this id at step 3 (or earlier)
    first = free[0].token_ids.index(stop_id)
    stopped = sampler.generate(prompts, 12, 0.0, [stop_id])
    assert stopped[0].token_ids == free[0].token_ids[: first + 1]
    assert stopped[0].token_ids[-1] == stop_id and stopped[0].finish_reason == "stop"
    for f, s in zip(free[1:], stopped[1:]):  # other rows run on until their own stop
        expect = f.token_ids[: f.token_ids.index(stop_id) + 1] if stop_id in f.token_ids else f.token_ids
        assert s.token_ids == expect


def test_prefill_groups_pay_padding_against_calls():
    # Rows sorted longest first. One call of all six: 32 + 6 x 55 = 362 token-costs; two calls
    # [55, 40] + [29, 29, 14, 14]: (32 + 2 x 55) + (32 + 4 x 29) = 290, the minimum.
    assert _prefill_groups([55, 40, 29, 29, 14, 14], 32) == [(0, 2), (2, 6)]
    assert _prefill_groups([5, 5, 5], 0) == [(0, 3)]  # equal lengths: no padding to save
    assert _prefill_groups([9, 3], 0) == [(0, 1), (1, 2)]  # free calls: never pad
    assert _prefill_groups([9, 3], 100) == [(0, 2)]  # dear calls: always one


def test_draw_follows_the_distribution_and_never_draws_probability_zero():
    p = torch.tensor([0.5, 0.0, 0.3, 0.2])
    ids = _draw(p.log().expand(20000, 4), torch.Generator().manual_seed(0)).squeeze(-1)  # (20000,)
    freq = torch.bincount(ids, minlength=4).float() / len(ids)
    assert freq[1] == 0
    assert torch.allclose(freq, p, atol=0.015)  # ~4 standard errors (sqrt(0.25 / 20000) = 0.0035)


def test_prefill_in_groups_changes_nothing(model, tok):
    """prefill_call_tokens=0 prefills each distinct new length in its own call (prefix hits
    included); the ids and log-probs are those of one padded call."""
    grouped, single = HFSampler(model, tok, prefill_call_tokens=0), HFSampler(model, tok, prefill_call_tokens=10**6)
    prompts = _prompts(tok) + [_prompts(tok)[0][:5]]
    for turn in range(2):
        a = grouped.generate(prompts, 10, 0.0, [])
        b = single.generate(prompts, 10, 0.0, [])
        assert [s.token_ids for s in a] == [s.token_ids for s in b]
        for x, y in zip(a, b):
            assert x.logprobs == pytest.approx(y.logprobs, abs=LOGPROB_TOL)
        prompts = [p + s.token_ids + [7] * (k + 1) for k, (p, s) in enumerate(zip(prompts, a))]
    assert grouped.cache_hits == single.cache_hits == 4


def test_chunked_batches_give_the_same_greedy_ids(model, tok, sampler):
    prompts = _prompts(tok)
    one = HFSampler(model, tok, max_batch_size=1).generate(prompts, 10, 0.0, [])
    assert [s.token_ids for s in one] == [s.token_ids for s in sampler.generate(prompts, 10, 0.0, [])]


def test_prefix_cache_continues_turns_exactly(model, tok):
    """Turn 2 from kept KV caches (only the new tokens encoded) == turn 2 encoded from scratch.

    Rows mix cache hits of different lengths with a brand-new prompt (no hit)."""
    cached = HFSampler(model, tok)
    fresh = HFSampler(model, tok, prefix_cache=False)
    prompts = _prompts(tok)
    first = cached.generate(prompts, 12, 0.0, [])
    obs = [tok.encode(t, add_special_tokens=False) for t in ["\nok", "\n[exit 1] error: no such file", "\n."]]
    turn2 = [p + s.token_ids + o for p, s, o in zip(prompts, first, obs)] + [prompts[2] + [5, 6]]
    assert cached.cache_hits == 0
    a = cached.generate(turn2, 12, 0.0, [])
    assert cached.cache_hits == 3  # the three continued contexts; the new prompt had no prefix
    b = fresh.generate(turn2, 12, 0.0, [])
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=LOGPROB_TOL)
    cached.clear_cache()
    cached.generate(turn2, 4, 0.0, [])
    assert cached.cache_hits == 3, "a cleared cache has nothing to reuse"


def test_prefix_cache_memory_bound(model, tok):
    tiny_budget = HFSampler(model, tok, max_cache_bytes=1)
    tiny_budget.generate(_prompts(tok), 4, 0.0, [])
    assert tiny_budget._prefixes == {}


@pytest.mark.parametrize(
    "kwargs",
    [dict(max_new_tokens=0, temperature=1.0), dict(max_new_tokens=4, temperature=-0.1)],
)
def test_bad_arguments_are_value_errors(sampler, tok, kwargs):
    with pytest.raises(ValueError):
        sampler.generate(_prompts(tok), stop_token_ids=[], **kwargs)
    with pytest.raises(ValueError, match="empty"):
        sampler.generate([[]], 4, 1.0, [])


def test_sample_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="log-probs"):
        Sample([1, 2], [0.0], "length")


# ---------------------------------------------------------------- OpenAI-compatible round trip


@pytest.fixture(scope="module")
def server(sampler, tok):
    srv = CompletionServer(sampler, tok, "tiny", "127.0.0.1", 0)  # port 0: a free port
    start_in_thread(srv)
    yield srv
    srv.shutdown()
    srv.server_close()


def test_openai_sampler_agrees_with_hf_sampler(server, sampler, tok):
    client = OpenAISampler(server.url, "tiny", timeout=60, max_retries=0)
    prompts = _prompts(tok)
    stop = [tok.convert_tokens_to_ids(IM_END)]
    for temperature, seed in [(0.0, None), (1.0, 3)]:
        local = sampler.generate(prompts, 16, temperature, stop, seed=seed)
        remote = client.generate(prompts, 16, temperature, stop, seed=seed)
        assert [s.token_ids for s in remote] == [s.token_ids for s in local]
        assert [s.finish_reason for s in remote] == [s.finish_reason for s in local]
        for r, s in zip(remote, local):
            assert r.logprobs == pytest.approx(s.logprobs, abs=1e-6)


def test_server_speaks_vllm_token_id_fields(server, tok):
    import requests

    body = {"model": "tiny", "prompt": _prompts(tok)[0], "max_tokens": 5, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True, "return_token_ids": True}
    choice = requests.post(server.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert choice["prompt_token_ids"] == _prompts(tok)[0]
    # A server without return_token_ids: the client falls back to the "token_id:N" strings.
    del choice["token_ids"]
    parsed = OpenAISampler._parse_choice(choice, "test")
    assert parsed.token_ids == [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    bad = requests.post(server.url + "/v1/completions", json={"prompt": 5}, timeout=30)
    assert bad.status_code == 400 and "prompt" in bad.json()["error"]["message"]


def test_client_errors_are_not_retried_and_dead_servers_give_up(server):
    with pytest.raises(OpenAISamplerError, match="rejected"):
        OpenAISampler(server.url, "tiny", max_retries=3, backoff=5.0)._post({"prompt": 5})  # 400
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = OpenAISampler(f"http://127.0.0.1:{port}", "tiny", timeout=2, max_retries=2, backoff=0.01)
    with pytest.raises(OpenAISamplerError, match="gave up after 3 attempts"):
        dead.generate([[1, 2]], 4, 1.0, [])


@pytest.mark.slow
def test_serve_cli_subprocess_round_trip(model, tok, sampler, tmp_path):
    """`minirsi serve --port 0` prints its URL; OpenAISampler gets the in-process greedy ids."""
    import os
    import subprocess
    import sys

    from minirsi.engine.models import save_actor

    save_actor(model, tok, tmp_path / "model")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "minirsi.cli", "serve", "--model", str(tmp_path / "model"), "--port", "0",
           "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()  # "minirsi serve: http://127.0.0.1:PORT/v1/completions (model tiny)"
        assert line.startswith("minirsi serve: http://"), line
        url = line.split()[2].rsplit("/v1/", 1)[0]
        stop = [tok.convert_tokens_to_ids(IM_END)]  # the server always stops at eos, like vLLM
        remote = OpenAISampler(url, "tiny", timeout=60, max_retries=0).generate(_prompts(tok), 8, 0.0, stop)
        local = sampler.generate(_prompts(tok), 8, 0.0, stop)
        assert [s.token_ids for s in remote] == [s.token_ids for s in local]
    finally:
        proc.terminate()
        proc.wait(timeout=30)

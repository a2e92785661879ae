"""Rollouts from several servers, weight sync (full and LoRA), the vLLM worker extension.

The fast tests run ``minirsi serve``'s ``CompletionServer`` in threads on 127.0.0.1; the slow
ones start real ``minirsi serve`` processes (loopback, port 0) and always stop them
(``_Proc.stop``: terminate, then kill after 10 s).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minirsi.engine.models import LoraSettings, attach_lora, build_tiny_actor, build_tokenizer, save_actor, token_logprobs
from minirsi.engine.rollout import collect
from minirsi.engine.sampler import HFSampler, OpenAISampler, ServerDown
from minirsi.engine.serve import CompletionServer, start_in_thread
from minirsi.engine.weight_sync import (RELOAD_METHOD, WeightSync, WeightSyncError, read_full_weights,
                                 server_prompt_logprobs, write_full_weights)
from test_rollout import Sandboxes, cfg, fake_verify, model, tasks, tok  # noqa: F401  (model, tok: fixtures)

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-4  # fp32 on CPU: server and trainer differ by float rounding only (~1e-6)


@pytest.fixture()
def servers(model, tok):
    """Start in-thread servers, each on its own copy of ``model``: ``servers(n, enable_lora)``."""
    started = []

    def start(n: int = 2, enable_lora: bool = False, base=None) -> list[CompletionServer]:
        for _ in range(n):
            m = copy.deepcopy(base if base is not None else model)
            srv = CompletionServer(HFSampler(m, tok), tok, "policy", "127.0.0.1", 0, enable_lora=enable_lora)
            start_in_thread(srv)
            started.append(srv)
        return started[-n:]

    yield start
    for srv in started:
        srv.shutdown()
        srv.server_close()


def _probe(tok) -> list[int]:
    return tok.encode("<|im_start|>user\nls -la /app && cat notes.txt<|im_end|>\n", add_special_tokens=False)


def _trainer_logprobs(actor, ids) -> list[float]:
    with torch.no_grad():
        return token_logprobs(actor.eval(), torch.tensor([ids]))[0, 1:].tolist()


def _perturb(params, seed: int, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=g))


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


# ---------------------------------------------------------------- several servers


def test_episodes_spread_over_servers_and_stay_pinned(servers, tok):
    a, b = servers(2)
    sampler = OpenAISampler([a.url, b.url + "/v1"], "policy", max_retries=0)
    after_call = []  # sampler.sent after each generate call: the first one holds every episode's first turn
    generate = sampler.generate
    sampler.generate = lambda *args, **kw: (generate(*args, **kw), after_call.append(dict(sampler.sent)))[0]
    eps = collect(tasks(6), sampler, tok, cfg(max_turns=3, concurrency=6), progress=False,
                  open_sandbox=Sandboxes(), verify=fake_verify)
    assert len(eps) == 6
    assert sampler.sent[a.url] > 0 and sampler.sent[b.url] > 0
    prompts = sum(e.turns for e in eps)
    # Every turn after an episode's first went to the server that served its earlier turns, and
    # that server's prefix cache held them (it could not if the turn had gone elsewhere).
    assert sampler.pinned == prompts - len(eps) > 0
    assert a.sampler.cache_hits + b.sampler.cache_hits == sampler.pinned
    # The 6 new episodes were split 3 and 3 at turn 1 (later turns follow their episode, so the
    # totals depend on how long each episode ran, not on the balance).
    assert after_call[0] == {a.url: 3, b.url: 3}


def test_seeds_differ_between_servers(servers, tok):
    a, b = servers(2)
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)
    s = OpenAISampler([a.url, b.url], "policy", max_retries=0).generate([prompt, prompt], 16, 1.0, [], seed=3)
    assert s[0].token_ids != s[1].token_ids  # same prompt, same call seed, one on each server


class _PerPromptSeeds:
    """A sampler that, like vLLM, seeds every prompt of a request alike: repeats of one prompt
    in one request would come back identical."""

    def __init__(self, inner: HFSampler):
        self.inner, self.model, self.requests = inner, inner.model, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompts, max_new_tokens, temperature, stop_token_ids, seed=None):
        self.requests += 1
        return [self.inner.generate([p], max_new_tokens, temperature, stop_token_ids, seed=seed)[0] for p in prompts]


def test_repeated_prompts_get_their_own_seeds(model, tok):
    srv = CompletionServer(_PerPromptSeeds(HFSampler(copy.deepcopy(model), tok)), tok, "policy", "127.0.0.1", 0)
    start_in_thread(srv)
    try:
        p, q = _probe(tok), tok.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)
        out = OpenAISampler([srv.url], "policy", max_retries=0).generate([p, q, p, p], 12, 1.0, [], seed=4)
    finally:
        srv.shutdown()
        srv.server_close()
    assert len({tuple(out[i].token_ids) for i in (0, 2, 3)}) == 3  # three copies, three draws
    assert srv.sampler.requests == 3  # [p, q], [p], [p]: no request holds a prompt twice


class _Killer(Sandboxes):
    """Sandboxes that stop ``victim`` (a callable) when the ``at``-th sandbox opens: new episodes
    are admitted only after earlier ones finished, so some are complete by then."""

    def __init__(self, at: int, victim):
        super().__init__()
        self.at, self.victim, self.fired = at, victim, False

    def __call__(self, task, backend):
        if len(self.opened) + 1 == self.at and not self.fired:
            self.fired = True
            self.victim()
        return super().__call__(task, backend)


def _stop_in_thread(srv: CompletionServer):
    """Stop an in-thread server: no new connections, and a client's kept-alive connection (its
    handler thread lives on) gets 500s, as from a server whose engine died."""

    def dead(*args, **kwargs):
        raise RuntimeError("engine dead")

    def stop():
        srv.shutdown()
        srv.server_close()
        srv.complete = srv.collective_rpc = dead
    return stop


def test_dead_server_is_named_and_finished_episodes_are_kept(servers, tok, tmp_path):
    a, b = servers(2)
    sampler = OpenAISampler([a.url, b.url], "policy", max_retries=1, backoff=0.01)  # on_server_failure="fail"
    out = tmp_path / "eps.jsonl"
    with pytest.raises(ServerDown, match=f"server {a.url}.*stopped answering") as err:
        collect(tasks(6), sampler, tok, cfg(max_turns=2, concurrency=2), out_path=out, progress=False,
                open_sandbox=_Killer(3, _stop_in_thread(a)), verify=fake_verify)
    assert err.value.server == a.url and a.url in sampler.down
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(kept) >= 2 and all(len(e["token_ids"]) > 0 for e in kept)  # the first two, complete


def test_dead_server_episodes_move_to_the_others_and_none_is_shortened(servers, tok):
    a, b = servers(2)
    sampler = OpenAISampler([a.url, b.url], "policy", max_retries=1, backoff=0.01, on_server_failure="retry")
    eps = collect(tasks(6), sampler, tok, cfg(max_turns=2, concurrency=2), progress=False,
                  open_sandbox=_Killer(3, _stop_in_thread(a)), verify=fake_verify)
    assert len(eps) == 6 and list(sampler.down) == [a.url]
    assert all(e.stop_reason in ("max_turns", "done") and e.error is None for e in eps)
    assert sampler.sent[b.url] > sampler.sent[a.url]


def test_every_server_down_is_an_error_naming_them(servers, tok):
    (a,) = servers(1)
    sampler = OpenAISampler([a.url], "policy", max_retries=0, on_server_failure="retry")
    _stop_in_thread(a)()
    with pytest.raises(Exception, match=a.url):
        sampler.generate([[1, 2, 3]], 4, 1.0, [])


def test_retries_leave_the_runs_seeded_random_stream_alone():
    import random
    import socket

    with socket.socket() as s:  # a port nothing listens on: every attempt is refused
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    random.seed(0)
    expected = random.Random(0).random()
    with pytest.raises(ServerDown):
        OpenAISampler([dead], "policy", max_retries=2, backoff=0.001).generate([[1, 2, 3]], 4, 1.0, [])
    assert random.random() == expected  # how often a server failed (timing) is not in the run's stream


# ---------------------------------------------------------------- weight sync


def test_full_sync_makes_every_server_score_like_the_trainer(servers, model, tok, tmp_path):
    a, b = servers(2)
    sampler = OpenAISampler([a.url, b.url], "policy", max_retries=0)
    probe = _probe(tok)
    before = server_prompt_logprobs(a.url, "policy", probe)
    actor = copy.deepcopy(model)
    assert _gap(before, _trainer_logprobs(actor, probe)) <= TOL  # same start
    sync = WeightSync(sampler, tmp_path / "w", verify_tol=TOL, probe_ids=probe)
    for step in range(3):  # an update, then a sync, three times
        _perturb(actor.parameters(), seed=step)
        metrics = sync(actor)
        mine = _trainer_logprobs(actor, probe)
        for srv in (a, b):
            theirs = server_prompt_logprobs(srv.url, "policy", probe)
            assert _gap(theirs, mine) <= TOL
            assert srv.reloads == step + 1
        assert metrics["weights_version"] == step + 1 and metrics["sync_max_gap"] <= TOL
    assert _gap(server_prompt_logprobs(b.url, "policy", probe), before) > 1e-2  # it did change
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v000002", "v000003"]  # keep=2


def test_lora_sync_hot_loads_the_adapter_on_every_server(servers, model, tok, tmp_path):
    a, b = servers(2, enable_lora=True)
    sampler = OpenAISampler([a.url, b.url], "policy", max_retries=0)
    probe = _probe(tok)
    base = server_prompt_logprobs(a.url, "policy", probe)
    actor = attach_lora(copy.deepcopy(model), LoraSettings(r=4))
    sync = WeightSync(sampler, tmp_path / "w", mode="lora")
    for step in range(2):
        _perturb([p for n, p in actor.named_parameters() if "lora_" in n], seed=step, scale=0.2)
        metrics = sync(actor)
        assert sampler.model == f"policy-lora-v{step + 1}"
        mine = _trainer_logprobs(actor, probe)
        for srv in (a, b):
            assert _gap(server_prompt_logprobs(srv.url, sampler.model, probe), mine) <= TOL
            assert list(srv.adapters) == [sampler.model]  # the previous version was unloaded
        assert metrics["sync_bytes"] < 1e6  # the adapter, not the model
    assert _gap(mine, base) > 1e-2
    assert _gap(server_prompt_logprobs(b.url, "policy", probe), base) <= TOL  # the base name is the base
    gen = sampler.generate([probe], 8, 1.0, [], seed=0)  # sampling goes through the adapter's name
    assert len(gen[0].token_ids) == 8


def test_a_server_that_cannot_reload_stops_the_sync_naming_it(servers, model, tok, tmp_path):
    a, b = servers(2)
    other = build_tiny_actor(tok, preset="tiny", seed=1)
    other.model.norm = torch.nn.Identity()  # another architecture: its parameters do not match
    (c,) = servers(1, base=other)
    sampler = OpenAISampler([a.url, b.url, c.url], "policy", max_retries=0)
    with pytest.raises(WeightSyncError, match=f"failed on 1 of 3 servers: {c.url}: POST {c.url}/collective_rpc.*unexpected"):
        WeightSync(sampler, tmp_path / "w", retries=0)(copy.deepcopy(model))
    sampler.down.clear()
    _stop_in_thread(b)()
    with pytest.raises(WeightSyncError, match=b.url):
        WeightSync(OpenAISampler([a.url, b.url], "policy"), tmp_path / "w2", retries=0)(copy.deepcopy(model))


def test_verify_catches_a_server_that_answers_the_reload_but_keeps_old_weights(servers, model, tok, tmp_path):
    a, b = servers(2)
    b.collective_rpc = lambda body: {"results": [{"tensors": 0}]}  # says yes, loads nothing
    actor = copy.deepcopy(model)
    _perturb(actor.parameters(), seed=9)
    sync = WeightSync(OpenAISampler([a.url, b.url], "policy"), tmp_path / "w", verify_tol=TOL, probe_ids=_probe(tok))
    with pytest.raises(WeightSyncError, match=f"server {b.url} answered the reload.*not serving the new weights"):
        sync(actor)


def test_servers_the_sampler_reported_dead_are_left_out_loudly(servers, model, tok, tmp_path, caplog):
    a, b = servers(2)
    sampler = OpenAISampler([a.url, b.url], "policy", max_retries=0)
    sampler.down[b.url] = "connection refused"
    metrics = WeightSync(sampler, tmp_path / "w")(copy.deepcopy(model))
    assert metrics["sync_servers"] == 1 and a.reloads == 1 and b.reloads == 0
    assert any(b.url in r.getMessage() and "not synced" in r.getMessage() for r in caplog.records)


def test_lora_mode_needs_a_lora_actor(servers, model, tmp_path):
    (a,) = servers(1, enable_lora=True)
    with pytest.raises(WeightSyncError, match="needs a peft"):
        WeightSync(OpenAISampler([a.url], "policy"), tmp_path / "w", mode="lora")(copy.deepcopy(model))


# ---------------------------------------------------------------- the vLLM worker extension


def _load_extension():
    path = REPO / "scale" / "serving" / "vllm_worker_ext.py"
    spec = importlib.util.spec_from_file_location("vllm_worker_ext", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _FakeVllmModel(torch.nn.Module):
    """What the extension needs of a vLLM model: ``load_weights(iterable)`` -> loaded names."""

    def __init__(self, hf_model):
        super().__init__()
        self.inner = hf_model

    def named_parameters(self, *args, **kwargs):
        return self.inner.named_parameters(*args, **kwargs)

    def load_weights(self, weights):
        params = dict(self.inner.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, t in weights:
                params[name].copy_(t)
                loaded.add(name)
        return loaded


def test_vllm_worker_extension_reloads_through_a_fake_engine(model, tok, tmp_path):
    mod = _load_extension()
    assert "vllm" not in sys.modules  # importing it needs no vllm

    class FakeWorker(mod.MinirsiWorkerExtension):  # what --worker-extension-cls does to vLLM's Worker
        minirsi_tp_group = SimpleNamespace(world_size=1, rank_in_group=0, device="cpu")

        def __init__(self):
            self.model_runner = SimpleNamespace(model=_FakeVllmModel(copy.deepcopy(model)))

    class FakeEngine:  # the API server's /collective_rpc: the method on every worker (TP = 2)
        workers = [FakeWorker(), FakeWorker()]

        def collective_rpc(self, method, args=()):
            return [getattr(w, method)(*args) for w in self.workers]

    engine = FakeEngine()
    trained = copy.deepcopy(model)
    _perturb(trained.parameters(), seed=5)
    nbytes = write_full_weights(trained.state_dict(), tmp_path / "v1", torch.bfloat16, shard_bytes=60_000)
    assert len(list((tmp_path / "v1").glob("*.safetensors"))) > 2  # several shards and an index
    results = engine.collective_rpc(RELOAD_METHOD, (str(tmp_path / "v1"),))
    n = len(dict(model.named_parameters()))  # tied embeddings once, as written
    assert [{k: r[k] for k in ("tensors", "loaded")} for r in results] == [{"tensors": n, "loaded": n}] * 2
    assert all(r["bytes_read"] == nbytes for r in results)  # one worker per group here: it reads everything
    for w in engine.workers:  # the bf16 values, loaded
        for p, q in zip(w.model_runner.model.inner.parameters(), trained.parameters()):
            assert torch.equal(p, q.to(torch.bfloat16).float())
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        engine.collective_rpc(RELOAD_METHOD, (str(tmp_path),))
    partial = {k: v for k, v in trained.state_dict().items() if "layers.0." not in k}
    write_full_weights(partial, tmp_path / "v2")
    with pytest.raises(RuntimeError, match="not in the checkpoint"):
        engine.collective_rpc(RELOAD_METHOD, (str(tmp_path / "v2"),))


def test_extension_names_are_free_on_vllms_worker():
    """vLLM asserts at start that no attribute of the extension exists on its Worker class
    (0.33 vllm/v1/worker/worker_base.py, 0.11 vllm/worker/worker_base.py); an instance attribute
    of the same name would shadow it. The names are recorded from each version's source
    (scale/serving/record_vllm.py)."""
    mod = _load_extension()
    record = json.loads((REPO / "scale/serving/vllm_recorded.json").read_text())
    assert {"0.11.0", "0.33.0"} <= set(record)
    ours = {a for a in dir(mod.MinirsiWorkerExtension) if not a.startswith("__")}
    assert RELOAD_METHOD in ours
    for version, r in record.items():
        assert "reload_weights" in r["worker_class_attributes"], version  # the name the extension had
        taken = set(r["worker_class_attributes"]) | set(r["worker_instance_attributes"])
        assert not ours & taken, (version, sorted(ours & taken))


@pytest.mark.slow
def test_tp_workers_each_read_their_share_and_all_load_everything(model, tok, tmp_path):
    """Two gloo processes stand in for a TP group of two vLLM workers: each reads every other
    shard file and broadcasts it; both models end with every (bf16) weight."""
    trained = copy.deepcopy(model)
    _perturb(trained.parameters(), seed=6)
    nbytes = write_full_weights(trained.state_dict(), tmp_path / "w", torch.bfloat16, shard_bytes=60_000)
    files = len(list((tmp_path / "w").glob("*.safetensors")))
    assert files >= 4
    torch.save({k: v.to(torch.bfloat16) for k, v in trained.state_dict().items()}, tmp_path / "want.pt")
    save_actor(model, tok, tmp_path / "model")  # what each worker starts from (the old weights)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}:{REPO / 'scale/serving'}"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(REPO / "tests/dist_tp_load.py"), str(tmp_path / "model"), str(tmp_path / "w"),
                           str(tmp_path / "want.pt"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads((tmp_path / f"out.{r}.json").read_text()) for r in range(2)]
    assert [g["files_read"] for g in got] == [(files + 1) // 2, files // 2]
    assert sum(g["bytes_read"] for g in got) == nbytes  # each byte read once, by one worker
    assert all(g["tensors"] == g["loaded"] == len(dict(model.named_parameters())) for g in got)
    assert all(g["max_diff"] == 0.0 for g in got)


def test_the_request_sends_every_field_vllm_would_take_from_generation_config(tok):
    """vLLM fills a field the request leaves out from generation_config.json (Qwen3: top_k 20,
    top_p 0.95): the sampler sends each one the record lists, at the value that keeps the whole
    distribution, and ignore_eos so that only stop_token_ids end a reply."""
    sent = []

    class Capture(OpenAISampler):
        def _post(self, body, server=None):
            sent.append(body)
            return {"choices": [{"index": 0, "token_ids": [5], "logprobs": {"token_logprobs": [-0.1]},
                                 "finish_reason": "length"}]}

    Capture(["http://127.0.0.1:1"], "policy").generate([[1, 2, 3]], 1, 0.7, [2], seed=1)
    (body,) = sent
    record = json.loads((REPO / "scale/serving/vllm_recorded.json").read_text())
    neutral = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
               "presence_penalty": 0.0, "frequency_penalty": 0.0}
    for version, r in record.items():
        for field in r["completion_fields_from_generation_config"]:
            assert body.get(field) == neutral[field], (version, field, body.get(field))
    assert body["ignore_eos"] is True and body["stop_token_ids"] == [2]
    assert body["max_tokens"] == 1 and body["logprobs"] == 0 and body["seed"] == 1


def test_minirsi_serve_refuses_a_truncated_distribution(servers, tok):
    import requests

    (a,) = servers(1)
    body = {"model": "policy", "prompt": [[1, 2, 3]], "max_tokens": 2, "top_k": 20}
    r = requests.post(a.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "top_k=20" in r.text


def test_a_reset_that_answers_success_false_is_retried_then_stops_the_sync(servers, model, tmp_path):
    """vLLM 0.33 answers /reset_prefix_cache with 200 {"success": false} while blocks are held."""
    a, b = servers(2)
    answers = iter([{"success": False}, {"success": True}])
    a.reset_prefix_cache = lambda: next(answers)  # held once, then reset
    b.reset_prefix_cache = lambda: {"success": False}  # never resets
    sync = WeightSync(OpenAISampler([a.url], "policy"), tmp_path / "w", retries=2)
    sync(copy.deepcopy(model))  # a: retried once, done
    sync = WeightSync(OpenAISampler([b.url], "policy"), tmp_path / "w2", retries=2)
    with pytest.raises(WeightSyncError, match=f"{b.url}/reset_prefix_cache answered .*success.*false.* 3 times"):
        sync(copy.deepcopy(model))


def test_a_collective_rpc_answer_without_results_stops_the_sync(servers, model, tmp_path):
    (a,) = servers(1)
    a.collective_rpc = lambda body: {}  # vLLM's empty 200: the method ran nowhere that reported
    with pytest.raises(WeightSyncError, match="not one result per worker"):
        WeightSync(OpenAISampler([a.url], "policy"), tmp_path / "w")(copy.deepcopy(model))


def test_sync_files_are_bf16_shards_that_read_back(model, tmp_path):
    state = {k: v for k, v in model.state_dict().items()}
    n32 = write_full_weights(state, tmp_path / "f32")
    n16 = write_full_weights(state, tmp_path / "b16", torch.bfloat16, shard_bytes=50_000)
    assert n16 * 2 == n32  # half the bytes
    index = json.loads((tmp_path / "b16" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == n16 and len(set(index["weight_map"].values())) > 1
    back = read_full_weights(tmp_path / "b16")
    assert set(back) == set(state)  # tied names restored
    assert all(back[k].dtype == torch.bfloat16 and torch.equal(back[k], v.to(torch.bfloat16)) for k, v in state.items())
    assert back["lm_head.weight"] is back["model.embed_tokens.weight"]
    one = read_full_weights(tmp_path / "f32")
    assert all(torch.equal(one[k], v) for k, v in state.items())


def test_the_default_serving_config_syncs_bf16_files(servers, model, tmp_path):
    """The recipe builds its sync with ``serving_sync``: with ``serving.sync_dtype`` left at its
    default every file the servers read is bf16 (what vLLM computes in; half the bytes of the
    trainer's fp32), not the trainer's dtype."""
    from safetensors import safe_open

    from minirsi.engine.weight_sync import ServingConfig, serving_sync

    (a,) = servers(1)
    sync = serving_sync(ServingConfig(servers=[a.url]), tmp_path / "w")
    sync(copy.deepcopy(model))
    files = sorted((tmp_path / "w" / "v000001").glob("*.safetensors"))
    assert files
    dtypes = set()
    for name in files:
        with safe_open(str(name), framework="pt") as f:
            dtypes |= {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}


def test_a_lora_push_merges_without_copying_the_model(model, tmp_path):
    from minirsi.engine.weight_sync import gather_full_state_dict

    lora = attach_lora(copy.deepcopy(model), LoraSettings(r=4))
    _perturb([p for n, p in lora.named_parameters() if "lora_" in n], seed=3, scale=0.2)
    want = copy.deepcopy(lora).merge_and_unload().state_dict()
    got = gather_full_state_dict(lora)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    base = lora.get_base_model()
    untouched = base.model.embed_tokens.weight  # not a LoRA target: shared, not copied
    assert got["model.embed_tokens.weight"].data_ptr() == untouched.data_ptr()


# ---------------------------------------------------------------- real server processes


class _Proc:
    """A ``minirsi serve`` subprocess on 127.0.0.1 with a free port."""

    def __init__(self, model_dir: Path, log: Path, *extra: str):
        cmd = [sys.executable, "-m", "minirsi.cli", "serve", "--model", str(model_dir), "--port", "0",
               "--served-model-name", "policy", *extra]
        self.log = log.open("w")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=REPO)
        line = [""]
        reader = threading.Thread(target=lambda: line.__setitem__(0, self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(120)
        if not line[0].startswith("minirsi serve: http://"):
            self.stop()
            raise RuntimeError(f"minirsi serve did not start: {line[0]!r}; see {log}")
        self.url = line[0].split()[2].rsplit("/v1/", 1)[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture()
def procs(tmp_path):
    started: list[_Proc] = []

    def start(model_dir: Path, n: int, *extra: str) -> list[_Proc]:
        for _ in range(n):
            started.append(_Proc(model_dir, tmp_path / f"serve{len(started)}.log", *extra))
        return started[-n:]

    yield start
    for p in started:
        p.stop()


@pytest.mark.slow
def test_two_serve_processes_end_to_end(procs, model, tok, tmp_path):
    """Two `minirsi serve` processes: pinned episodes, a full sync, a LoRA sync, and a SIGKILL."""
    save_actor(model, tok, tmp_path / "base")
    a, b = procs(tmp_path / "base", 2, "--enable-lora")
    probe = _probe(tok)
    sampler = OpenAISampler([a.url, b.url], "policy", max_retries=1, backoff=0.01)

    eps = collect(tasks(4), sampler, tok, cfg(max_turns=3, concurrency=4), progress=False,
                  open_sandbox=Sandboxes(), verify=fake_verify)
    assert sampler.sent[a.url] > 0 and sampler.sent[b.url] > 0
    assert sampler.pinned == sum(e.turns for e in eps) - len(eps)

    actor = copy.deepcopy(model)  # full weights: an update, a sync
    before = server_prompt_logprobs(a.url, "policy", probe)
    _perturb(actor.parameters(), seed=1)
    WeightSync(sampler, tmp_path / "full")(actor)
    mine = _trainer_logprobs(actor, probe)
    for p in (a, b):
        after = server_prompt_logprobs(p.url, "policy", probe)
        assert _gap(after, mine) <= TOL and _gap(after, before) > 1e-2

    lora = attach_lora(copy.deepcopy(actor), LoraSettings(r=4))  # LoRA on top of the synced base
    _perturb([p for n, p in lora.named_parameters() if "lora_" in n], seed=2, scale=0.2)
    WeightSync(sampler, tmp_path / "lora", mode="lora")(lora)
    mine_lora = _trainer_logprobs(lora, probe)
    for p in (a, b):
        assert _gap(server_prompt_logprobs(p.url, sampler.model, probe), mine_lora) <= TOL
    assert _gap(mine_lora, mine) > 1e-2

    out = tmp_path / "eps.jsonl"  # SIGKILL one server mid-collection
    with pytest.raises(ServerDown, match=f"server {b.url}") as err:
        collect(tasks(6), sampler, tok, cfg(max_turns=2, concurrency=2), out_path=out, progress=False,
                open_sandbox=_Killer(3, lambda: os.kill(b.proc.pid, signal.SIGKILL)), verify=fake_verify)
    assert err.value.server == b.url
    assert len(out.read_text().splitlines()) >= 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_recipe_rpr_samples_on_two_servers_and_syncs_every_step(procs, tmp_path):
    """`minirsi run` scaled down (tiny suites, one RPR step each) with every stage's rollouts on
    two `minirsi serve` processes: each stage pushes its actor first (RSR, the warm-up's frozen
    actor, RPR, the evaluation), every RPR step logs a sync, and the servers end on the final
    actor's weights."""
    from minirsi.config import load_config
    from minirsi.engine.models import load_actor
    from minirsi.run import recipe

    tok_ = build_tokenizer(["```bash\nls\n```\n<|im_end|>\n"] * 10, vocab_size=300)
    save_actor(build_tiny_actor(tok_, seed=0), tok_, tmp_path / "base")
    a, b = procs(tmp_path / "base", 2)
    run_dir = tmp_path / "run"
    overrides = [
        f"base.model={tmp_path / 'base'}", f"serving.servers=[{a.url},{b.url}]", "serving.verify_tol=1e-4",
        "serving.sync_dtype=float32",  # minirsi serve computes in fp32: the trainer's weights exactly
        "suites.train=4", "suites.core=1", "suites.hard=1", "suites.long=1", "suites.unseen=1",
        "rollout.max_turns=2", "rollout.max_new_tokens=16", "rollout.command_timeout=5",
        "rsr1.samples_per_task=1", "rsr2.samples_per_task=1", "baselines.direct_ppo=false",
        "rpr1.steps=2", "rpr1.critic_calibration_updates=1", "rpr1.episodes_per_step=4", "rpr1.minibatch_size=4",
        "rpr2.steps=1", "rpr2.critic_calibration_updates=0", "rpr2.episodes_per_step=4", "rpr2.minibatch_size=4",
        "eval.k=1", "eval.suites=[core]", "eval.stages=[base]", "eval.rollout.max_turns=1",
        "eval.rollout.max_new_tokens=16",
    ]
    cfg_ = load_config(recipe.RunConfig, None, overrides)
    recipe.run(cfg_, run_dir)
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for stage, joint in (("rpr1", 2), ("rpr2", 1)):
        mine = [r for r in recs if r["stage"] == stage]
        syncs = [r for r in mine if "sync_s" in r]
        assert len(syncs) == joint + 1  # before the first rollout, then after every joint update
        assert all(r["sync_max_gap"] <= 1e-4 and r["sync_servers"] == 2 for r in syncs)
        assert all("tis_capped_frac" in r for r in mine if r.get("phase") == "joint")
    for stage in ("rsr1", "warmup", "rsr2"):  # the stages that sampled in-process before: one push each
        assert [r["sync_servers"] for r in recs if r["stage"] == stage and "sync_s" in r] == [2.0], stage
    # 9 pushes in all: base's evaluation, RSR-1, the warm-up, RPR-1 (1 + 2), RSR-2, RPR-2 (1 + 1)
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v000008", "v000009"]
    final, _ = load_actor(run_dir / "stages" / "05-rpr2" / "actor")
    ids = _probe(tok_)
    for p in (a, b):
        assert _gap(server_prompt_logprobs(p.url, "policy", ids), _trainer_logprobs(final, ids)) <= TOL


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _OpenCounter:
    """``rollout.open_sandbox`` counting the sandboxes opened; runs ``kill`` as the ``at``-th opens."""

    def __init__(self, at: int = 0, kill=None):
        from minirsi.env import sandbox

        self.open, self.at, self.kill, self.count = sandbox.open_sandbox, at, kill, 0
        self.lock = threading.Lock()

    def __call__(self, task, backend):
        with self.lock:
            self.count += 1
            fire = self.count == self.at
        if fire:
            self.kill()
        return self.open(task, backend=backend)


def _rpr_on_servers(tmp_path, servers, policy):
    """A Base and RPR-1 (1 calibration + 2 joint steps of 6 episodes, 2 live at a time) sampling
    on ``servers``; returns (config, run dir, stage list, episodes per step)."""
    from minirsi.config import load_config
    from minirsi.run import recipe
    from minirsi.run.config import RunConfig
    from minirsi.run.rundir import StageSpec

    overrides = [
        f"base.model={tmp_path / 'base'}", f"serving.servers=[{','.join(servers)}]", "serving.max_retries=1",
        f"serving.on_server_failure={policy}", "suites.train=4", "suites.core=1", "eval.suites=[core]",
        "rollout.max_turns=2", "rollout.max_new_tokens=16", "rollout.command_timeout=5", "rollout.concurrency=2",
        "rpr1.steps=2", "rpr1.critic_calibration_updates=1", "rpr1.episodes_per_step=6", "rpr1.minibatch_size=6",
    ]
    cfg = load_config(RunConfig, None, overrides)
    rpr1 = {s.name: s for s in recipe.plan(cfg)}["rpr1"]  # its finished config (seed, tis_cap on: servers sample)
    plan = [StageSpec(0, "base", "base", "Base", evaluate=False),
            dataclasses.replace(rpr1, index=1, actor_from="base", critic_from=None, evaluate=False)]
    return cfg, tmp_path / "run", plan, 6


def _steps_of(cfg, run_dir, per_step):
    """The stage's episodes.jsonl cut into steps, and the task ids each step was drawn for."""
    from minirsi.core.episode import read_jsonl
    from minirsi.core.rpr import task_stream
    from minirsi.run.rundir import RunDir, stage_seed
    from minirsi.run.stages import RecipeRunner

    eps = list(read_jsonl(run_dir / "stages" / "01-rpr1" / "episodes.jsonl"))
    steps = [eps[i:i + per_step] for i in range(0, len(eps), per_step)]
    train = RecipeRunner().tasks(cfg, RunDir(run_dir), "train")
    stream = task_stream(train, per_step, stage_seed(cfg.seed, "rpr1"), 1)
    return steps, [[t.task_id for t in next(stream)] for _ in steps]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_server_killed_mid_step_with_retry_the_step_finishes_on_the_other(procs, tmp_path, monkeypatch):
    """RPR-1 on two `minirsi serve` processes; one is SIGKILLed as joint step 1 admits its third
    episode (two had finished on the servers): the step finishes on the other server, every
    step has its 6 episodes, each once, none cut short, and the later syncs leave the dead one out."""
    from minirsi.engine import rollout
    from minirsi.run.rundir import run_stages
    from minirsi.run.stages import RecipeRunner

    tok_ = build_tokenizer(["```bash\nls\n```\n<|im_end|>\n"] * 10, vocab_size=300)
    save_actor(build_tiny_actor(tok_, seed=0), tok_, tmp_path / "base")
    a, b = procs(tmp_path / "base", 2)
    cfg, run_dir, plan, n = _rpr_on_servers(tmp_path, [a.url, b.url], "retry")
    opens = _OpenCounter(at=n + 3, kill=lambda: (os.kill(b.proc.pid, signal.SIGKILL), b.proc.wait()))
    monkeypatch.setattr(rollout, "open_sandbox", opens)  # what rollout._default_open calls
    run_stages(cfg, run_dir, plan, RecipeRunner(), tensorboard=False)
    assert b.proc.poll() is not None and opens.count == 3 * n  # killed; nothing collected twice
    steps, drawn = _steps_of(cfg, run_dir, n)
    assert [[e.task_id for e in step] for step in steps] == drawn  # 3 steps, each its 6 draws, in order
    assert all([e.meta["index"] for e in step] == list(range(n)) for step in steps)
    assert all(e.error is None and e.stop_reason in ("done", "max_turns") and e.turns > 0 for s in steps for e in s)
    syncs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["sync_servers"] for r in syncs if "sync_s" in r] == [2, 1, 1]  # start, after step 1, after step 2
    assert not (run_dir / "journal" / "01-rpr1").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_server_killed_mid_step_with_fail_the_resume_collects_only_what_had_not_finished(procs, tmp_path,
                                                                                              monkeypatch):
    """As above with on_server_failure=fail: the run stops naming the dead server, with the
    step's finished episodes in its journal; the server comes back on its port; --resume replays
    the finished steps, keeps the finished episodes as they were and collects only the others."""
    from minirsi.core.episode import read_jsonl
    from minirsi.engine import rollout
    from minirsi.run.rundir import RunError, run_stages
    from minirsi.run.stages import RecipeRunner

    tok_ = build_tokenizer(["```bash\nls\n```\n<|im_end|>\n"] * 10, vocab_size=300)
    save_actor(build_tiny_actor(tok_, seed=0), tok_, tmp_path / "base")
    port = _free_port()
    a, b = procs(tmp_path / "base", 1)[0], procs(tmp_path / "base", 1, "--port", str(port))[0]
    cfg, run_dir, plan, n = _rpr_on_servers(tmp_path, [a.url, b.url], "fail")
    monkeypatch.setattr(rollout, "open_sandbox",
                        _OpenCounter(at=n + 3, kill=lambda: (os.kill(b.proc.pid, signal.SIGKILL), b.proc.wait())))
    with pytest.raises(RunError, match=f"server {b.url}.*stopped answering"):
        run_stages(cfg, run_dir, plan, RecipeRunner(), tensorboard=False)
    journal = sorted((run_dir / "journal" / "01-rpr1").glob("rollout-*.jsonl"),
                     key=lambda p: int(p.stem.split("-")[1]))
    assert len(journal) == 2  # step 0 complete, step 1 interrupted
    assert sorted(e.meta["index"] for e in read_jsonl(journal[0])) == list(range(n))
    kept = {e.meta["index"]: e for e in read_jsonl(journal[1])}
    assert 0 < len(kept) < n, kept.keys()  # what step 1 had finished when the server died

    (b2,) = procs(tmp_path / "base", 1, "--port", str(port))  # the server is back, at its URL
    assert b2.url == b.url
    opens = _OpenCounter()
    monkeypatch.setattr(rollout, "open_sandbox", opens)
    run_stages(cfg, run_dir, plan, RecipeRunner(), resume=True, tensorboard=False)
    assert opens.count == (n - len(kept)) + n  # step 0 replayed, the rest of step 1, step 2
    steps, drawn = _steps_of(cfg, run_dir, n)
    assert [[e.task_id for e in step] for step in steps] == drawn
    assert all([e.meta["index"] for e in step] == list(range(n)) for step in steps)  # none lost, none twice
    assert all(steps[1][i] == ep for i, ep in kept.items())  # the finished episodes, as they were
    assert all(e.error is None for step in steps for e in step)
    assert not (run_dir / "journal" / "01-rpr1").exists()


def test_a_run_started_before_the_serving_fields_still_resumes(tmp_path):
    import yaml

    from minirsi.config import ConfigError
    from test_pipeline import FakeRunner, SimulatedKill, run_fake, small_cfg

    run_dir = tmp_path / "run"
    with pytest.raises(SimulatedKill):
        run_fake(small_cfg(), run_dir, FakeRunner(kill_in="rsr1"))
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    del saved["serving"], saved["rpr1"]["tis_cap"], saved["rpr2"]["tis_cap"]  # as an older run wrote it
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    results = run_fake(small_cfg(), run_dir, FakeRunner(), resume=True)
    assert "rpr2" in results
    with pytest.raises(ConfigError, match="serving.on_server_failure"):  # a real difference still is one
        run_fake(small_cfg("serving.on_server_failure=retry"), run_dir, FakeRunner(), resume=True)


def test_a_resume_may_name_new_servers_but_not_switch_to_them(tmp_path):
    """A SLURM job starts new servers at new URLs: a resumed run takes them (serving.servers is
    where the run samples, not what it computes), but a run that sampled in-process cannot
    resume on servers (or back) unnoticed."""
    from minirsi.config import ConfigError
    from test_pipeline import FakeRunner, SimulatedKill, run_fake, small_cfg

    run_dir = tmp_path / "run"
    with pytest.raises(SimulatedKill):
        run_fake(small_cfg("serving.servers=[http://node1:8000]"), run_dir, FakeRunner(kill_in="rsr1"))
    results = run_fake(small_cfg("serving.servers=[http://node7:8000,http://node8:8000]"), run_dir, FakeRunner(),
                       resume=True)
    assert "rpr2" in results
    other = tmp_path / "other"
    with pytest.raises(SimulatedKill):
        run_fake(small_cfg(), other, FakeRunner(kill_in="rsr1"))
    with pytest.raises(ConfigError, match="serving.servers"):
        run_fake(small_cfg("serving.servers=[http://node7:8000]"), other, FakeRunner(), resume=True)

"""Rollouts from several servers, weight sync (full and LoRA), the vLLM worker extension.

The fast tests run ``minirsi serve``'s ``CompletionServer`` in threads on 127.0.0.1; the slow
ones start real ``minirsi serve`` processes (loopback, port 0) and always stop them
(``_Proc.stop``: terminate, then kill after 10 s).
"""

from __future__ import annotations

import copy
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

from minirsi.models import LoraSettings, attach_lora, build_tiny_actor, build_tokenizer, save_actor, token_logprobs
from minirsi.rollout import collect
from minirsi.sampler import HFSampler, OpenAISampler, ServerDown
from minirsi.serve import CompletionServer, start_in_thread
from minirsi.weight_sync import WeightSync, WeightSyncError, server_prompt_logprobs, write_full_weights
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
    b.collective_rpc = lambda body: {"results": [None]}  # says yes, loads nothing
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
        def __init__(self):
            self.model_runner = SimpleNamespace(model=_FakeVllmModel(copy.deepcopy(model)))

    class FakeEngine:  # the API server's /collective_rpc: the method on every worker (TP = 2)
        workers = [FakeWorker(), FakeWorker()]

        def collective_rpc(self, method, args=()):
            return [getattr(w, method)(*args) for w in self.workers]

    engine = FakeEngine()
    trained = copy.deepcopy(model)
    _perturb(trained.parameters(), seed=5)
    write_full_weights(trained.state_dict(), tmp_path / "v1")
    results = engine.collective_rpc("reload_weights", (str(tmp_path / "v1"),))
    n = len(dict(model.named_parameters()))  # tied embeddings once, as written
    assert results == [{"tensors": n, "loaded": n}] * 2
    for w in engine.workers:
        assert all(torch.equal(p, q) for p, q in zip(w.model_runner.model.inner.parameters(), trained.parameters()))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        engine.collective_rpc("reload_weights", (str(tmp_path),))
    partial = {k: v for k, v in trained.state_dict().items() if "layers.0." not in k}
    write_full_weights(partial, tmp_path / "v2")
    with pytest.raises(RuntimeError, match="not in the checkpoint"):
        engine.collective_rpc("reload_weights", (str(tmp_path / "v2"),))


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
    """`minirsi run` scaled down (tiny suites, one RPR step each) with RPR's rollouts on two
    `minirsi serve` processes: every RPR step logs a sync, and the servers end on the final
    actor's weights."""
    from minirsi import recipe
    from minirsi.config import load_config
    from minirsi.models import load_actor

    tok_ = build_tokenizer(["```bash\nls\n```\n<|im_end|>\n"] * 10, vocab_size=300)
    save_actor(build_tiny_actor(tok_, seed=0), tok_, tmp_path / "base")
    a, b = procs(tmp_path / "base", 2)
    run_dir = tmp_path / "run"
    overrides = [
        f"base.model={tmp_path / 'base'}", f"serving.servers=[{a.url},{b.url}]", "serving.verify_tol=1e-4",
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
    final, _ = load_actor(run_dir / "stages" / "05-rpr2" / "actor")
    ids = _probe(tok_)
    for p in (a, b):
        assert _gap(server_prompt_logprobs(p.url, "policy", ids), _trainer_logprobs(final, ids)) <= TOL


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

"""Weight sync: after every actor update, every rollout server samples from the new policy.

Without it every RPR step after the first would sample from stale weights. Two modes, one
protocol over HTTP, the same against ``vllm serve`` (with the worker extension in
``scale/serving/``) and ``minirsi serve`` (which implements the same routes on the CPU)::

    full weights, version v:
        state = gather_full_state_dict(actor)               # all ranks (FSDP: a full-state gather)
        rank 0: write_full_weights(state, sync_dir/v{v}, dtype)   # safetensors shards in the servers'
                                                             # dtype (bf16), then an atomic rename
        every server, concurrently, then wait for all:
            POST /collective_rpc {"method": "minirsi_load_weights", "args": [dir]}   # the worker extension
                -> {"results": [one dict per worker]}        # each checked: every worker loaded
            POST /reset_prefix_cache                         # cached KV belongs to the old weights
                -> {"success": true}                         # false: blocks still held; retried, then an error
    LoRA, version v:
        actor.save_pretrained(sync_dir/v{v})                 # the peft adapter only (megabytes)
        every server: POST /v1/load_lora_adapter {"lora_name": "<name>-v{v}", "lora_path": dir}
                      POST /v1/unload_lora_adapter {"lora_name": "<name>-v{v-1}"}
        sampler.model = "<name>-v{v}"                        # the next requests use the new adapter

A new adapter name per version, not a reload in place: vLLM refuses to load a name twice, and a
fresh name also keys a fresh prefix cache (vLLM hashes the LoRA id into each block's key).

Failures are loud. A server that fails any of these requests (after ``retries``) stops the run
with ``WeightSyncError`` naming it; nothing is skipped. vLLM 0.33 answers a prefix-cache reset
that could not run (blocks held by running requests or KV transfers) with HTTP 200 and
``{"success": false}``, so the answer is read, not only its status (0.11 answers 200 with an
empty body: success, as it did not check either).

Bytes. The weights are written in ``dtype`` (bf16: what vLLM serves Qwen3 in; 65.5 GB for
Qwen3-32B against 131 GB in fp32), in shards of at most ``shard_bytes`` with an index, so that a
tensor-parallel server's workers can each read a share of the files (the worker extension). Servers the sampler already reported
dead (``OpenAISampler.down``, with ``on_server_failure="retry"``) are left out and logged each
sync: they are never sent work again, so their stale weights cannot leak into a batch.

``verify_tol > 0`` checks every server after the sync: the log-probs it gives a fixed probe
sequence (vLLM's ``prompt_logprobs``) must match the trainer's within the tolerance (fp32 on
CPU: ~1e-6; vLLM in bf16 against an fp32 trainer: ~1e-2, so set it per deployment).

Call it::

    sync = WeightSync(sampler, "runs/x/weights", mode="full")
    metrics = sync(actor)          # after each actor update; returns sync_s, sync_bytes, ...

The recipe's side (``minirsi run serving.servers=[...]``): ``ServingConfig`` (the ``serving.*``
keys), ``serving_sync`` (its sampler and ``WeightSync``) and ``sharded_push`` (the push from a
sharded actor).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minirsi.core.distributed import World
from minirsi.engine.models import merged_state_dict, token_logprobs
from minirsi.engine.sampler import ON_SERVER_FAILURE, OpenAISampler, server_base

logger = logging.getLogger(__name__)

SYNC_MODES = ("full", "lora")
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TIED_KEY = "minirsi_tied"  # safetensors / index metadata: JSON {alias: name written} of tied parameters
RELOAD_METHOD = "minirsi_load_weights"
"""The worker extension's method (scale/serving/vllm_worker_ext.py): a name vLLM's Worker lacks."""
SYNC_DTYPES = ("bfloat16", "float16", "float32")
SHARD_BYTES = 4 * 2**30
"""Largest safetensors file a sync writes (a 32B model in bf16: 17 files)."""


class WeightSyncError(RuntimeError):
    """A server did not take the new weights; the message names it and says what failed."""


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The actor's full state dict, Hugging Face parameter names -> tensors (on rank 0).

    One process here: the module's own ``state_dict``; a peft (LoRA) actor's weights with the
    adapters merged in (``models.merged_state_dict``: W + s B A per adapted layer, nothing else
    copied), so the servers get plain weights. Under FSDP2 the caller gathers first
    (``World.unsharded``, ``sharded_push``) and hands this the plain model.
    """
    if hasattr(model, "peft_config"):
        return merged_state_dict(model)
    return {k: v.detach() for k, v in model.state_dict().items()}


def write_full_weights(state: dict[str, torch.Tensor], out_dir: str | Path, dtype: torch.dtype | None = None,
                       shard_bytes: int = SHARD_BYTES) -> int:
    """Write ``state`` into ``out_dir`` (atomically: a temporary directory, then a rename);
    returns the bytes written. Floating tensors are cast to ``dtype`` (None: as they are).
    Up to ``shard_bytes``: one ``model.safetensors``; beyond, ``model-0000i-of-0000n.safetensors``
    files of at most ``shard_bytes`` each (a larger tensor alone in its file) and
    ``model.safetensors.index.json`` naming the file of every tensor, as Hugging Face shards.
    Tied parameters (one tensor under two names, e.g. ``lm_head.weight`` and
    ``model.embed_tokens.weight``) are written once, under the first name, and the alias is
    recorded in the metadata (``TIED_KEY``), as safetensors refuses shared storage."""
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tied: dict[str, str] = {}
    first: dict[tuple[int, tuple[int, ...]], str] = {}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, t in state.items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in first:
            tied[name] = first[key]
            continue
        first[key] = name
        t = t.detach().to("cpu", dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size, total = size + nbytes, total + nbytes
    meta = {TIED_KEY: json.dumps(tied)}
    if len(shards) == 1:
        save_file(shards[0], str(tmp / WEIGHTS_FILE), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata=meta)
            weight_map.update({k: name for k in shard})
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total, **meta},
                                                  "weight_map": weight_map}, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return total


def read_full_weights(weights_dir: str | Path) -> dict[str, torch.Tensor]:
    """Read what ``write_full_weights`` wrote, tied aliases restored (``minirsi serve`` uses it)."""
    d = Path(weights_dir)
    files = sorted(set(json.loads((d / INDEX_FILE).read_text())["weight_map"].values())) \
        if (d / INDEX_FILE).is_file() else [WEIGHTS_FILE]
    if not (d / files[0]).is_file():
        raise FileNotFoundError(f"{d / files[0]}: no such file; weights_dir must be a directory written by "
                                "weight_sync.write_full_weights")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(d / name), framework="pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys()})
            tied = json.loads((f.metadata() or {}).get(TIED_KEY, "{}"))
    for alias, name in tied.items():
        state[alias] = state[name]
    return state


class WeightSync:
    """Push the actor to every live server of ``sampler`` and wait for all of them.

    Args:
        sampler: the ``OpenAISampler`` the rollouts use (its servers, its dead list, and its
            ``model`` name, which a LoRA sync changes).
        sync_dir: a directory every server can read (shared storage at scale); versions are
            written to ``sync_dir/vNNNNNN`` and all but the newest ``keep`` are deleted.
        mode: ``"full"`` (merged weights, safetensors) or ``"lora"`` (the peft adapter).
        timeout: seconds for one server request (a reload of a 27B model takes minutes).
        lora_name: adapter names are ``f"{lora_name}-v{version}"``.
        verify_tol: > 0: after each sync, check each server's log-probs of ``probe_ids``
            against the trainer's (module docstring); 0: no check.
        probe_ids: the probe sequence (a few hundred ids of any text).
        dtype: full weights are written in this dtype (None: the trainer's, fp32); the
            recipe passes ``serving.sync_dtype``.
    """

    def __init__(self, sampler: Any, sync_dir: str | Path, mode: str = "full", timeout: float = 600.0,
                 retries: int = 2, keep: int = 2, lora_name: str = "policy-lora", verify_tol: float = 0.0,
                 probe_ids: Sequence[int] = (), dtype: torch.dtype | None = None):
        if mode not in SYNC_MODES:
            raise ValueError(f"weight sync mode={mode!r}: use one of {SYNC_MODES}")
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least the version the servers are loading")
        if verify_tol > 0 and len(probe_ids) < 2:
            raise ValueError("verify_tol > 0 needs probe_ids (at least 2 token ids) to score on every server")
        import requests

        self.sampler, self.mode, self.timeout, self.retries, self.keep = sampler, mode, timeout, retries, keep
        self.sync_dir = Path(sync_dir)
        self.lora_name, self.verify_tol, self.probe_ids = lora_name, verify_tol, list(probe_ids)
        self.dtype = dtype
        self.version = 0
        self._session = requests.Session()

    def __call__(self, actor: torch.nn.Module) -> dict[str, float]:
        """One sync; returns metrics (``sync_s``, ``sync_write_s``, ``sync_bytes``,
        ``sync_servers``, ``weights_version``, and ``sync_max_gap`` when verifying)."""
        t0 = time.perf_counter()
        self.version += 1
        out = self.sync_dir / f"v{self.version:06d}"
        servers = self.sampler.live_servers
        for dead in self.sampler.down:
            logger.warning("weight sync v%d: server %s is down (reported by the sampler), not synced",
                           self.version, dead)
        if not servers:
            raise WeightSyncError(f"weight sync v{self.version}: every server is down: {self.sampler.down}")
        if self.mode == "full":
            nbytes = write_full_weights(gather_full_state_dict(actor), out, self.dtype)
        else:
            nbytes = self._save_adapter(actor, out)
        t1 = time.perf_counter()
        model = self._push(servers, out.resolve())
        metrics = {"sync_s": time.perf_counter() - t0, "sync_write_s": t1 - t0, "sync_bytes": float(nbytes),
                   "sync_servers": float(len(servers)), "weights_version": float(self.version)}
        if self.verify_tol > 0:
            metrics["sync_max_gap"] = self._verify(actor, servers, model)
        self.sampler.model = model
        self.sampler.clear_cache()
        self._prune()
        logger.info("weight sync v%d (%s, %.1f MB) to %d servers in %.2fs", self.version, self.mode, nbytes / 1e6,
                    len(servers), metrics["sync_s"])
        return metrics

    # -- internals ----------------------------------------------------------------------------

    @staticmethod
    def _save_adapter(actor: torch.nn.Module, out: Path) -> int:
        if not hasattr(actor, "peft_config"):
            raise WeightSyncError("weight sync mode 'lora' needs a peft (LoRA) actor; this actor has no adapter. "
                                  "Fix: load it with load_actor(..., lora=LoraSettings()) or use mode 'full'")
        tmp = out.with_name(f".{out.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        actor.save_pretrained(str(tmp))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        return sum(p.stat().st_size for p in out.iterdir())

    def _push(self, servers: list[str], path: Path) -> str:
        """All servers take version ``path`` concurrently; returns the model name to sample."""
        if self.mode == "full":
            model = self.sampler.model
            steps = [("/collective_rpc", {"method": RELOAD_METHOD, "args": [str(path)], "kwargs": {},
                                          "timeout": self.timeout}),
                     ("/reset_prefix_cache", None)]
        else:
            model = f"{self.lora_name}-v{self.version}"
            steps = [("/v1/load_lora_adapter", {"lora_name": model, "lora_path": str(path)})]
            if self.version > 1:
                steps.append(("/v1/unload_lora_adapter", {"lora_name": f"{self.lora_name}-v{self.version - 1}"}))
        with ThreadPoolExecutor(len(servers), thread_name_prefix="weight-sync") as pool:
            futures = {s: pool.submit(self._steps, s, steps) for s in servers}
        errors = {s: f.exception() for s, f in futures.items() if f.exception() is not None}
        if errors:
            lines = "; ".join(f"{s}: {e}" for s, e in errors.items())
            raise WeightSyncError(f"weight sync v{self.version} ({self.mode}) failed on {len(errors)} of "
                                  f"{len(servers)} servers: {lines}. The run stops: sampling on would mix "
                                  "stale and fresh weights")
        return model

    def _steps(self, server: str, steps: list[tuple[str, dict | None]]) -> None:
        for route, body in steps:
            answer = self._request(server, route, body)
            if route == "/collective_rpc":
                _check_rpc(server, answer)
            elif route == "/reset_prefix_cache":
                self._reset_until_done(server, answer)

    def _reset_until_done(self, server: str, answer: Any) -> None:
        """vLLM 0.33's ``{"success": false}`` (blocks still held): ask again, ``retries`` times
        with backoff, then stop the run; any other 200 answer is a done reset."""
        for attempt in range(self.retries + 1):
            if not (isinstance(answer, dict) and answer.get("success") is False):
                return
            if attempt == self.retries:
                break
            time.sleep(0.5 * 2**attempt)
            answer = self._request(server, "/reset_prefix_cache", None)
        raise WeightSyncError(f"POST {server}/reset_prefix_cache answered {{\"success\": false}} {self.retries + 1} "
                              "times: its KV blocks are still held (running requests or KV transfers), so its prefix "
                              "cache would serve blocks of the old weights. Fix: make sure no request runs on it "
                              "during a sync (one trainer per server), or restart it")

    def _request(self, server: str, route: str, body: dict | None) -> Any:
        import requests

        last = ""
        for attempt in range(self.retries + 1):
            try:
                r = self._session.post(server + route, json=body, timeout=self.timeout)
            except (requests.ConnectionError, requests.Timeout) as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200:  # vLLM answers the LoRA routes in plain text
                    return r.json() if "json" in r.headers.get("Content-Type", "") else r.text
                last = f"HTTP {r.status_code}: {r.text[:300]}"
                if r.status_code < 500:  # a 4xx will not get better by retrying
                    break
            if attempt < self.retries:
                time.sleep(0.5 * 2**attempt)
        raise WeightSyncError(f"POST {server}{route} failed: {last}")

    def _verify(self, actor: torch.nn.Module, servers: list[str], model: str) -> float:
        ids = torch.tensor([self.probe_ids], device=next(actor.parameters()).device)
        was_training = actor.training
        actor.eval()
        with torch.no_grad():
            mine = token_logprobs(actor, ids)[0, 1:].tolist()
        actor.train(was_training)
        worst = 0.0
        for s in servers:
            theirs = server_prompt_logprobs(s, model, self.probe_ids, self.timeout)
            gap = max(abs(a - b) for a, b in zip(mine, theirs))
            if not gap <= self.verify_tol:
                raise WeightSyncError(f"weight sync v{self.version}: server {s} answered the reload, but its "
                                      f"log-probs of the probe differ from the trainer's by {gap:.2e} > "
                                      f"verify_tol={self.verify_tol:g}: it is not serving the new weights")
            worst = max(worst, gap)
        return worst

    def _prune(self) -> None:
        versions = sorted(p for p in self.sync_dir.glob("v[0-9]*") if p.is_dir())
        for old in versions[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def _check_rpc(server: str, answer: Any) -> None:
    """``/collective_rpc``'s answer must hold one result per worker, each the extension's dict:
    vLLM answers an empty 200 when the method returned nothing, which ours never does."""
    results = answer.get("results") if isinstance(answer, dict) else None
    if not results or not all(isinstance(r, dict) for r in results):
        raise WeightSyncError(f"POST {server}/collective_rpc {RELOAD_METHOD}: answer {str(answer)[:200]!r} is not one "
                              "result per worker: is the server started with scale/serve_vllm.sh (the worker "
                              "extension, VLLM_SERVER_DEV_MODE=1)?")


def server_prompt_logprobs(server: str, model: str, ids: Sequence[int], timeout: float = 60.0) -> list[float]:
    """log pi(x_t | x_<t) for t = 1 .. len(ids) - 1 as the server computes it (untempered), via
    vLLM's ``prompt_logprobs`` extension of ``/v1/completions``."""
    import requests

    body = {"model": model, "prompt": [list(map(int, ids))], "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": 0}
    r = requests.post(server.rstrip("/") + "/v1/completions", json=body, timeout=timeout)
    if r.status_code != 200:
        raise WeightSyncError(f"{server}: prompt_logprobs request failed: HTTP {r.status_code}: {r.text[:300]}")
    entries = r.json()["choices"][0].get("prompt_logprobs")
    if not entries or len(entries) != len(ids):
        raise WeightSyncError(f"{server}: the answer has no prompt_logprobs for all {len(ids)} prompt tokens")
    return [float(entries[t][str(int(ids[t]))]["logprob"]) for t in range(1, len(ids))]


# --------------------------------------------------------------------------- the recipe's serving


@dataclass
class ServingConfig:
    """Where the stages sample: in this process (default) or on inference servers."""

    servers: list[str] = field(default_factory=list)
    """Base URLs of OpenAI-compatible servers (``scale/serve_vllm.sh``, or ``minirsi serve``
    for tests), all started on a checkpoint of the actor's architecture; empty: in-process
    ``HFSampler``. With servers every stage samples there (RSR's rollouts and LLM planner, the
    warm-up's frozen actor, RPR, evaluation), each episode pinned to one server: a stage
    pushes its actor to every server before its first rollout, RPR again after every update
    (``minirsi.engine.weight_sync``, full weights). At scale the SLURM job fills this in
    (``scale/slurm/rsi-4x8.sbatch``)."""
    model_name: str = "policy"
    """The name the servers serve (``--served-model-name``)."""
    sync_dir: str = ""
    """Where weights are written for the servers to read (shared storage across nodes);
    "" is RUN_DIR/weights."""
    on_server_failure: str = "fail"
    """A server that stops answering mid-step: "fail" stops the run naming it; "retry" moves
    its episodes to the servers still up and leaves it out from then on."""
    timeout: float = 600.0
    """Seconds for one request (a generation batch, or a reload)."""
    max_retries: int = 3
    """Retries of a request that met a connection error, a timeout or a 5xx."""
    verify_tol: float = 0.0
    """> 0: after each sync, every server's log-probs of a probe sequence must match the
    trainer's within this (``WeightSync``); 0: no check."""
    sync_dtype: str = "bfloat16"
    """dtype of the weights written for the servers: the one they compute in. vLLM serves
    Qwen3 in bfloat16 (half the bytes of float32); "float32" for fp32 servers such as
    ``minirsi serve`` on a CPU, whose log-probs then match the trainer's to float rounding."""

    def __post_init__(self) -> None:
        if self.sync_dtype not in SYNC_DTYPES:
            raise ValueError(f"serving.sync_dtype={self.sync_dtype!r}: use one of {SYNC_DTYPES} (the servers' dtype)")
        for url in self.servers:
            server_base(url)  # raises on a URL without http(s)://
        if self.on_server_failure not in ON_SERVER_FAILURE:
            raise ValueError(f"serving.on_server_failure={self.on_server_failure!r}: use one of {ON_SERVER_FAILURE}")
        if not self.timeout > 0 or self.max_retries < 0 or self.verify_tol < 0:
            raise ValueError("serving.timeout must be > 0, serving.max_retries and serving.verify_tol >= 0")


def serving_sync(serving: ServingConfig, default_dir: Path) -> WeightSync:
    """An ``OpenAISampler`` over ``serving.servers`` and the ``WeightSync`` that feeds them
    (weights under ``serving.sync_dir``, or ``default_dir`` when it is "")."""
    s = serving
    sampler = OpenAISampler(s.servers, s.model_name, timeout=s.timeout, max_retries=s.max_retries,
                            on_server_failure=s.on_server_failure)
    probe = list(range(1, 65)) if s.verify_tol > 0 else ()  # any ids score; the tiny vocab has these
    return WeightSync(sampler, s.sync_dir or default_dir, timeout=s.timeout, retries=s.max_retries,
                      verify_tol=s.verify_tol, probe_ids=probe, dtype=getattr(torch, s.sync_dtype))


def sharded_push(world: World, sync: WeightSync | None) -> Callable[[Any], dict] | None:
    """The weight push after each update: ``sync`` itself in one process; sharded, every rank
    gathers the actor's weights and rank 0 pushes them (rank 0 alone talks to the servers), its
    metrics going to every rank."""
    if world.size == 1:
        return sync

    def push(actor: Any) -> dict:
        plain = world.unsharded(actor)
        return world.on_main(lambda: sync(plain))

    return push

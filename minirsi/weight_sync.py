"""Weight sync: after every actor update, every rollout server samples from the new policy.

Without it every RPR step after the first would sample from stale weights. Two modes, one
protocol over HTTP, the same against ``vllm serve`` (with the worker extension in
``scale/serving/``) and ``minirsi serve`` (which implements the same routes on the CPU)::

    full weights, version v:
        state = gather_full_state_dict(actor)               # all ranks (FSDP: a full-state gather)
        rank 0: write_full_weights(state, sync_dir/v{v})    # safetensors, then an atomic rename
        every server, concurrently, then wait for all:
            POST /collective_rpc {"method": "reload_weights", "args": [dir]}   # the worker extension
            POST /reset_prefix_cache                         # cached KV belongs to the old weights
    LoRA, version v:
        actor.save_pretrained(sync_dir/v{v})                 # the peft adapter only (megabytes)
        every server: POST /v1/load_lora_adapter {"lora_name": "<name>-v{v}", "lora_path": dir}
                      POST /v1/unload_lora_adapter {"lora_name": "<name>-v{v-1}"}
        sampler.model = "<name>-v{v}"                        # the next requests use the new adapter

A new adapter name per version, not a reload in place: vLLM refuses to load a name twice, and a
fresh name also keys a fresh prefix cache (vLLM hashes the LoRA id into each block's key).

Failures are loud. A server that fails any of these requests (after ``retries``) stops the run
with ``WeightSyncError`` naming it; nothing is skipped. Servers the sampler already reported
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

import copy
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

from minirsi.distributed import World
from minirsi.models import token_logprobs
from minirsi.sampler import ON_SERVER_FAILURE, OpenAISampler, server_base

logger = logging.getLogger(__name__)

SYNC_MODES = ("full", "lora")
WEIGHTS_FILE = "model.safetensors"
TIED_KEY = "minirsi_tied"  # safetensors metadata: JSON {alias: name written} of tied parameters


class WeightSyncError(RuntimeError):
    """A server did not take the new weights; the message names it and says what failed."""


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The actor's full state dict, Hugging Face parameter names -> tensors (on rank 0).

    One process here: the module's own ``state_dict``; a peft (LoRA) actor is merged into a copy
    of its base first, so the servers get plain weights. Under FSDP2 this is the one function
    to replace: every rank must call ``torch.distributed.checkpoint.state_dict
    .get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
    cpu_offload=True))`` (a collective), and only rank 0 writes what it returns.
    """
    if hasattr(model, "merge_and_unload"):
        model = copy.deepcopy(model).merge_and_unload()  # deepcopy: keep the live adapter
    return {k: v.detach() for k, v in model.state_dict().items()}


def write_full_weights(state: dict[str, torch.Tensor], out_dir: str | Path) -> int:
    """Write ``state`` as ``out_dir/model.safetensors`` (atomically: a temporary directory, then
    a rename); returns the bytes written. Tied parameters (one tensor under two names, e.g.
    ``lm_head.weight`` and ``model.embed_tokens.weight``) are written once, under the first
    name, and the alias is recorded in the file's metadata (``TIED_KEY``), as safetensors
    refuses shared storage."""
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    unique: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first: dict[tuple[int, tuple[int, ...]], str] = {}
    for name, t in state.items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
            unique[name] = t.contiguous().cpu()
    save_file(unique, str(tmp / WEIGHTS_FILE), metadata={TIED_KEY: json.dumps(tied)})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return sum(t.numel() * t.element_size() for t in unique.values())


def read_full_weights(weights_dir: str | Path) -> dict[str, torch.Tensor]:
    """Read what ``write_full_weights`` wrote, tied aliases restored (``minirsi serve`` uses it)."""
    path = Path(weights_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; weights_dir must be a directory written by "
                                "weight_sync.write_full_weights")
    with safe_open(str(path), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
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
    """

    def __init__(self, sampler: Any, sync_dir: str | Path, mode: str = "full", timeout: float = 600.0,
                 retries: int = 2, keep: int = 2, lora_name: str = "policy-lora", verify_tol: float = 0.0,
                 probe_ids: Sequence[int] = ()):
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
            nbytes = write_full_weights(gather_full_state_dict(actor), out)
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
            steps = [("/collective_rpc", {"method": "reload_weights", "args": [str(path)], "kwargs": {},
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
            self._request(server, route, body)

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
    """Where RPR samples its rollouts: in this process (default) or on inference servers."""

    servers: list[str] = field(default_factory=list)
    """Base URLs of OpenAI-compatible servers (``scale/serve_vllm.sh``, or ``minirsi serve``
    for tests), all started on a checkpoint of the actor's architecture; empty: in-process
    ``HFSampler``. The RPR stages sample there, each episode pinned to one server, and push
    the actor to every server before their first rollout and after every update
    (``minirsi.weight_sync``, full weights); RSR, the warm-up and evaluation sample in-process."""
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

    def __post_init__(self) -> None:
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
                      verify_tol=s.verify_tol, probe_ids=probe)


def sharded_push(world: World, sync: WeightSync | None) -> Callable[[Any], dict] | None:
    """The weight push after each update: ``sync`` itself in one process; sharded, every rank
    gathers the actor's weights and rank 0 pushes them (``sync`` exists on rank 0 only), its
    metrics going to every rank."""
    if world.size == 1:
        return sync

    def push(actor: Any) -> dict:
        plain = world.unsharded(actor)
        return world.on_main(lambda: sync(plain))

    return push

"""Data parallel over episodes with FSDP2: the same RSR and RPR code on W ranks.

Under ``torchrun --nproc_per_node W`` (or ``accelerate launch``) every rank runs the same
recipe. Nothing in tb_gae.py, rpr.py's losses, rsr.py's SFT step or critic.py's value loss
changes; they receive a ``World`` and call its methods at the points where one process and W
processes differ:

* ``shard(model)``: FSDP2, ``fully_shard`` on each decoder layer (the model's
  ``_no_split_modules``), then on the root. Each rank holds 1/W of every parameter, gradient and
  AdamW moment; a layer's full weights exist only while it runs (all-gather), its gradient is
  reduce-scattered straight after its backward (or once per minibatch, ``grad_sync``). bf16
  layers with fp32 reduction and fp32 output heads on CUDA (``fsdp2``), fp32 on CPU.
* ``local(batch)``: this rank's rows of a (micro-)batch that every rank holds whole. The step's
  episodes are collected once (rank 0, see ``rollout_fn``) and broadcast, so every rank draws
  the same minibatches from the same seeded generator and takes rows ``rank, rank + W, ...`` of
  each micro-batch. A rank with no row gets a stand-in row whose action mask is 0: FSDP's
  collectives need every rank in every forward and backward.
* ``normalizer(n_local)``: the loss normaliser. A minibatch's loss is a token mean,
  ``sum_t m_t l_t / N`` over all its action tokens. Rank r computes ``sum over its rows / N``
  would use N all-reduced (summed) over the ranks; FSDP's reduce-scatter averages the W
  gradients, so each rank divides by ``N / W`` instead of N::

      (1/W) sum_r grad(sum_{t in r} l_t) / (N / W) = grad(sum_t l_t) / N

  which is the one-process gradient (up to float summation order). Gloo cannot rescale inside
  the reduce-scatter (PREMUL_SUM), hence the divisor, not a divide factor.
* ``all_sum(x)``: metric sums and the target-KL test, so every rank logs and decides alike.
* ``forward_rows(fn, batch, chunk)``: the no-grad passes before an update (logp_old, V_old, the
  reference), each rank on its rows, all-gathered.

At world size 1 (``SINGLE``) each is the identity: ``local`` returns the batch it is given,
``normalizer`` its argument, ``shard`` the model untouched, and the code path is the
one-process one, bit for bit.

Rollouts and the RSR planner run on rank 0 with an unsharded copy of the weights (``unsharded``),
refreshed from the shards before each use, and their results are broadcast (evaluation runs on
rank 0 from the saved checkpoint):
at scale the sampler is a vLLM server fleet with one client, and a single collector keeps the
episodes, hence the update, identical to a one-process run with the same seeds. Checkpoints are
gathered to full state dicts and written by rank 0 with ``save_pretrained``, so they load at any
world size; optimizer states are not gathered: every rank writes its shards
(``save_optimizers``, torch.distributed.checkpoint), read back at any world size. When inference servers sample (``rollout_fn(..., gather=False)``) rank 0 keeps no
unsharded copy (``shard``/``load_sharded`` with ``keep_unsharded=False``): it keeps a weightless
skeleton (``meta_copy``) and each weight push or save gathers the full weights to its host memory
and fills a transient model with them (``filled``), freed after use.

Loading (``load_sharded``): rank 0 alone reads a checkpoint with ``from_pretrained``; every other
rank builds the same architecture from its config on the meta device (no memory), all ranks
``fully_shard`` and allocate their shards, and rank 0's weights are broadcast tensor by tensor,
each rank keeping its slice (``set_model_state_dict(full_state_dict=True,
broadcast_from_rank0=True)``); non-persistent buffers (RoPE's ``inv_freq``, in no state dict)
are broadcast from rank 0's model. A rank other than 0 never holds more than its shards plus
one full tensor; bench/sharded_load.py measures it.

Settings (``init``): activation checkpointing, the reduce dtype and deferred gradient sync come
from the run config's ``scale`` section under any launcher (torchrun sets no FSDP variable);
``accelerate launch``'s FSDP variables must agree with it.

Launch::

    torchrun --nproc_per_node 2 --no-python minirsi run --preset smoke --out runs/smoke-2
    accelerate launch --config_file scale/accelerate/fsdp2-1x8.yaml -m minirsi.cli run --preset ...
"""

from __future__ import annotations

import copy
import datetime
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import torch
import torch.distributed as dist
from torch import nn

from minirsi.core.episode import forward_by_length, trimmed

logger = logging.getLogger(__name__)


@dataclass
class World:
    """This process's place among the ranks (see the module docstring)."""

    rank: int = 0
    size: int = 1
    device: str = "cpu"
    """Where the sharded models live: cpu (gloo) or cuda:LOCAL_RANK (nccl)."""
    reshard_after_forward: bool = True
    """Free each layer's gathered weights after its forward (ZeRO-3); False keeps them to backward."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward instead of keeping its activations."""
    reduce_dtype: torch.dtype = torch.float32
    """dtype of the gradient reduce-scatter on CUDA (accumulated into fp32 shards either way)."""
    defer_grad_sync: bool = False
    """Reduce-scatter gradients once per minibatch (after its last micro-batch) instead of after
    every micro-batch: no communication in between, at the price of every layer's unsharded
    fp32 gradient held until then (``minirsi plan`` counts it; for LoRA it is the adapters')."""
    shadows: dict[int, nn.Module] = field(default_factory=dict, repr=False)
    """Rank 0: id(sharded model) -> its unsharded copy for sampling."""
    skeletons: dict[int, nn.Module] = field(default_factory=dict, repr=False)
    """Rank 0: id(sharded model) -> its weightless copy (meta parameters, real buffers), for a
    model sharded without an unsharded copy; ``unsharded`` fills a copy of it for each use."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- the four hooks of the algorithm code ---------------------------------------------------

    def local(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rows rank::size of a (B, ...) batch, cut after their longest sequence; a stand-in row
        (row 0, action mask 0) when the rank has none. The batch itself at world size 1."""
        if self.size == 1:
            return batch
        B = batch["attention_mask"].shape[0]
        idx = torch.arange(self.rank, B, self.size)
        if len(idx):
            return trimmed(batch, idx)
        out = trimmed(batch, torch.zeros(1, dtype=torch.long))
        out["action_mask"] = torch.zeros_like(out["action_mask"])  # a forward and backward, no loss
        return out

    def normalizer(self, n_local: torch.Tensor) -> torch.Tensor:
        """N / W with N = the all-reduced sum of the ranks' action-token counts (docstring)."""
        if self.size == 1:
            return n_local
        n = n_local.detach().double().clone()
        dist.all_reduce(n)
        return (n.clamp(min=1) / self.size).to(torch.float32)

    def grad_sync(self, models: Sequence[nn.Module], last: bool) -> None:
        """Before a micro-batch's backward: with ``defer_grad_sync``, the models reduce-scatter
        their gradients only in the minibatch's ``last`` backward (FSDP2's
        ``set_requires_gradient_sync``); otherwise after every one (nothing to do). Identity at
        world size 1."""
        if self.size > 1 and self.defer_grad_sync:
            for m in models:
                m.set_requires_gradient_sync(last)

    def forward_rows(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     batch: dict[str, torch.Tensor], chunk: int) -> torch.Tensor:
        """``episode.forward_by_length`` with the rows split over the ranks (each computes rows
        rank::W, padded to the same count so every rank runs as many passes) and all-gathered."""
        if self.size == 1:
            return forward_by_length(fn, batch, chunk)
        mask = batch["attention_mask"]
        B = mask.shape[0]
        per = -(-B // self.size)
        idx = torch.arange(self.rank, B, self.size)
        idx = torch.cat([idx, idx.new_full((per - len(idx),), int(idx[-1]) if len(idx) else 0)])
        y = forward_by_length(fn, {"input_ids": batch["input_ids"][idx], "attention_mask": mask[idx]}, chunk)
        parts = [torch.empty_like(y) for _ in range(self.size)]
        dist.all_gather(parts, y.contiguous())
        out = torch.zeros(mask.shape, dtype=y.dtype, device=y.device)
        for r, part in enumerate(parts):
            rows = torch.arange(r, B, self.size)
            out[rows] = part[:len(rows)]
        return out

    def all_sum(self, values: Any) -> Any:
        """Sum a float, a list of floats or a tensor over the ranks (identity at world size 1)."""
        if self.size == 1:
            return values
        t = torch.as_tensor(values, dtype=torch.float64).clone()
        dist.all_reduce(t)
        if isinstance(values, torch.Tensor):
            return t.to(values.dtype)
        return t.tolist() if isinstance(values, (list, tuple)) else float(t)

    def shard(self, model: nn.Module, keep_unsharded: bool = True) -> nn.Module:
        """FSDP2 over every rank: each decoder layer, then the root (identity at world size 1).

        ``keep_unsharded``: rank 0 keeps a plain copy in host memory, which ``unsharded`` refreshes
        for sampling and saving (one model's CPU memory on rank 0: the price of sampling with the
        model's own ``generate``). Without it rank 0 keeps a weightless skeleton (meta tensors)
        and ``unsharded`` builds a transient plain model from the gathered weights instead."""
        if self.size == 1:
            return model
        if self.is_main:
            plain = copy.deepcopy(model).eval().requires_grad_(False).to("cpu") if keep_unsharded else None
            skeleton = None if keep_unsharded else meta_copy(model)
        self._fsdp2(model)
        if self.is_main:
            self._remember(model, plain, skeleton)
        return model

    def _fsdp2(self, model: nn.Module) -> None:
        """``fsdp2`` with this world's settings: bf16 on CUDA, resharding, checkpointing."""
        fsdp2(model, bf16=str(self.device).startswith("cuda"), reshard_after_forward=self.reshard_after_forward,
              activation_checkpointing=self.activation_checkpointing, reduce_dtype=self.reduce_dtype)

    def load_sharded(self, load: Callable[[], nn.Module], build: Callable[[], nn.Module],
                     keep_unsharded: bool = True) -> nn.Module:
        """A checkpoint loaded straight into shards: ``load()`` (``from_pretrained``) on rank 0
        alone, ``build()`` (the same architecture from its config) under
        ``torch.device("meta")`` on every rank, ``fully_shard``, each shard allocated on
        ``self.device``, then rank 0's weights broadcast tensor by tensor
        (``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``), each rank
        keeping its slice. Non-persistent buffers (RoPE's ``inv_freq``: not in a state dict,
        garbage after allocation) are broadcast from rank 0's loaded model. Host memory: rank 0
        one full model (the loaded one, kept as the ``unsharded`` copy when ``keep_unsharded``,
        else freed), every other rank one full tensor at a time. ``load()`` itself at world
        size 1 (today's path).

        ``build()`` must give ``load()``'s parameters (names, shapes, dtypes, requires_grad):
        checked on every rank before any weight moves."""
        if self.size == 1:
            return load()
        full, failure = None, None
        if self.is_main:
            try:
                full = load()
            except Exception as e:  # handed to every rank below, so none waits at a collective
                failure = e
        failed = self.broadcast(None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        if failed:
            raise RuntimeError(f"load_sharded: rank 0 could not load the model ({failed})")
        with torch.device("meta"):
            model = build()
        self._match_layout(model, full)
        self._fsdp2(model)
        model.to_empty(device=self.device)  # this rank's shards, uninitialised
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, full.state_dict() if self.is_main else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        source = dict(full.named_buffers()) if self.is_main else {}
        with torch.no_grad():
            for name, buf in model.named_buffers():  # FSDP2 leaves buffers whole on every rank
                if self.is_main:
                    buf.copy_(source[_plain_key(name)])
                dist.broadcast(buf, src=0)
        if self.is_main:
            if keep_unsharded:
                self._remember(model, full.eval().requires_grad_(False).to("cpu"), None)
            else:
                self._remember(model, None, meta_copy(full))
        del full
        return model

    def _match_layout(self, model: nn.Module, full: nn.Module | None) -> None:
        """Refuse a ``build()`` that differs from rank 0's ``load()`` (on every rank at once),
        then copy rank 0's train/eval flags (``from_pretrained`` returns eval mode)."""
        def layout(m: nn.Module) -> list:
            return [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in m.named_parameters()]

        want = self.broadcast((layout(full), [m.training for m in full.modules()]) if self.is_main else None)
        have = layout(model)
        diff = next(((a, b) for a, b in zip(want[0], have) if a != b), None)
        if diff is None and len(want[0]) != len(have):
            diff = (want[0][len(have):][:1], have[len(want[0]):][:1])
        if self.all_sum(float(diff is not None or len(want[1]) != len(list(model.modules())))):
            raise ValueError(f"load_sharded: build() does not give load()'s architecture on rank {self.rank} "
                             f"(loaded vs built: {diff}); build it from the same config, dtype and LoRA settings")
        for m, training in zip(model.modules(), want[1]):
            m.training = training

    def _remember(self, model: nn.Module, plain: nn.Module | None, skeleton: nn.Module | None) -> None:
        self.release(model)  # an id freed by an earlier model may come back
        if plain is not None:
            self.shadows[id(model)] = plain
        else:
            self.skeletons[id(model)] = skeleton

    def release(self, *models: nn.Module) -> None:
        """Forget rank 0's unsharded copy or skeleton of each of ``models`` (a stage's models, at
        its end): the host memory of a copy goes with it, and a later model that Python gives
        the same ``id`` cannot find it."""
        for m in models:
            self.shadows.pop(id(m), None)
            self.skeletons.pop(id(m), None)

    # -- whole models ------------------------------------------------------------------------

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, gathered to CPU on rank 0 ({} elsewhere); all ranks call it."""
        if self.size == 1:
            return {k: v.detach().cpu() for k, v in model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def unsharded(self, model: nn.Module) -> nn.Module | None:
        """Rank 0: a plain model with the sharded ``model``'s current weights (None on other
        ranks); the model itself at world size 1. Every rank must call it (it gathers). The kept
        copy when ``model`` was sharded with ``keep_unsharded``; otherwise a new model built on
        the gathered weights (no copy of them), freed when the caller drops it."""
        if self.size == 1:
            return model
        state = self.full_state_dict(model)
        if not self.is_main:
            return None
        state = {_plain_key(k): v for k, v in state.items()}
        if id(model) in self.skeletons:
            return filled(self.skeletons[id(model)], state)
        shadow = self.shadows[id(model)]
        result = shadow.load_state_dict(state, strict=False)
        own = shadow.state_dict()
        loaded = {own[k].data_ptr() for k in own if k not in result.missing_keys}
        stale = [k for k in result.missing_keys if own[k].data_ptr() not in loaded]  # tied weights came along
        if result.unexpected_keys or stale:
            raise RuntimeError(f"unsharded copy out of step with the shards: missing {stale[:3]}, "
                               f"unexpected {result.unexpected_keys[:3]}")
        return shadow

    def save(self, model: nn.Module, save_fn: Callable[[nn.Module], Any]) -> None:
        """Rank 0 runs ``save_fn(plain model with the gathered weights)``; every rank waits."""
        if self.size == 1:
            save_fn(model)
            return
        plain = self.unsharded(model)
        if self.is_main:
            save_fn(plain)
        self.barrier()

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The whole state of ``optimizer``: ``optimizer.state_dict()`` in one process; a sharded
        run gathers it to rank 0's host, keyed by parameter name (``load_optimizer_state`` reads
        either at any world size). Every rank must call it. Checkpoints do not use it
        (``save_optimizers`` writes shards, nothing gathered); the 2-rank tests compare with it."""
        if self.size == 1:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_optimizers(self, stage_dir: str | os.PathLike, optimizers: dict[str, tuple[nn.Module, Any]]) -> None:
        """Write a stage's optimizer states, ``{name: (model, optimizer)}``, every rank calling it.

        One process: ``stage_dir/optimizer.pt``, ``torch.save({name: optimizer.state_dict()})``.
        Sharded: ``stage_dir/optimizer/``, a ``torch.distributed.checkpoint`` (DCP) directory in
        which every rank writes its own shards of every AdamW moment (one file per rank) and rank
        0 the metadata last; nothing is gathered (the full AdamW state of a 32B actor and critic
        is ~520 GB). ``stage_dir`` must be the same directory on every rank (shared storage
        across nodes). ``load_optimizers`` reads either at any world size."""
        out = Path(stage_dir)
        if self.size == 1:
            torch.save({k: opt.state_dict() for k, (_, opt) in optimizers.items()}, out / OPTIMIZER_FILE)
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        (out / OPTIMIZER_DIR).mkdir(parents=True, exist_ok=True)
        dcp.save({k: get_optimizer_state_dict(m, opt) for k, (m, opt) in optimizers.items()},
                 checkpoint_id=str(out / OPTIMIZER_DIR))

    def load_optimizers(self, stage_dir: str | os.PathLike, optimizers: dict[str, tuple[nn.Module, Any]]) -> bool:
        """Load what ``save_optimizers`` wrote into ``{name: (model, optimizer)}``, from a run of
        any world size (DCP reshards); every rank calls it. False when ``stage_dir`` holds
        neither form (the caller starts from fresh moments)."""
        d = Path(stage_dir)
        if (d / OPTIMIZER_FILE).is_file():
            state = torch.load(d / OPTIMIZER_FILE, weights_only=False)
            for k, (m, opt) in optimizers.items():
                self.load_optimizer_state(m, opt, state[k])
            return True
        if not (d / OPTIMIZER_DIR / ".metadata").is_file():
            return False
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = {k: get_optimizer_state_dict(m, opt) for k, (m, opt) in optimizers.items()}  # the layout to fill
        dcp.load(state, checkpoint_id=str(d / OPTIMIZER_DIR))
        for k, (m, opt) in optimizers.items():
            set_optimizer_state_dict(m, opt, state[k])
        return True

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a whole optimizer state (one process's ``optimizer.state_dict()``, index-keyed,
        or ``optimizer_state``'s, name-keyed), from a run of any world size."""
        by_index = all(isinstance(k, int) for k in state["state"])
        if self.size == 1 and by_index:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if by_index:  # one process wrote it: its indices follow the order the optimizer was built in
            names = [_plain_key(n) for n, p in model.named_parameters() if p.requires_grad]
            state = {"state": {names[i]: v for i, v in state["state"].items()},
                     "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))

    # -- objects -------------------------------------------------------------------------------

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; the episodes of a step are a few MB)."""
        if self.size == 1:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 only and give its result to every rank; an exception it raises
        is raised on every rank (none is left waiting at the broadcast)."""
        if self.size == 1:
            return fn()
        outcome: tuple[bool, Any] = (True, None)
        if self.is_main:
            try:
                outcome = (True, fn())
            except Exception as e:  # handed to every rank, raised there below
                outcome = (False, e)
        ok, value = self.broadcast(outcome)
        if not ok:
            raise value
        return value

    def rollout_fn(self, rollout_fn: Callable[[nn.Module, Sequence[Any], int], list],
                   gather: bool = True) -> Callable:
        """``rollout_fn`` run by rank 0 on the unsharded weights; the episodes go to every rank.
        ``gather=False`` when the sampler does not run the actor (inference servers, which get
        the weights by their own push): rank 0 passes the sharded actor, unread, and nothing is
        gathered."""
        if self.size == 1:
            return rollout_fn

        def fn(actor: nn.Module, tasks: Sequence[Any], seed: int) -> list:
            plain = self.unsharded(actor) if gather else actor
            return self.on_main(lambda: rollout_fn(plain, tasks, seed))

        return fn

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


SINGLE = World()
"""One process: every hook is the identity."""

OPTIMIZER_FILE = "optimizer.pt"
"""A one-process stage's optimizer states (``World.save_optimizers``)."""
OPTIMIZER_DIR = "optimizer"
"""A sharded stage's optimizer states: a torch.distributed.checkpoint directory."""

_current: World = SINGLE


def current() -> World:
    """The world ``init`` set up in this process (``SINGLE`` when none)."""
    return _current


def _exit_with_launcher(period: float = 0.5) -> None:
    """End this rank when its launcher dies. torchrun (and accelerate launch) start each rank in a
    session of its own, so a launcher killed with SIGKILL leaves the ranks running as orphans:
    they would go on writing the run directory while the user resumes it. A daemon thread watches
    the parent pid and exits the process once it has been re-parented."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(period)
            if os.getppid() != parent:
                os.write(2, f"minirsi: rank {os.environ.get('RANK')}: the launcher (pid {parent}) is gone; exiting\n".encode())
                os._exit(1)

    threading.Thread(target=watch, name="minirsi-launcher-watch", daemon=True).start()


def init(device: str = "cpu", scale: Any = None) -> World:
    """Join the process group torchrun / accelerate describe in the environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); ``SINGLE`` when WORLD_SIZE is unset or 1.

    gloo on CPU, nccl on CUDA (each rank on cuda:LOCAL_RANK). ``scale`` (the run config's
    ``ScaleConfig``) sets activation checkpointing, the reduce dtype and deferred gradient sync,
    whatever the launcher: torchrun sets no FSDP variable, so the config is the one place these
    are chosen. Under ``accelerate launch`` the FSDP variables it sets from its YAML
    (FSDP_ACTIVATION_CHECKPOINTING, FSDP_RESHARD_AFTER_FORWARD) must agree with the config: a
    disagreement is an error naming both. Without ``scale`` (tests, tutorials) the variables
    alone decide, as accelerate's YAML says. The collective timeout (MINIRSI_DIST_TIMEOUT_MIN,
    default 180 min) must cover rank 0's rollouts, during which the other ranks wait."""
    global _current
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        _current = SINGLE
        return _current
    settings = fsdp_settings(scale)  # before joining: a bad setting fails every rank alike
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    _exit_with_launcher()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=float(os.environ.get("MINIRSI_DIST_TIMEOUT_MIN", "180")))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    _current = World(rank=rank, size=size, device=device, **settings)
    if _current.is_main:
        logger.info("FSDP2 over %d ranks (%s, %s), activation checkpointing %s, reduce-scatter in %s %s", size,
                    dist.get_backend(), device, "on" if _current.activation_checkpointing else "off",
                    str(_current.reduce_dtype).removeprefix("torch.") if cuda else "float32",
                    "once per minibatch" if _current.defer_grad_sync else "every micro-batch")
    return _current


def fsdp_settings(scale: Any = None) -> dict[str, Any]:
    """World's FSDP fields from the run config's ``scale`` section, checked against the FSDP
    variables ``accelerate launch`` sets (``init``'s docstring); from the variables alone when
    ``scale`` is None."""
    def flag(name: str) -> bool | None:
        value = os.environ.get(name)
        return None if value is None else value.lower() in ("1", "true", "yes")

    env_ckpt, env_reshard = flag("FSDP_ACTIVATION_CHECKPOINTING"), flag("FSDP_RESHARD_AFTER_FORWARD")
    if scale is None:
        return {"activation_checkpointing": bool(env_ckpt), "reshard_after_forward": env_reshard is not False}
    if env_ckpt is not None and env_ckpt != scale.activation_checkpointing:
        raise ValueError(f"the accelerate config sets fsdp_activation_checkpointing: {str(env_ckpt).lower()} "
                         f"(FSDP_ACTIVATION_CHECKPOINTING), the run config scale.activation_checkpointing="
                         f"{str(scale.activation_checkpointing).lower()}: set them alike (the run config decides "
                         "under torchrun, where no such variable is set)")
    return {"activation_checkpointing": scale.activation_checkpointing, "reshard_after_forward": env_reshard is not False,
            "reduce_dtype": getattr(torch, scale.reduce_dtype), "defer_grad_sync": scale.defer_grad_sync}


def shutdown(wait: bool = True) -> None:
    """Leave the process group (``destroy_process_group``), after a barrier unless ``wait`` is
    False (a failing rank must not wait for ranks that may have died); back to ``SINGLE``."""
    global _current
    if dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()
    _current = SINGLE


def exit_rank(code: int = 0) -> NoReturn:
    """End a process of a multi-process run after it has left the process group (``shutdown``):
    flush stdio and logging, then ``os._exit``. Skipping the interpreter's teardown avoids an
    intermittent abort of a gloo rank at exit ("terminate called without an active exception": a
    C++ thread destroyed while still joinable) after every result was written
    (docs/experiments.md, "Measurements behind the code's defaults")."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    logging.shutdown()
    os._exit(code)


def fsdp2(model: nn.Module, bf16: bool, reshard_after_forward: bool = True,
          activation_checkpointing: bool = False, reduce_dtype: torch.dtype = torch.float32) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root, over the default process group (in
    place). ``bf16``: bf16 parameters in compute, gradients reduced in ``reduce_dtype`` (fp32 by
    default; the GPU setting); otherwise fp32 throughout. ``activation_checkpointing`` wraps
    each layer first.

    The output heads compute in fp32 under ``bf16`` (``output_heads``: the LM head, a value
    head): a bf16 head rounds every logit to 8 bits of mantissa (a logit of 20 by up to 0.06),
    which no ``.float()`` after it recovers, and that error lands in the log-probs PPO's ratio
    and the train/sampler gap are made of. An untied head is an FSDP unit of its own with an
    fp32 policy (its input cast to fp32); a head tied to the input embedding cannot be split
    from it, so the root unit (embedding, final norm, head) is fp32 instead."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    low = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype) if bf16 else MixedPrecisionPolicy()
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    layers = decoder_layers(model)
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        kinds = tuple({type(m) for m in layers})
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, kinds))
        layers = decoder_layers(model)
        # A transformers model builds a KV cache in every forward its config allows one (it turns
        # that off itself only under its own gradient checkpointing); a layer recomputed in
        # backward would append its keys to that cache a second time. Sampling uses unsharded
        # copies, whose configs are their own.
        for m in model.modules():
            if getattr(getattr(m, "config", None), "use_cache", False):
                m.config.use_cache = False
    for layer in layers:
        fully_shard(layer, mp_policy=low, reshard_after_forward=reshard_after_forward)
    root = low
    if bf16:
        embedded = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        for head in output_heads(model):
            if any(id(p) in embedded for p in head.parameters()):
                root = fp32  # tied to the input embedding: the root unit holds both
            else:
                fully_shard(head, mp_policy=fp32, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=root, reshard_after_forward=reshard_after_forward)
    return model


def output_heads(model: nn.Module) -> list[nn.Module]:
    """The modules that map hidden states to outputs: a causal LM's ``get_output_embeddings()``
    (through peft) and a value model's ``head``."""
    heads = [getattr(model, "head")] if isinstance(getattr(model, "head", None), nn.Linear) else []
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    lm_head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    return heads + ([lm_head] if isinstance(lm_head, nn.Module) else [])


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: instances of the model's ``_no_split_modules``
    classes (Qwen3: Qwen3DecoderLayer), searched through peft and ValueModel wrappers."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"shard: {type(model).__name__} declares no _no_split_modules; FSDP2 needs the "
                         "decoder layer class to wrap (a transformers model has it)")
    return layers


def _plain_key(key: str) -> str:
    """A state-dict key of a checkpoint-wrapped model without the wrapper's prefix."""
    return key.replace("_checkpoint_wrapped_module.", "")


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are meta tensors (no memory) and whose buffers are
    real copies (small; RoPE's ``inv_freq`` is in no state dict), in eval mode, frozen. Tied
    parameters stay tied."""
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                            for p in model.parameters()}
    skeleton = copy.deepcopy(model, memo).eval()
    return skeleton._apply(lambda t: t if t.is_meta else t.cpu())  # buffers to host memory; .to() refuses meta


def filled(skeleton: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of a ``meta_copy`` skeleton whose parameters are the tensors of ``state`` (a full
    state dict; assigned, not copied); parameters tied in the skeleton are one parameter again
    (a name ``state`` lacks takes its tied twin's). One still without weights is an error."""
    plain = copy.deepcopy(skeleton)
    tied: dict[int, list[str]] = {}
    for name, p in plain.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    result = plain.load_state_dict(state, strict=False, assign=True)  # assign: one parameter per name
    for names in tied.values():  # tie them again, to the first name the state holds
        source = next((n for n in names if n in state), None)
        for n in names if source is not None else ():
            owner, _, leaf = n.rpartition(".")
            setattr(plain.get_submodule(owner), leaf, plain.get_parameter(source))
    empty = [n for n, t in [*plain.named_parameters(), *plain.named_buffers()] if t.is_meta]
    if empty or result.unexpected_keys:
        raise RuntimeError(f"gathered weights do not fill the model: no weights for {empty[:3]}, "
                           f"unexpected {result.unexpected_keys[:3]}")
    return plain.requires_grad_(False)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over shared keys of |a - b| (for the equality tests and the tutorial)."""
    if set(a) != set(b):
        raise ValueError(f"state dicts differ in keys: {sorted(set(a) ^ set(b))[:5]}")
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0 for k in a)


__all__ = ["World", "SINGLE", "current", "init", "shutdown", "decoder_layers", "meta_copy", "filled",
           "max_abs_diff"]

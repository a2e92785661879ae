"""Data parallel over episodes with FSDP2: the same RSR and RPR code on W ranks.

Under ``torchrun --nproc_per_node W`` (or ``accelerate launch``) every rank runs the same
recipe. Nothing in tb_gae.py, rpr.py's losses, rsr.py's SFT step or critic.py's value loss
changes; they receive a ``World`` and call its methods at the points where one process and W
processes differ:

* ``shard(model)``: FSDP2, ``fully_shard`` on each decoder layer (the model's
  ``_no_split_modules``), then on the root. Each rank holds 1/W of every parameter, gradient and
  AdamW moment; a layer's full weights exist only while it runs (all-gather), its gradient is
  reduce-scattered straight after its backward. bf16 parameters with fp32 reduction on CUDA,
  fp32 on CPU.
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
world size.

Launch::

    torchrun --nproc_per_node 2 --no-python minirsi run --preset smoke --out runs/smoke-2
    accelerate launch --config_file scale/accelerate/fsdp2-1x8.yaml -m minirsi.cli run --preset ...
"""

from __future__ import annotations

import copy
import datetime
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from minirsi.episode import forward_by_length, trimmed

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
    shadows: dict[int, nn.Module] = field(default_factory=dict, repr=False)
    """Rank 0: id(sharded model) -> its unsharded copy for sampling."""

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
        for sampling and saving (one model's CPU memory on rank 0: the price of saving and sampling
        with the model's own code, ``save_pretrained`` and ``generate``)."""
        if self.size == 1:
            return model
        if keep_unsharded and self.is_main:
            shadow = copy.deepcopy(model).eval().requires_grad_(False).to("cpu")  # host memory, not the GPU
        fsdp2(model, bf16=str(self.device).startswith("cuda"), reshard_after_forward=self.reshard_after_forward,
              activation_checkpointing=self.activation_checkpointing)
        if keep_unsharded and self.is_main:
            self.shadows[id(model)] = shadow
        return model

    # -- whole models ------------------------------------------------------------------------

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, gathered to CPU on rank 0 ({} elsewhere); all ranks call it."""
        if self.size == 1:
            return {k: v.detach().cpu() for k, v in model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def unsharded(self, model: nn.Module) -> nn.Module | None:
        """Rank 0: the plain copy of a sharded ``model`` with its current weights (None on other
        ranks); the model itself at world size 1. Every rank must call it (it gathers)."""
        if self.size == 1:
            return model
        state = self.full_state_dict(model)
        if not self.is_main:
            return None
        shadow = self.shadows[id(model)]
        result = shadow.load_state_dict({_plain_key(k): v for k, v in state.items()}, strict=False)
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
        """What ``optimizer.pt`` holds: ``optimizer.state_dict()`` in one process; a sharded run
        gathers the full state to rank 0, keyed by parameter name (``load_optimizer_state``
        reads either at any world size). Every rank must call it."""
        if self.size == 1:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load what ``optimizer_state`` wrote, from a run of any world size."""
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
        """Run ``fn`` on rank 0 only and give its result to every rank."""
        if self.size == 1:
            return fn()
        return self.broadcast(fn() if self.is_main else None)

    def rollout_fn(self, rollout_fn: Callable[[nn.Module, Sequence[Any], int], list]) -> Callable:
        """``rollout_fn`` run by rank 0 on the unsharded weights; the episodes go to every rank."""
        if self.size == 1:
            return rollout_fn

        def fn(actor: nn.Module, tasks: Sequence[Any], seed: int) -> list:
            plain = self.unsharded(actor)
            return self.on_main(lambda: rollout_fn(plain, tasks, seed))

        return fn

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


SINGLE = World()
"""One process: every hook is the identity."""

_current: World = SINGLE


def current() -> World:
    """The world ``init`` set up in this process (``SINGLE`` when none)."""
    return _current


def init(device: str = "cpu") -> World:
    """Join the process group torchrun / accelerate describe in the environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); ``SINGLE`` when WORLD_SIZE is unset or 1.

    gloo on CPU, nccl on CUDA (each rank on cuda:LOCAL_RANK). accelerate's FSDP settings are
    honoured: FSDP_RESHARD_AFTER_FORWARD, FSDP_ACTIVATION_CHECKPOINTING. The collective timeout
    (MINIRSI_DIST_TIMEOUT_MIN, default 180 min) must cover rank 0's evaluation, during which the
    other ranks wait at a barrier."""
    global _current
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        _current = SINGLE
        return _current
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=float(os.environ.get("MINIRSI_DIST_TIMEOUT_MIN", "180")))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    flag = lambda name, default: os.environ.get(name, default).lower() in ("1", "true", "yes")  # noqa: E731
    _current = World(rank=rank, size=size, device=device,
                     reshard_after_forward=flag("FSDP_RESHARD_AFTER_FORWARD", "true"),
                     activation_checkpointing=flag("FSDP_ACTIVATION_CHECKPOINTING", "false"))
    if _current.is_main:
        logger.info("FSDP2 over %d ranks (%s, %s)", size, dist.get_backend(), device)
    return _current


def shutdown(wait: bool = True) -> None:
    """Leave the process group (``destroy_process_group``), after a barrier unless ``wait`` is
    False (a failing rank must not wait for ranks that may have died); back to ``SINGLE``."""
    global _current
    if dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()
    _current = SINGLE


def fsdp2(model: nn.Module, bf16: bool, reshard_after_forward: bool = True,
          activation_checkpointing: bool = False) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root, over the default process group (in
    place). ``bf16``: bf16 parameters in compute, fp32 gradient reduction (the GPU setting);
    otherwise fp32 throughout. ``activation_checkpointing`` wraps each layer first."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    layers = decoder_layers(model)
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        kinds = tuple({type(m) for m in layers})
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, kinds))
        layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model


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


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over shared keys of |a - b| (for the equality tests and the tutorial)."""
    if set(a) != set(b):
        raise ValueError(f"state dicts differ in keys: {sorted(set(a) ^ set(b))[:5]}")
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0 for k in a)


__all__ = ["World", "SINGLE", "current", "init", "shutdown", "decoder_layers", "max_abs_diff"]

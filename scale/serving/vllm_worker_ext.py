"""minirsi's vLLM worker extension: load the policy's full weights from a directory, in place.

The one file of minirsi that touches vLLM (for type hints, and ``get_tp_group`` when it runs
inside a worker): vLLM mixes this class into its own ``Worker`` at start-up, so ``self`` below
*is* the worker. Start the server with::

    VLLM_SERVER_DEV_MODE=1 PYTHONPATH=scale/serving:$PYTHONPATH \
        vllm serve MODEL --worker-extension-cls vllm_worker_ext.MinirsiWorkerExtension ...

(``scale/serve_vllm.sh`` does this). The trainer (``minirsi.engine.weight_sync.WeightSync``) then, after
every actor update, writes the weights (bf16 safetensors, in shards of a few GB with a
``model.safetensors.index.json``) and sends

    POST /collective_rpc {"method": "minirsi_load_weights", "args": ["DIR"]}
        -> vLLM runs ``minirsi_load_weights(DIR)`` on every worker (each GPU of the
           tensor-parallel group) and answers with each worker's result when all are done;
    POST /reset_prefix_cache
        -> drops the cached KV blocks, computed with the old weights ({"success": false} when
           blocks are still held: the trainer retries, then stops).

Names. vLLM refuses to start when an extension attribute already exists on its ``Worker``
(``vllm/v1/worker/worker_base.py`` in 0.33, ``vllm/worker/worker_base.py`` in 0.11: an
``assert not hasattr(worker_class, attr)`` for every non-dunder name); ``Worker`` has had its own
``reload_weights`` since 0.11 (0.33: ``reload_weights(weights_iterator=, weights_path=)``, which
0.11 lacks). So every name here starts with ``minirsi_``; ``vllm_recorded.json`` records
the names of both versions' ``Worker`` (``record_vllm.py`` reads them from the source)
and ``tests/test_serving.py`` checks the extension against it.

Tensor parallelism. Every worker of a TP group needs a slice of every tensor (vLLM's
``load_weights`` narrows each full tensor to this worker's shard, knowing the fused qkv and
gate_up layouts). Instead of each of the TP workers reading the whole checkpoint, worker ``r``
reads the shard files ``r, r + TP, ...`` and broadcasts each tensor it read over the TP group
(NCCL over NVLink, the group vLLM built: ``get_tp_group()``); the others receive into an empty
tensor shaped from the file's header. Storage is read once per server, spread over its GPUs.

How others do it, and why this way. TRL (``trl vllm-serve``, ``WeightSyncWorkerExtension``) and
SkyRL (``WorkerWrap``) open an NCCL group between trainer rank 0 and the vLLM workers and
broadcast each tensor; prime-rl's filesystem mode (``FileSystemWeightUpdateWorker``,
``update_weights_from_path``) has the trainer write a Hugging Face checkpoint to shared storage
and every worker re-run vLLM's model loader on it. All of them end in the model's
``load_weights(iterable of (HF name, tensor))``. We take the filesystem route (no NCCL group
to set up across jobs, works across nodes, a failed load is an HTTP error naming the server)
and call ``load_weights`` directly. The cost is a write and a read of the bf16 model per update
(scale/README.md has the estimate); an NCCL broadcast from the trainer would avoid the disk,
LoRA hot-loading (``/v1/load_lora_adapter``) avoids the size.

Read against vLLM 0.11.0 and 0.33.0's source (``--worker-extension-cls``,
``self.model_runner.model.load_weights`` returning the set of loaded names, ``get_tp_group()``
with ``rank_in_group``, ``world_size``, ``device``, ``broadcast(tensor, src)``, the dev-mode
``/collective_rpc`` and ``/reset_prefix_cache`` routes); tested here against a fake worker and
a 2-process gloo group standing in for the TP group (tests/test_serving.py,
tests/dist_tp_load.py). Unquantised (bf16/fp16/fp32) weights only: quantised models need vLLM's
``process_weights_after_loading`` after the load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

if TYPE_CHECKING:  # the real base class, for type checkers only; at run time vLLM does the mixing
    from vllm.v1.worker.gpu_worker import Worker as _Base
else:
    _Base = object

INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def weight_files(weights_dir: str | Path) -> list[Path]:
    """The safetensors files of a directory, in order: those its index names, else every
    ``*.safetensors``."""
    d = Path(weights_dir)
    if (d / INDEX_FILE).is_file():
        return [d / f for f in sorted(set(json.loads((d / INDEX_FILE).read_text())["weight_map"].values()))]
    return sorted(d.glob("*.safetensors"))


def stream_weights(files: list[Path], group: Any, stats: dict[str, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of ``files`` on every worker of ``group``: file i is read
    by worker ``i % world_size`` and broadcast from it (module docstring). ``stats`` counts
    what this worker read from storage ("files_read", "bytes_read") and the tensors it yields."""
    from safetensors import safe_open

    size = getattr(group, "world_size", 1)
    rank, device = getattr(group, "rank_in_group", 0), getattr(group, "device", "cpu")
    for i, path in enumerate(files):
        owner = i % size
        stats["files_read"] += rank == owner
        with safe_open(str(path), framework="pt", device="cpu") as f:  # the header only, unless this worker reads
            for name in f.keys():
                if rank == owner:
                    t = f.get_tensor(name)
                    stats["bytes_read"] += t.numel() * t.element_size()
                    t = t.to(device)
                else:
                    sl = f.get_slice(name)
                    t = torch.empty(sl.get_shape(), dtype=_DTYPES[sl.get_dtype()], device=device)
                if size > 1:
                    group.broadcast(t, src=owner)
                stats["tensors"] += 1
                yield name, t


class MinirsiWorkerExtension(_Base):
    """Methods the trainer calls on every vLLM worker through ``/collective_rpc``."""

    minirsi_tp_group: Any = None
    """The group the TP workers share; None: vLLM's ``get_tp_group()`` (a test sets a stand-in)."""

    def minirsi_load_weights(self, weights_dir: str) -> dict[str, Any]:
        """Load every tensor of ``weights_dir`` into this worker's model, reading this worker's
        share of the files (module docstring).

        Returns {"tensors": loaded here, "loaded": parameters the model reported loaded,
        "files_read", "bytes_read": this worker's reads}. Raises when the directory has no
        weights or the model reports parameters it did not receive (a checkpoint of another
        architecture must not half-load silently).
        """
        files = weight_files(weights_dir)
        if not files:
            raise FileNotFoundError(f"minirsi_load_weights: no *.safetensors in {weights_dir}")
        group = self.minirsi_tp_group
        if group is None:
            from vllm.distributed.parallel_state import get_tp_group

            group = get_tp_group()
        model = self.model_runner.model
        model = getattr(model, "runnable", model)  # some versions wrap it for CUDA graphs
        stats = {"tensors": 0, "files_read": 0, "bytes_read": 0}
        stream = stream_weights(files, group, stats)
        try:
            loaded = model.load_weights(weights=stream)
        except Exception:
            for _ in stream:  # take part in the rest of the group's broadcasts, so no worker waits forever
                pass
            raise
        if loaded is not None:
            expected = {name for name, _ in model.named_parameters()}
            missing = sorted(expected - set(loaded))
            if missing:
                raise RuntimeError(f"minirsi_load_weights {weights_dir}: {len(missing)} parameters not in the "
                                   f"checkpoint, e.g. {missing[:3]}; the model now mixes old and new weights: restart it")
        return {**stats, "loaded": None if loaded is None else len(loaded)}

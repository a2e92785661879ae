"""minirsi's vLLM worker extension: reload the policy's full weights from a directory, in place.

The one file of minirsi that touches vLLM (and only for type hints: vLLM mixes this class into
its own ``Worker`` at start-up, so ``self`` below *is* the worker). Start the server with::

    VLLM_SERVER_DEV_MODE=1 PYTHONPATH=scale/serving:$PYTHONPATH \
        vllm serve MODEL --worker-extension-cls vllm_worker_ext.MinirsiWorkerExtension ...

(``scale/serve_vllm.sh`` does this). The trainer (``minirsi.weight_sync.WeightSync``) then, after
every actor update, writes ``DIR/model.safetensors`` and sends

    POST /collective_rpc {"method": "reload_weights", "args": ["DIR"]}
        -> vLLM runs ``reload_weights(DIR)`` on every worker (each GPU of the tensor-parallel
           group) and answers when all are done;
    POST /reset_prefix_cache
        -> drops the cached KV blocks, computed with the old weights.

The prefix cache is a second request because it lives in the engine core's scheduler (the KV
block manager), which a worker cannot reach; the API server's route can. Both routes exist only
with ``VLLM_SERVER_DEV_MODE=1``: keep these servers on a private network.

How others do it, and why this way. TRL (``trl vllm-serve``, ``WeightSyncWorkerExtension``) and
SkyRL (``WorkerWrap``) open an NCCL group between trainer rank 0 and the vLLM workers and
broadcast each tensor; prime-rl's filesystem mode (``FileSystemWeightUpdateWorker``) has the
trainer write a Hugging Face checkpoint to shared storage and the workers re-run vLLM's model
loader on it. All of them end in the model's ``load_weights(iterable of (HF name, tensor))``,
which knows each architecture's fused layouts (qkv, gate_up) and shards every tensor for this
worker's tensor-parallel rank. We take the filesystem route (no NCCL group to set up across
jobs, works across nodes, a failed reload is an HTTP error naming the server) and call
``load_weights`` directly on the safetensors file, as TRL and SkyRL do with their tensors.
The cost is a write and a read of the model per update (scale/README.md has the estimate); an
NCCL broadcast would avoid the disk, LoRA hot-loading (``/v1/load_lora_adapter``) avoids the
size.

Written against vLLM's V1 engine API as of vLLM 0.10-0.15 (``--worker-extension-cls``,
``self.model_runner.model.load_weights`` returning the set of loaded names, the dev-mode
``/collective_rpc`` and ``/reset_prefix_cache`` routes); tested here only against a fake
worker (tests/test_serving.py), never on a GPU. Unquantised (bf16/fp16/fp32) weights only:
quantised models need vLLM's ``process_weights_after_loading`` after the load.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:  # the real base class, for type checkers only; at run time vLLM does the mixing
    from vllm.v1.worker.gpu_worker import Worker as _Base
else:
    _Base = object


class MinirsiWorkerExtension(_Base):
    """Methods the trainer calls on every vLLM worker through ``/collective_rpc``."""

    def reload_weights(self, weights_dir: str) -> dict[str, Any]:
        """Load every ``*.safetensors`` file of ``weights_dir`` into this worker's model.

        Returns {"tensors": read, "loaded": parameters the model reported loaded}. Raises when
        the directory has no weights or the model reports parameters it did not receive (a
        checkpoint of another architecture must not half-load silently).
        """
        from safetensors import safe_open

        files = sorted(Path(weights_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"reload_weights: no *.safetensors in {weights_dir}")
        model = self.model_runner.model
        model = getattr(model, "runnable", model)  # some versions wrap it for CUDA graphs
        read = 0

        def weights() -> Iterator[tuple[str, Any]]:
            nonlocal read
            for f in files:
                with safe_open(str(f), framework="pt", device="cpu") as sf:  # load_weights moves each to GPU
                    for name in sf.keys():
                        read += 1
                        yield name, sf.get_tensor(name)

        loaded = model.load_weights(weights=weights())
        if loaded is not None:
            expected = {name for name, _ in model.named_parameters()}
            missing = sorted(expected - set(loaded))
            if missing:
                raise RuntimeError(f"reload_weights {weights_dir}: {len(missing)} parameters not in the checkpoint, "
                                   f"e.g. {missing[:3]}; the model now mixes old and new weights: restart it")
        return {"tensors": read, "loaded": None if loaded is None else len(loaded)}

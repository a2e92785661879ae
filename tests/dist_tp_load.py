"""Run under ``torchrun --nproc_per_node 2 tests/dist_tp_load.py MODEL_DIR WEIGHTS_DIR WANT.pt OUT``
(tests/test_serving.py does): two gloo processes stand in for the tensor-parallel workers of
one vLLM server. Each is a worker with minirsi's extension mixed in, its TP group a stand-in
with vLLM's GroupCoordinator interface (``world_size``, ``rank_in_group``, ``device``,
``broadcast(tensor, src)``); ``minirsi_load_weights(WEIGHTS_DIR)`` reads this worker's share
of the shard files and receives the rest. Each rank writes OUT.RANK.json: what it read, what
it loaded, and the largest difference between its model and WANT.pt. Not a pytest module."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from minirsi.engine.models import load_actor
from vllm_worker_ext import MinirsiWorkerExtension  # scale/serving on PYTHONPATH, as serve_vllm.sh sets it


class Group:
    """The part of vLLM's GroupCoordinator (get_tp_group()) the extension uses."""

    def __init__(self) -> None:
        self.world_size, self.rank_in_group, self.device = dist.get_world_size(), dist.get_rank(), "cpu"

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(tensor, src=src)
        return tensor


class Model(torch.nn.Module):
    """What the extension needs of a vLLM model: ``load_weights(iterable)`` -> loaded names."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def named_parameters(self, *args, **kwargs):
        return self.inner.named_parameters(*args, **kwargs)

    def load_weights(self, weights):
        params, loaded = dict(self.inner.named_parameters()), set()
        with torch.no_grad():
            for name, t in weights:
                params[name].copy_(t)
                loaded.add(name)
        return loaded


class Worker(MinirsiWorkerExtension):
    def __init__(self, model: torch.nn.Module) -> None:
        self.model_runner = SimpleNamespace(model=Model(model))
        self.minirsi_tp_group = Group()


def main() -> None:
    model_dir, weights, want, out = sys.argv[1:5]
    dist.init_process_group("gloo")
    actor = load_actor(model_dir)[0].to(torch.bfloat16)  # vLLM serves in bf16
    result = Worker(actor).minirsi_load_weights(weights)
    ref = torch.load(want)
    params = dict(actor.named_parameters())
    result["max_diff"] = max(float((params[k].float() - ref[k].float()).abs().max()) for k in params)
    Path(f"{out}.{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

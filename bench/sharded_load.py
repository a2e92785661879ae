"""Benchmark: host memory of loading a checkpoint into FSDP2 shards on 2 gloo processes, the
every-rank way against ``World.load_sharded`` (minirsi/core/distributed.py), in one run.

    python bench/sharded_load.py                     # ~1-2 minutes on 2 CPU cores, ~3 GB of memory
    python bench/sharded_load.py --hidden 1024 --layers 16 --vocab 32768

Builds a random Qwen3 from a config (``--hidden``, ``--layers``, ``--vocab``; ~84M parameters,
336 MB in fp32 by default), saves it with ``save_actor`` in a temporary directory (nothing is
downloaded), then, each in a fresh pair of processes, shards it three ways:

* ``every rank``: each rank ``load_actor`` (``from_pretrained``), then ``World.shard``: rank 0
  deep-copies its unsharded copy first (the path before ``load_sharded``);
* ``rank 0 loads``: ``load_actor_sharded``: rank 0 ``from_pretrained`` (kept as its unsharded
  copy), rank 1 builds on the meta device and receives its shards, tensor by tensor;
* ``rank 0 loads, servers``: the same with ``keep_unsharded=False`` (servers sample), then one
  gather for a weight push (``World.unsharded``, what ``_sharded_push`` hands to ``WeightSync``).

Prints, per rank, in MB: RSS after imports and ``init`` (the baseline), peak RSS (``VmHWM``)
and RSS after loading; for the push, the peak during it (``VmHWM`` reset just before), RSS after
it, after a second push, and after ``malloc_trim`` (glibc keeps freed blocks under its mmap
threshold, up to 32 MB, for reuse; larger tensors go back at once); then the ratios of the peak
increases over the baseline. The load's result is checked, not just its memory: rank 0 prints
the largest difference between the gathered shards and the saved weights (0 is right).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minirsi.core import distributed  # noqa: E402
from minirsi.core.distributed import max_abs_diff  # noqa: E402
from minirsi.engine.models import build_tokenizer, load_actor, load_actor_sharded, save_actor  # noqa: E402

MODES = ("every rank", "rank 0 loads", "rank 0 loads, servers")


def rss_mb() -> dict[str, float]:
    """This process's resident set now (VmRSS) and its peak so far (VmHWM), in MB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def save_model(args: argparse.Namespace, out: Path) -> int:
    """A random Qwen3 of the given shape with a ChatML tokenizer, written by ``save_actor``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = build_tokenizer(["```bash\nls -la\n```\n<|im_end|>\n"] * 10, vocab_size=300)
    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=4,
                      head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    save_actor(model, tok, out)
    return sum(p.numel() for p in model.parameters())


def worker(rank: int, port: int, mode: str, ckpt: str, out: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    world = distributed.init("cpu")
    world.barrier()
    record = {"baseline": rss_mb()["VmRSS"]}
    if mode == "every rank":
        actor = world.shard(load_actor(ckpt)[0])
    else:
        actor, _ = load_actor_sharded(ckpt, world, keep_unsharded=mode == "rank 0 loads")
    world.barrier()
    now = rss_mb()
    record.update(peak=now["VmHWM"], after=now["VmRSS"])
    if mode == "rank 0 loads, servers":
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS, so the push's own peak shows
        plain = world.unsharded(actor)  # the gather of one push; freed when dropped
        record["push_peak"] = rss_mb()["VmHWM"]
        record["push_params"] = sum(p.numel() for p in plain.parameters()) if plain is not None else 0
        del plain
        record["after_push"] = rss_mb()["VmRSS"]
        world.unsharded(actor)  # a second push, dropped at once: freed memory is reused, nothing accumulates
        record["after_push2"] = rss_mb()["VmRSS"]
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # what glibc keeps of freed small blocks goes back
        record["trimmed"] = rss_mb()["VmRSS"]
    state = world.full_state_dict(actor)
    if world.is_main:
        saved = load_actor(ckpt)[0].state_dict()
        record["diff"] = max_abs_diff(state, {k: saved[k] for k in state})
    out[(mode, rank)] = record
    distributed.shutdown()
    distributed.exit_rank(0)  # skip the interpreter's teardown (minirsi.core.distributed.exit_rank)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=8192)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="minirsi-bench-load-") as tmp:
        n = save_model(args, Path(tmp) / "actor")
        print(f"model: {n / 1e6:.1f}M parameters, {n * 4 / 1e6:.0f} MB in fp32 (hidden {args.hidden}, "
              f"{args.layers} layers, vocab {args.vocab}); RSS in MB")
        out = mp.Manager().dict()
        for mode in MODES:
            mp.spawn(worker, args=(free_port(), mode, str(Path(tmp) / "actor"), out), nprocs=2, join=True)
    print(f"{'path':24} {'rank':>4} {'baseline':>9} {'peak':>7} {'+peak':>7} {'after':>7} {'push peak':>10} "
          f"{'after push':>11} {'after 2nd':>10} {'trimmed':>8}")
    for mode in MODES:
        for rank in (0, 1):
            r = out[(mode, rank)]
            push = (f"{r['push_peak']:10.0f} {r['after_push']:11.0f} {r['after_push2']:10.0f} {r['trimmed']:8.0f}"
                    if "push_peak" in r else "")
            print(f"{mode:24} {rank:4d} {r['baseline']:9.0f} {r['peak']:7.0f} {r['peak'] - r['baseline']:7.0f} "
                  f"{r['after']:7.0f} {push}")
    grow = {m: out[(m, 1)]["peak"] - out[(m, 1)]["baseline"] for m in MODES}
    grow0 = {m: out[(m, 0)]["peak"] - out[(m, 0)]["baseline"] for m in MODES}
    print(f"rank 1 peak increase, rank 0 loads / every rank: {grow['rank 0 loads'] / grow['every rank']:.2f}")
    print(f"rank 0 peak increase, rank 0 loads / every rank: {grow0['rank 0 loads'] / grow0['every rank']:.2f}")
    print("gathered shards vs saved weights, max |diff|: "
          + ", ".join(f"{m}: {out[(m, 0)]['diff']:.1e}" for m in MODES))


if __name__ == "__main__":
    main()

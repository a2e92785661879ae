"""Benchmark: peak host memory of scoring a sequence, the model's logits against ``minirsi.core.scoring``.

    python bench/logits.py                          # ~1 minute on 2 CPU cores, ~2.5 GB at its peak
    python bench/logits.py --tokens 4096 --vocab 65536 --chunk 512

The passes that score every token, as the trainer runs them: RPR's no-grad scoring pass
(``rpr.policy_forward`` as ``rpr.prepare_batch`` calls it: log-probs at a temperature, for
logp_old and the reference), its PPO update pass (log-probs with gradients and the entropy, a
metric, or with ``--entropy-grad`` a loss term as when ``entropy_coef > 0``; backward
included) and RSR's SFT pass (``rsr.sft_loss`` and its backward). Each of the six cases (those
three x whole / chunked) runs in a fresh process on a random 2-layer Qwen3 whose vocabulary is
large (``--vocab``), so the (T, V) tensors dominate. It prints the peak resident memory above
the process's baseline (``VmHWM``, reset just before the pass), that peak divided by T x V
(bytes per token per vocabulary entry: what ``minirsi.run.memplan`` charges a whole pass) and, for
the chunked cases, divided by c x V (c = ``--chunk``: what it charges a chunked one). Each
chunked case also checks its result against the whole path on the same inputs (largest
|difference| of log-probs, entropies and, with gradients, parameter gradients).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sharded_load import rss_mb  # noqa: E402

PASSES = ("no grad", "update", "sft")
"""The no-grad scoring pass, the PPO update's forward + backward, RSR's SFT loss + backward."""
CASES = tuple((kind, how) for kind in PASSES for how in ("whole", "chunked"))


def model_and_inputs(args: argparse.Namespace):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                      max_position_embeddings=args.tokens)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    return model, ids


def score(model, ids, kind: str, chunk: int, entropy_grad: bool):
    from minirsi.core.rpr import policy_forward
    from minirsi.core.rsr import sft_loss

    model.zero_grad(set_to_none=True)
    ones = torch.ones_like(ids)
    if kind == "sft":
        loss = sft_loss(model, ids, ones, ones.float(), logit_chunk=chunk)
        loss.backward()
        return loss.detach()[None], torch.zeros(1), [p.grad.clone() for p in model.parameters()]
    grad = kind == "update"
    with torch.enable_grad() if grad else torch.no_grad():
        lp, ent = policy_forward(model, ids, ones, 0.8, with_entropy=grad, entropy_grad=entropy_grad,
                                 logit_chunk=chunk)
        if grad:
            (lp.sum() + (0.01 * ent.sum() if entropy_grad else 0.0)).backward()
    grads = [p.grad.clone() for p in model.parameters()] if grad else []
    return lp.detach(), (ent.detach() if ent is not None else torch.zeros(1)), grads


def case(args: argparse.Namespace, kind: str, chunked: bool, out) -> None:
    torch.set_num_threads(1)
    model, ids = model_and_inputs(args)
    chunk = args.chunk if chunked else 0
    eg = kind == "update" and args.entropy_grad
    score(model, ids[:, :64], kind, chunk, eg)  # warm the allocator and kernels on a short input
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = rss_mb()["VmRSS"]
    lp, ent, grads = score(model, ids, kind, chunk, eg)
    peak = rss_mb()["VmHWM"] - base
    ref = score(model, ids, kind, 0, eg) if chunked else (lp, ent, grads)
    diff = max([float((lp - ref[0]).abs().max()), float((ent - ref[1]).abs().max())]
               + [float((a - b).abs().max()) for a, b in zip(grads, ref[2])])
    out.put((peak, diff))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048, help="T: one sequence of this many tokens")
    p.add_argument("--vocab", type=int, default=32768, help="V")
    p.add_argument("--chunk", type=int, default=512, help="c: positions per piece (logit_chunk)")
    p.add_argument("--entropy-grad", action="store_true", help="the entropy is a loss term (entropy_coef > 0)")
    args = p.parse_args()
    TV, cV = args.tokens * args.vocab, args.chunk * args.vocab
    print(f"one sequence of T={args.tokens} tokens, V={args.vocab}: one fp32 (T, V) tensor is {4 * TV / 2**20:.0f} MB; "
          f"chunk c={args.chunk}; entropy {'in the loss' if args.entropy_grad else 'a metric'}")
    ctx = mp.get_context("spawn")
    peaks = {}
    for kind, how in CASES:
        q = ctx.Queue()
        proc = ctx.Process(target=case, args=(args, kind, how == "chunked", q))
        proc.start()
        peak, diff = q.get()
        proc.join()
        peaks[(kind, how)] = peak
        per = f"{peak * 2**20 / TV:5.2f} B per T x V" + (f", {peak * 2**20 / cV:5.2f} B per c x V" if how == "chunked" else "")
        print(f"{kind:7s} {how:7s}: peak +{peak:7.1f} MB ({per}); |diff| vs whole {diff:.2e}", flush=True)
    for kind in PASSES:
        print(f"{kind}: chunked peak / whole peak = {peaks[(kind, 'chunked')] / peaks[(kind, 'whole')]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

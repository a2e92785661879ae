"""GPU check: one RSR (SFT) step and one RPR (PPO) step of a ~0.6B Qwen3-shaped model with bf16
FSDP2 on one CUDA GPU, measured beside the planner's prediction (minirsi/memplan.py).

    python scale/gpu_check.py                      # ~1-2 minutes on an H100/H200; no download
    python scale/gpu_check.py --seq-len 4096 --micro-batch 2 --checkpointing

The model is built from Qwen3-0.6B's config numbers (random weights, a made-up vocabulary of
the same size: nothing is downloaded), the episodes are synthetic token sequences with the
action/observation structure of real ones. It runs the library's own ``rsr.sft`` and
``rpr.prepare_batch`` + ``rpr.ppo_update`` on a model sharded by ``minirsi.distributed.fsdp2``
over a one-rank NCCL group, and prints, per step, tokens/s and peak memory, and the planner's
per-GPU memory and step time for the same shape. Exit code 0 when both steps ran and the
measured peak is within the planner's estimate plus 25% (the check that the planner is not
optimistic); 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from minirsi.critic import build_critic  # noqa: E402
from minirsi.distributed import fsdp2  # noqa: E402
from minirsi.episode import Episode  # noqa: E402
from minirsi.memplan import GIB, KNOWN_SHAPES, ScaleConfig, plan  # noqa: E402
from minirsi.rpr import RPRConfig, make_optimizers, ppo_update, prepare_batch  # noqa: E402
from minirsi.rsr import RSRConfig, make_optimizer, sft  # noqa: E402


def synthetic_episodes(n: int, seq_len: int, vocab: int, seed: int = 0) -> list[Episode]:
    """n episodes of exactly seq_len tokens: a 64-token prompt, then turns of a 64-token action
    and a 192-token observation (the last turn ends on its action)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids, mask, turns, lps = [rng.randrange(vocab) for _ in range(64)], [0] * 64, [0] * 64, [None] * 64
        k = 0
        while len(ids) < seq_len:
            a = min(64, seq_len - len(ids))
            ids += [rng.randrange(vocab) for _ in range(a)]
            mask += [1] * a
            turns += [k] * a
            lps += [-1.0] * a
            o = min(192, seq_len - len(ids) - 1)
            if o <= 0:
                break
            k += 1
            ids += [rng.randrange(vocab) for _ in range(o)]
            mask += [0] * o
            turns += [k] * o
            lps += [None] * o
        out.append(Episode(task_id="gpu", family="f", difficulty="easy", token_ids=ids, logprobs=lps,
                           action_mask=mask, turn_ids=turns, turns=k + 1, success=bool(rng.random() < 0.5),
                           passed=1, total=2))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per forward/backward")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per layer")
    p.add_argument("--gpu-mem-gib", type=float, default=0.0, help="default: the device's own memory")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; this script is for a GPU machine", file=sys.stderr)
        return 1
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    s = KNOWN_SHAPES["Qwen/Qwen3-0.6B"]
    config = Qwen3Config(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                         num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         head_dim=s.head_dim, tie_word_embeddings=s.tied, max_position_embeddings=max(4096, args.seq_len))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    actor = Qwen3ForCausalLM(config).to("cuda")
    critic = build_critic(actor, head_init_std=0.01).to("cuda")
    for m in (actor, critic):
        fsdp2(m, bf16=True, activation_checkpointing=args.checkpointing)
    episodes = synthetic_episodes(args.episodes, args.seq_len, s.vocab)
    tokens = sum(len(e.token_ids) for e in episodes)
    mem = args.gpu_mem_gib or torch.cuda.get_device_properties(0).total_memory / GIB
    prediction = plan(s, ScaleConfig(gpus=1, gpu_mem_gib=mem, reserve_gib=0, seq_len=args.seq_len,
                                     micro_batch=args.micro_batch, activation_checkpointing=args.checkpointing,
                                     tokens_per_step=tokens, ppo_epochs=1))
    print(f"model: Qwen3-0.6B shape, {s.actor_params / 1e9:.2f}B actor + {s.critic_params / 1e9:.2f}B critic; "
          f"{args.episodes} episodes x {args.seq_len} tokens, micro-batch {args.micro_batch}")

    # RSR: one SFT step (one batch of all episodes, micro-batch = the batch here)
    torch.cuda.reset_peak_memory_stats()
    scfg = RSRConfig(epochs=1, batch_size=args.micro_batch, lr=1e-5)
    examples = [(e.token_ids, e.action_mask) for e in episodes[:args.micro_batch]]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    sft(actor, examples, scfg, pad_id=0, optimizer=make_optimizer(actor, scfg))
    torch.cuda.synchronize()
    t_sft = time.perf_counter() - t0
    peak_sft = torch.cuda.max_memory_allocated() / GIB
    sft_tokens = sum(len(x) for x, _ in examples)

    # RPR: prepare (no-grad logp_old, V_old, TB-GAE) + one PPO epoch
    torch.cuda.reset_peak_memory_stats()
    cfg = RPRConfig(minibatch_size=args.episodes, grad_accum=args.episodes // args.micro_batch, ppo_epochs=1,
                    lr_actor=1e-6, lr_critic=1e-6, forward_chunk=args.micro_batch)
    optimizers = make_optimizers(actor, critic, cfg)
    rewards = [float(e.success) for e in episodes]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    batch = prepare_batch(actor, critic, episodes, rewards, cfg)
    metrics = ppo_update(actor, critic, batch, cfg, optimizers)
    torch.cuda.synchronize()
    t_rpr = time.perf_counter() - t0
    peak_rpr = torch.cuda.max_memory_allocated() / GIB

    print(f"RSR step: {sft_tokens / t_sft:,.0f} tokens/s ({t_sft:.2f} s), peak {peak_sft:.2f} GiB")
    print(f"RPR step: {tokens / t_rpr:,.0f} tokens/s ({t_rpr:.2f} s), peak {peak_rpr:.2f} GiB, "
          f"policy_loss {metrics['policy_loss']:.4f}")
    print(f"planner:  {prediction.total / GIB:.2f} GiB per GPU (actor {prediction.actor.total / GIB:.2f}, critic "
          f"{prediction.critic.total / GIB:.2f}), RPR step {prediction.step_seconds:.2f} s at "
          f"{prediction.scale.mfu:.0%} MFU of {prediction.scale.peak_tflops:g} TFLOP/s")
    print(f"measured / planned: memory {peak_rpr / (prediction.total / GIB):.2f}, time {t_rpr / prediction.step_seconds:.2f}")
    dist.destroy_process_group()
    return 0 if peak_rpr <= 1.25 * prediction.total / GIB else 1


if __name__ == "__main__":
    sys.exit(main())

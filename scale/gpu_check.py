"""GPU check: the scale path on one CUDA GPU: a real ``vllm serve`` with minirsi's worker
extension, one RSR (SFT) step and one RPR (PPO) step of a ~0.6B Qwen3-shaped model with bf16
FSDP2, one weight sync, and the log-prob gaps, each beside what the planner predicts.

    python scale/gpu_check.py                      # ~3-5 minutes on an H100/H200; no download
    python scale/gpu_check.py --seq-len 4096 --micro-batch 2 --checkpointing --logit-chunk 0

What it does, in order (nothing is downloaded: the GPU machine may have no network):

1. Builds a model from Qwen3-0.6B's config numbers (random weights, seed 0) and a tokenizer
   padded to its 151,936 ids (minirsi's offline BPE plus placeholder tokens, so vLLM can
   detokenise any id), and saves both to a temporary directory.
2. Starts ``bash scale/serve_vllm.sh DIR PORT`` (the flags minirsi needs, the worker extension,
   ``--gpu-memory-utilization 0.3`` so the trainer shares the GPU) and waits for /health.
3. Asks the server for the log-probs of a probe sequence (``prompt_logprobs``): the start.
4. Shards actor and critic with ``minirsi.core.distributed.fsdp2`` (bf16 layers, fp32 heads) over a
   one-rank NCCL group and runs the library's own ``rsr.sft`` and ``rpr.prepare_batch`` +
   ``rpr.ppo_update`` on synthetic episodes with the action/observation structure of real
   ones; prints tokens/s and peak memory per step beside ``minirsi.run.memplan``'s prediction.
5. Doubles the trained actor's final-norm weight (every logit x 2: a change the stale server
   cannot hide), syncs it to the server (``WeightSync``: bf16 safetensors,
   ``/collective_rpc minirsi_load_weights``, ``/reset_prefix_cache``) and prints the largest
   |server - trainer| log-prob of the probe before and after the sync.
6. Samples replies from the server (``OpenAISampler``, every sampling field sent) and prints
   the trainer vs sampler log-prob gap of the sampled tokens, mean |logp_train - logp_sample|
   (the paper's ``logprob_gap``: 4.66e-3 to 4.98e-3 on its 27B model).

Exit code 0 when every step ran, the measured peak of each step is within the planner's
estimate plus 25% (the check that the planner is not optimistic), the sync moved the server's
log-probs onto the trainer's (the gap after is below the gap before and below ``--sync-tol``)
and the sampled-token gap is finite; 1 otherwise. The server's log is printed on failure.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from minirsi.core.critic import build_critic  # noqa: E402
from minirsi.core.distributed import _plain_key, filled, fsdp2, meta_copy  # noqa: E402
from minirsi.core.episode import Episode  # noqa: E402
from minirsi.core.rpr import RPRConfig, make_optimizers, policy_forward, ppo_update, prepare_batch  # noqa: E402
from minirsi.core.rsr import RSRConfig, make_optimizer, sft  # noqa: E402
from minirsi.run.memplan import GIB, KNOWN_SHAPES, Passes, ScaleConfig, plan  # noqa: E402


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


def save_model(out: Path, seq_len: int) -> tuple[torch.nn.Module, int]:
    """The Qwen3-0.6B-shaped actor (fp32, CPU) and its padded tokenizer, saved to ``out``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from minirsi.engine.models import build_tokenizer, save_actor

    s = KNOWN_SHAPES["Qwen/Qwen3-0.6B"]
    tok = build_tokenizer(["```bash\nls -la /app && cat notes.txt\n```\n<|im_end|>\n"] * 20, vocab_size=512)
    tok.add_tokens([f"<pad{i}>" for i in range(s.vocab - len(tok))])  # every id decodes
    config = Qwen3Config(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                         num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         head_dim=s.head_dim, tie_word_embeddings=s.tied, max_position_embeddings=max(4096, seq_len),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    actor = Qwen3ForCausalLM(config)
    save_actor(actor, tok, out)
    return actor, s.vocab


def start_server(model_dir: Path, port: int, log: Path, gpu_util: float) -> subprocess.Popen:
    env = {**os.environ, "HOST": "127.0.0.1"}
    cmd = ["bash", str(ROOT / "scale/serve_vllm.sh"), str(model_dir), str(port), "--gpu-memory-utilization",
           str(gpu_util), "--max-model-len", "4096", "--dtype", "bfloat16", "--enforce-eager"]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import requests

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with status {proc.returncode} before answering /health")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(3)
    raise RuntimeError(f"{url} did not answer /health within {timeout:.0f} s")


def gathered_plain(model: torch.nn.Module, skeleton: torch.nn.Module) -> torch.nn.Module:
    """The FSDP2 model's weights, gathered, in a plain model (what ``World.unsharded`` builds)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return filled(skeleton, {_plain_key(k): v for k, v in state.items()})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per forward/backward")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per layer")
    p.add_argument("--logit-chunk", type=int, default=1024, help="rpr.logit_chunk (0: whole-sequence logits)")
    p.add_argument("--gpu-mem-gib", type=float, default=0.0, help="default: the device's own memory")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--vllm-gpu-util", type=float, default=0.3, help="the server's share of the GPU")
    p.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--sync-tol", type=float, default=0.1, help="largest |server - trainer| log-prob after the sync")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; this script is for a GPU machine", file=sys.stderr)
        return 1
    if shutil.which(os.environ.get("VLLM", "vllm")) is None:
        print("gpu_check: no `vllm` on PATH; pip install 'minirsi[scale]' (vLLM) first", file=sys.stderr)
        return 1
    from minirsi.engine.sampler import OpenAISampler
    from minirsi.engine.weight_sync import WeightSync, server_prompt_logprobs

    work = Path(tempfile.mkdtemp(prefix="minirsi-gpu-check-"))
    url, log = f"http://127.0.0.1:{args.port}", work / "vllm.log"
    server = None
    ok = True
    try:
        actor, vocab = save_model(work / "model", args.seq_len)
        server = start_server(work / "model", args.port, log, args.vllm_gpu_util)
        t0 = time.perf_counter()
        wait_healthy(url, server, args.server_timeout)
        print(f"vllm serve up in {time.perf_counter() - t0:.0f} s ({url})")
        probe = [random.Random(1).randrange(vocab) for _ in range(256)]
        before = server_prompt_logprobs(url, "policy", probe)

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        dist.init_process_group("nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)
        skeleton = meta_copy(actor)
        actor = actor.to("cuda")
        critic = build_critic(actor, head_init_std=0.01).to("cuda")
        for m in (actor, critic):
            fsdp2(m, bf16=True, activation_checkpointing=args.checkpointing)
        s = KNOWN_SHAPES["Qwen/Qwen3-0.6B"]
        episodes = synthetic_episodes(args.episodes, args.seq_len, vocab)
        tokens = sum(len(e.token_ids) for e in episodes)
        mem = args.gpu_mem_gib or torch.cuda.get_device_properties(0).total_memory / GIB
        accum = args.episodes // args.micro_batch
        prediction = plan(s, ScaleConfig(gpus=1, gpu_mem_gib=mem, reserve_gib=0, margin=0, seq_len=args.seq_len,
                                         micro_batch=args.micro_batch, activation_checkpointing=args.checkpointing,
                                         tokens_per_step=tokens, ppo_epochs=1),
                          passes=Passes(forward_chunk=args.micro_batch, logit_chunk=args.logit_chunk,
                                        sft_logit_chunk=args.logit_chunk, episodes=args.episodes, grad_accum=accum))
        print(f"model: Qwen3-0.6B shape, {s.actor_params / 1e9:.2f}B actor + {s.critic_params / 1e9:.2f}B critic; "
              f"{args.episodes} episodes x {args.seq_len} tokens, micro-batch {args.micro_batch}, "
              f"logit chunk {args.logit_chunk or 'whole'}")

        # RSR: one SFT step (one batch of micro-batch sequences)
        torch.cuda.reset_peak_memory_stats()
        scfg = RSRConfig(epochs=1, batch_size=args.micro_batch, lr=1e-5, logit_chunk=args.logit_chunk)
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
        cfg = RPRConfig(minibatch_size=args.episodes, grad_accum=accum, ppo_epochs=1, lr_actor=1e-4, lr_critic=1e-6,
                        forward_chunk=args.micro_batch, logit_chunk=args.logit_chunk)
        optimizers = make_optimizers(actor, critic, cfg)
        rewards = [float(e.success) for e in episodes]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch = prepare_batch(actor, critic, episodes, rewards, cfg)
        metrics = ppo_update(actor, critic, batch, cfg, optimizers)
        torch.cuda.synchronize()
        t_rpr = time.perf_counter() - t0
        peak_rpr = torch.cuda.max_memory_allocated() / GIB

        plan_sft = prediction.by_pass["RSR SFT step"] / GIB
        plan_rpr = max(prediction.by_pass["RPR update micro-batch"], prediction.by_pass["RPR no-grad scoring pass"]) / GIB
        print(f"RSR step: {sft_tokens / t_sft:,.0f} tokens/s ({t_sft:.2f} s), peak {peak_sft:.2f} GiB, "
              f"planned {plan_sft:.2f} GiB")
        print(f"RPR step: {tokens / t_rpr:,.0f} tokens/s ({t_rpr:.2f} s), peak {peak_rpr:.2f} GiB, planned "
              f"{plan_rpr:.2f} GiB, policy_loss {metrics['policy_loss']:.4f}; planned time {prediction.step_seconds:.2f} s "
              f"at {prediction.scale.mfu:.0%} MFU of {prediction.scale.peak_tflops:g} TFLOP/s")
        print(f"measured / planned: memory RSR {peak_sft / plan_sft:.2f}, RPR {peak_rpr / plan_rpr:.2f}; "
              f"time {t_rpr / prediction.step_seconds:.2f}")
        ok &= peak_sft <= 1.25 * plan_sft and peak_rpr <= 1.25 * plan_rpr

        # one weight sync, then the log-prob gaps. The two steps moved the weights by ~lr; doubling
        # the final norm's weight (all logits x 2) makes the server's stale weights plainly off,
        # so the sync has something visible to fix
        with torch.no_grad():
            actor.model.norm.weight.mul_(2.0)
        plain = gathered_plain(actor, skeleton)
        ids = torch.tensor([probe])
        with torch.no_grad():
            mine = policy_forward(actor.eval(), ids.cuda(), torch.ones_like(ids).cuda(), 1.0)[0][0, 1:].tolist()
        gap_before = max(abs(a - b) for a, b in zip(before, mine))
        sampler = OpenAISampler([url], "policy", timeout=600, max_retries=2)
        sync = WeightSync(sampler, work / "weights", dtype=torch.bfloat16, timeout=600)
        m = sync(plain)
        after = server_prompt_logprobs(url, "policy", probe)
        gap_after = max(abs(a - b) for a, b in zip(after, mine))
        print(f"weight sync: {m['sync_bytes'] / 1e9:.2f} GB (bf16) in {m['sync_s']:.1f} s; probe max |server - trainer| "
              f"log-prob {gap_before:.3e} before, {gap_after:.3e} after")
        ok &= gap_after < gap_before and gap_after <= args.sync_tol

        prompts = [episodes[i].token_ids[:128] for i in range(4)]
        samples = sampler.generate(prompts, 64, 1.0, [], seed=0)
        diffs = []
        for prompt, smp in zip(prompts, samples):
            seq = torch.tensor([prompt + smp.token_ids]).cuda()
            with torch.no_grad():
                lp = policy_forward(actor, seq, torch.ones_like(seq), 1.0)[0][0, len(prompt):].tolist()
            diffs += [abs(a - b) for a, b in zip(lp, smp.logprobs)]
        gap = sum(diffs) / max(len(diffs), 1)
        print(f"trainer vs sampler log-prob gap over {len(diffs)} sampled tokens: mean {gap:.3e}, max {max(diffs):.3e} "
              "(paper: 4.66e-3 to 4.98e-3)")
        ok &= math.isfinite(gap) and len(diffs) > 0
        dist.destroy_process_group()
    except Exception as e:  # reported with the server's log, then a failing exit code
        print(f"gpu_check: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        ok = False
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, 15)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, 9)
        if not ok and log.is_file():
            print("--- vllm serve log (last 60 lines) ---\n" + "\n".join(log.read_text().splitlines()[-60:]), file=sys.stderr)
    print("gpu_check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

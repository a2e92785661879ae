"""Benchmark: the RPR update of the tiny model (throughput, peak memory) and where an RPR step
spends its time (rollout vs update).

Two measurements, in this one run:

1. ``update``: ``prepare_batch`` (old log-probs, values, TB-GAE) + ``ppo_update`` on a batch of
   ``--episodes`` synthetic episodes laid out like toy rollouts (a ``--prompt``-token prompt,
   then ``--turns`` turns of ``--action``-token actions and ``--obs``-token observations).
   Prints action tokens trained per second (action tokens x ppo_epochs / seconds, the best of
   ``--repeats``) and the peak memory the first update adds: the growth of the process's
   resident high-water mark (``resource.getrusage(...).ru_maxrss``; torch allocates outside
   Python's heap, so tracemalloc would not see it), or ``torch.cuda.max_memory_allocated`` on
   a GPU. The first update is measured before anything else large is allocated, so the
   high-water mark is its own.
2. ``step``: ``run_rpr`` for ``--steps`` joint steps on the toy training suite, in real
   sandboxes (bwrap) with the real verifier, and the share of each step's wall time spent in
   rollout (sampling, commands, verifier) versus update.

The model: ``--model DIR`` (e.g. the Base from ``minirsi pretrain``), else a randomly
initialised tiny model (``models.build_tiny_actor``) with a BPE trained on the tasks' text. A
random model rarely closes its turn, so its rollouts run every turn to ``--max-new-tokens``:
the rollout share is then at its largest.

Peak memory of the update is dominated by the per-layer attention weights of both models, so
it scales with the micro-batch (``--grad-accum``), not the minibatch. Measured figures:
docs/experiments.md.

Run::

    python bench/rpr.py
    python bench/rpr.py --threads 1 --steps 0 --grad-accum 4   # update only, smaller micro-batches
    python bench/rpr.py --model runs/toy/base --steps 3
    python bench/rpr.py --device cuda --episodes 64        # the same on a GPU
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import tempfile
import time

import torch

from minirsi.core.critic import build_critic
from minirsi.core.episode import Episode
from minirsi.core.episode import pad_id_of
from minirsi.core.rpr import RPRConfig, make_optimizers, ppo_update, prepare_batch, run_rpr
from minirsi.engine.rollout import make_rollout_fn
from model_under_test import load_model, toy_tasks  # bench/model_under_test.py: this script's folder is on sys.path


def synthetic_episodes(n: int, vocab: int, prompt: int, turns: int, action: int, obs: int, seed: int = 0) -> list[Episode]:
    rng = random.Random(seed)
    eps = []
    for i in range(n):
        ids, mask, turn_ids, lps = [rng.randrange(3, vocab) for _ in range(prompt)], [0] * prompt, [0] * prompt, [None] * prompt
        for k in range(turns):
            ids += [rng.randrange(3, vocab) for _ in range(action)]
            mask += [1] * action
            turn_ids += [k] * action
            lps += [-rng.random() for _ in range(action)]
            if k < turns - 1:
                ids += [rng.randrange(3, vocab) for _ in range(obs)]
                mask += [0] * obs
                turn_ids += [k + 1] * obs
                lps += [None] * obs
        eps.append(Episode(task_id=f"t{i}", family="files", difficulty="easy", token_ids=ids, logprobs=lps,
                           action_mask=mask, turn_ids=turn_ids, turns=turns, success=bool(i % 2),
                           passed=i % 3, total=2))
    return eps


def rss_mib() -> float:
    # ru_maxrss is KiB on Linux, bytes on macOS
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 1024 if sys.platform != "darwin" else r / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: random tiny model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--episodes", type=int, default=16, help="episodes per update batch / per RPR step")
    p.add_argument("--prompt", type=int, default=120)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--action", type=int, default=48)
    p.add_argument("--obs", type=int, default=80)
    p.add_argument("--minibatch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="joint RPR steps for the rollout/update split (0: skip)")
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: no OpenMP spinning on a shared CPU)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from minirsi.engine.rollout import RolloutConfig

    with tempfile.TemporaryDirectory() as d:
        tasks = toy_tasks(d, args.episodes)
        actor, tok = load_model(args.model, tasks)
        actor.to(args.device)
        critic = build_critic(actor).to(args.device)
        cfg = RPRConfig(minibatch_size=args.minibatch, grad_accum=args.grad_accum, ppo_epochs=1,
                        episodes_per_step=args.episodes, steps=args.steps, critic_calibration_updates=0,
                        lr_actor=1e-5, lr_critic=1e-5, reward="spr", seed=0)
        optimizers = make_optimizers(actor, critic, cfg)
        eps = synthetic_episodes(args.episodes, len(tok), args.prompt, args.turns, args.action, args.obs)
        rewards = [float(e.success) for e in eps]
        n_params = sum(p.numel() for p in actor.parameters())

        # 1. the update: the first one for memory, the best of --repeats for speed
        cuda = args.device.startswith("cuda")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base_mem = torch.cuda.memory_allocated() / 2**20
        rss0 = rss_mib()
        times, n_act = [], 0.0
        for r in range(args.repeats):
            t0 = time.perf_counter()
            batch = prepare_batch(actor, critic, eps, rewards, cfg, pad_id=pad_id_of(tok))
            m = ppo_update(actor, critic, batch, cfg, optimizers)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            n_act = m["action_tokens"] * cfg.ppo_epochs
            if r == 0:
                peak = (torch.cuda.max_memory_allocated() / 2**20 - base_mem) if cuda else rss_mib() - rss0
        best = min(times)
        total_tokens = sum(len(e.token_ids) for e in eps)

        # 2. an RPR step on toy tasks: rollout vs update
        rollout_cfg = RolloutConfig(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, temperature=1.0,
                                    max_context_tokens=4096, concurrency=args.episodes, seed=0)
        scales = {t.family: 2.0 for t in tasks}
        history = run_rpr(actor, critic, tok, tasks, cfg, make_rollout_fn(tok, rollout_cfg, progress=False), scales)

    model_name = args.model or "random tiny model"
    print(f"model: {model_name}, {n_params / 1e6:.2f}M parameters, device {args.device}, {args.threads} threads")
    print(f"update batch: {args.episodes} episodes x {total_tokens // args.episodes} tokens "
          f"({int(n_act)} action tokens), minibatch {args.minibatch}, grad_accum {args.grad_accum}")
    print(f"update (prepare_batch + ppo_update): best {best:.2f} s of {args.repeats} "
          f"-> {n_act / best:,.0f} action tokens/s ({total_tokens / best:,.0f} tokens/s)")
    print(f"peak memory added by the first update: {peak:,.0f} MiB "
          f"({'cuda max_memory_allocated' if cuda else 'ru_maxrss growth'})")
    if history:
        print(f"{'step':>4} {'rollout s':>10} {'update s':>9} {'rollout share':>14} {'turns':>6} {'action tok':>11} {'gap':>9}")
    for h in history:
        share = h["rollout_s"] / (h["rollout_s"] + h["update_s"])
        print(f"{h['step']:>4} {h['rollout_s']:10.2f} {h['update_s']:9.2f} {100 * share:13.1f}% "
              f"{h['turns']:6.2f} {int(h['action_tokens']):11d} {h['logprob_gap']:9.2e}")
    if history:
        ro = sum(h["rollout_s"] for h in history)
        up = sum(h["update_s"] for h in history)
        print(f"RPR step time: {100 * ro / (ro + up):.1f}% rollout, {100 * up / (ro + up):.1f}% update")


if __name__ == "__main__":
    main()

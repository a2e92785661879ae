"""Benchmark: TB-GAE against the memory-bound floor and against the per-token loop.

Builds B=8 sequences of T=262,144 tokens (the paper's context length), each with ~100 turns
and half of its tokens observations, laid out as ``minirsi.core.episode.collate`` lays them out
(prompt, then per turn: action tokens, observation tokens; turn ids non-decreasing), with the
episode reward on the last action token. Prints, all measured in this one run:

- ``tb_gae``: what training runs (``impl="fast"``, minirsi/core/tb_gae_fast.py);
- ``floor``: one ``flip`` + ``cumsum`` + ``flip`` over the same (B, T) tensor, the cost of a
  single reverse scan that any implementation must at least pay; target tb_gae / floor <= 3;
- ``loop``: ``tb_gae_reference`` (the loop over positions, vectorised over the batch) timed on
  a prefix of ``--loop-tokens`` tokens per row and scaled linearly to T; target speed-up >= 100;
- ``plain``: ``tb_gae_plain``, the readable closed form (no target; fewer repeats);
- ``many turns``: tb_gae with every action token its own turn (rpr.py's ``token_gae``
  ablation, K ~ 130,000 turns a row), where the chunk tricks do not pay (no target);
- the largest |difference| between float32 TB-GAE and the float64 result on the full batch.

Timings are the minimum over ``--repeats`` interleaved runs (the least disturbed by other
processes).

Run::

    python bench/tb_gae.py                      # CPU, defaults above
    python bench/tb_gae.py --threads 1          # one CPU thread (steadier on a busy machine)
    python bench/tb_gae.py --device cuda        # the same on a GPU
"""

from __future__ import annotations

import argparse
import time

import torch

from minirsi.core.tb_gae import tb_gae, tb_gae_plain, tb_gae_reference


def make_batch(B: int, T: int, turns: int, seed: int = 0, device: str = "cpu"):
    """Rewards, values, action_mask, turn_ids, each (B, T), in collate's layout."""
    gen = torch.Generator().manual_seed(seed)
    action_mask = torch.zeros(B, T, dtype=torch.float32)
    turn_ids = torch.zeros(B, T, dtype=torch.long)
    rewards = torch.zeros(B, T, dtype=torch.float32)
    prompt = 512
    for b in range(B):
        # Random action / observation lengths per turn, scaled so that they fill T exactly
        # with half the tokens of the turns being observations.
        k = turns + int(torch.randint(-5, 6, (1,), generator=gen))
        act = torch.rand(k, generator=gen) + 0.5
        obs = torch.rand(k, generator=gen) + 0.5
        half = (T - prompt) // 2
        act_len = (act / act.sum() * half).long().clamp(min=1)
        obs_len = (obs / obs.sum() * half).long().clamp(min=1)
        obs_len[-1] += T - prompt - int(act_len.sum() + obs_len.sum())
        t = prompt
        for i in range(k):
            action_mask[b, t:t + act_len[i]] = 1.0
            turn_ids[b, t:t + act_len[i]] = i
            t += int(act_len[i])
            last_action = t - 1
            turn_ids[b, t:t + obs_len[i]] = i + 1  # the observation opens the next turn
            t += int(obs_len[i])
        # docs/method.md section 3: end on an action token; the trailing tokens act as padding.
        turn_ids[b, last_action + 1:] = k - 1
        rewards[b, last_action] = float(torch.rand(1, generator=gen)) * 2
    values = torch.randn(B, T, generator=gen)
    return [x.to(device) for x in (rewards, values, action_mask, turn_ids)]


def best_times(fns, repeats: int, sync, clock=time.perf_counter) -> list[float]:
    """Minimum time of each function on ``clock``; the runs are interleaved so that all see
    the same machine (other processes come and go)."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()
    sync()
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = clock()
            fn()
            sync()
            best[i] = min(best[i], clock() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=262_144)
    p.add_argument("--turns", type=int, default=100)
    p.add_argument("--loop-tokens", type=int, default=16_384,
                   help="per-row prefix timed with the loop reference, scaled to --tokens")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--gamma-turn", type=float, default=0.99)
    p.add_argument("--lam-turn", type=float, default=0.95)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's). On a shared machine use 1: "
                        "with more, every parallel op waits for its slowest thread")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    rewards, values, action_mask, turn_ids = make_batch(
        args.batch, args.tokens, args.turns, device=args.device)
    gamma_turn, lam_turn = args.gamma_turn, args.lam_turn

    fns = [lambda: values.flip(1).cumsum(1).flip(1),
           lambda: tb_gae(rewards, values, action_mask, turn_ids, gamma_turn, lam_turn)]
    t_floor, t_gae = best_times(fns, args.repeats, sync)
    cpu = None
    if args.device == "cpu" and torch.get_num_threads() == 1:
        # One thread: this process's CPU time excludes the time other processes held the core.
        cpu = best_times(fns, args.repeats, sync, clock=time.process_time)

    plain = [lambda: tb_gae_plain(rewards, values, action_mask, turn_ids, gamma_turn, lam_turn)]
    t_plain, = best_times(plain, max(1, args.repeats // 10), sync)  # ~10x slower: fewer runs
    steps = action_mask.long().cumsum(1)  # (B, T) every action token a turn of its own
    many = [lambda: tb_gae(rewards, values, action_mask, steps, 1.0, lam_turn)]
    t_many, = best_times(many, max(1, args.repeats // 10), sync)

    L = min(args.loop_tokens, args.tokens)
    prefix = [x[:, :L] for x in (rewards, values, action_mask, turn_ids)]
    t0 = time.perf_counter()
    tb_gae_reference(*prefix, gamma_turn, lam_turn)
    t_loop = (time.perf_counter() - t0) * args.tokens / L

    A32, R32 = tb_gae(rewards, values, action_mask, turn_ids, gamma_turn, lam_turn)
    A64, R64 = tb_gae(rewards.double(), values.double(), action_mask, turn_ids, gamma_turn, lam_turn)
    err = float((A32.double() - A64).abs().max())

    print(f"TB-GAE bench: B={args.batch} T={args.tokens} ~{args.turns} turns/row, "
          f"{float(action_mask.mean()):.1%} action tokens, device={args.device}, "
          f"threads={torch.get_num_threads()}")
    print(f"  tb_gae (impl='fast')   {t_gae * 1e3:9.2f} ms")
    print(f"  tb_gae_plain           {t_plain * 1e3:9.2f} ms  ({t_plain / t_floor:.1f} x the floor)")
    print(f"  tb_gae, many turns     {t_many * 1e3:9.2f} ms  (every action its own turn)")
    print(f"  flip+cumsum+flip floor {t_floor * 1e3:9.2f} ms")
    print(f"  loop reference (est.)  {t_loop * 1e3:9.0f} ms  (timed on {L} tokens/row, scaled)")
    print(f"  ratio tb_gae / floor   {t_gae / t_floor:9.2f} x   (target <= 3)")
    print(f"  speed-up over loop     {t_loop / t_gae:9.0f} x   (target >= 100)")
    if cpu is not None:
        print(f"  process CPU time (1 thread, not counting time other processes held the core):"
              f" tb_gae {cpu[1] * 1e3:.2f} ms, floor {cpu[0] * 1e3:.2f} ms, ratio "
              f"{cpu[1] / cpu[0]:.2f} x")
    print(f"  max |A_float32 - A_float64| = {err:.2e}")


if __name__ == "__main__":
    main()

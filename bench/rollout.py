"""Benchmark: where rollout time goes, and what batching the generation buys.

Runs ``--episodes`` (32) episodes of up to ``--max-turns`` (8) turns of the tiny model on toy
training tasks in real sandboxes (bwrap by default) with the real verifier, twice, in this one
run:

- ``batched``: ``concurrency = episodes``: every step decodes all live episodes in one call;
- ``sequential``: ``concurrency = 1``: one episode at a time (the same sampler and seeds), on
  the first ``--sequential-episodes`` (default: all ``--episodes``) of the same tasks; with
  fewer, its wall and generation times are scaled to ``--episodes`` (one-at-a-time cost is
  linear in the number of episodes, but 8 episodes' sampled work can differ from the 32's by
  a third: 229 vs 1279/4 generated tokens in one measurement, so the scaled ratio is noisy).

Prints for each: wall time, seconds inside ``sampler.generate`` (wall, and CPU of the thread
that generates), the share of wall time spent outside generation (sandbox commands, verifier,
parsing, bookkeeping; target < 25% for the batched run), generated tokens; where the run's CPU
went: the generating thread, the process's other threads (sandbox opening, commands,
verifiers), the child processes this process reaped, and the whole machine's busy CPU time
over the run (``/proc/stat``), against what the cores allow; then the speed-up of batched over
sequential (wall time, target >= 4x), of generation (wall), and of the generating thread's CPU
(what batching the sampler buys when nothing competes with it).

Why the machine figure: a jail's processes (its init, the agent's shell and commands, the
verifier's Python) are reaped by the jail's own init and killed with it when the sandbox
closes, so most of their CPU never reaches this process's ``RUSAGE_CHILDREN``. On a 2-core
machine a batched run keeps both cores busy, mostly with that work, so generation waits for a
core and its wall time exceeds its CPU time (measured: docs/experiments.md). The machine
figure includes any other job running at the time: run this on a quiet machine.

The model: ``--model DIR`` (e.g. the pretrained Base from ``minirsi pretrain``), else a
randomly initialised tiny model with a tokenizer trained on the toy corpus. A random model
rarely closes its turn, so each reply runs to ``--max-new-tokens`` and parses to no command
(answered with the format reminder): generation is then at its largest. A pretrained model
writes shorter replies that run commands, so its outside-generation share is the more telling.

Run::

    python bench/rollout.py
    python bench/rollout.py --model runs/toy/base --episodes 32 --max-turns 8
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
from collections import Counter
import tempfile

import torch

from minirsi.engine.rollout import RolloutConfig, RolloutStats, collect
from minirsi.engine.sampler import HFSampler
from minirsi.env.sandbox import BACKENDS
from model_under_test import load_model, toy_tasks  # bench/model_under_test.py: this script's folder is on sys.path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: random tiny model)")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--sequential-episodes", type=int, default=None,
                   help="episodes timed one at a time (default: all; fewer are scaled up)")
    p.add_argument("--backend", default="bwrap", choices=BACKENDS)
    # One intra-op thread: on a shared 2-core machine spinning OpenMP workers make a second one slower.
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as d:
        tasks = list(itertools.islice(itertools.cycle(toy_tasks(d, args.episodes)), args.episodes))
        model, tok = load_model(args.model, tasks)
        sampler = HFSampler(model, tok)
        base = dict(
            max_turns=args.max_turns,
            max_new_tokens=args.max_new_tokens,
            temperature=1.0,
            max_context_tokens=4096,
            backend=args.backend,
            seed=0,
        )
        sampler.generate([[1, 2, 3]], 4, 1.0, [], seed=0)  # warm-up: first-call allocations
        rows = {}
        n_seq = min(args.sequential_episodes or args.episodes, args.episodes)
        cpu = {}
        for name, conc, subset in (("batched", args.episodes, tasks), ("sequential", 1, tasks[:n_seq])):
            stats = RolloutStats()
            r0 = (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
            busy0 = _machine_busy()
            eps = collect(subset, sampler, tok, RolloutConfig(concurrency=conc, **base), progress=False, stats=stats)
            r1 = (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
            # (this process, its reaped child processes: every sandbox is closed and reaped by now)
            cpu[name] = (*(_cpu(b) - _cpu(a) for a, b in zip(r0, r1)), _machine_busy() - busy0)
            rows[name] = (stats, eps)
        scale = args.episodes / n_seq  # sequential cost per episode, times the number of episodes

    model_name = args.model or "random tiny model"
    print(f"{args.episodes} episodes, <= {args.max_turns} turns, <= {args.max_new_tokens} tokens/turn, {model_name}, {args.backend}")
    print(f"{'run':<11} {'episodes':>8} {'wall s':>8} {'generate s':>11} {'gen CPU s':>10} {'outside gen':>12} {'gen tokens':>11} {'turns':>6} {'success':>8}  stop reasons")
    for name, (s, eps) in rows.items():
        turns = sum(e.turns for e in eps) / len(eps)
        succ = sum(e.success for e in eps) / len(eps)
        print(
            f"{name:<11} {len(eps):8d} {s.wall_s:8.2f} {s.generate_s:11.2f} {s.generate_cpu_s:10.2f} {100 * s.outside_generation:11.1f}% "
            f"{s.generated_tokens:11d} {turns:6.2f} {succ:8.2f}  {dict(Counter(e.stop_reason for e in eps))}"
        )
    cores = os.cpu_count() or 1  # /proc/stat's first line sums every CPU of the machine
    for name, (s, _) in rows.items():
        own, children, machine = cpu[name]
        print(
            f"{name:<11} CPU: generating thread {s.generate_cpu_s:.2f}s, other work of this process {own - s.generate_cpu_s:.2f}s, "
            f"reaped child processes {children:.2f}s; whole machine busy {machine:.2f}s of {cores * s.wall_s:.2f}s "
            f"({100 * machine / (cores * s.wall_s):.0f}% of {cores} CPUs), so wall >= {machine / cores:.2f}s"
        )
    for name, (s, _) in rows.items():
        other = s.wall_s - s.generate_s - s.open_s - s.commands_s - s.drain_s
        print(
            f"{name:<11} outside generation: open sandboxes {s.open_s:.2f}s, commands {s.commands_s:.2f}s, "
            f"last verifiers {s.drain_s:.2f}s, parsing/tokenising/bookkeeping {other:.2f}s"
        )
    errors = [e.error for _, eps in rows.values() for e in eps if e.error]
    if errors:
        print(f"{len(errors)} episodes ended in error; first: {errors[0][:300]}")
    b, q = rows["batched"][0], rows["sequential"][0]
    print(f"outside generation (batched): {100 * b.outside_generation:.1f}%  (target < 25%)")
    print(
        f"batched speed-up over one episode at a time ({args.episodes} episodes; sequential scaled x{scale:.1f} "
        f"from {n_seq}): wall {scale * q.wall_s / b.wall_s:.1f}x (target >= 4x), "
        f"generation only {scale * q.generate_s / b.generate_s:.1f}x, "
        f"generating thread's CPU {scale * q.generate_cpu_s / b.generate_cpu_s:.1f}x"
    )


def _cpu(r: resource.struct_rusage) -> float:
    return r.ru_utime + r.ru_stime


def _machine_busy() -> float:
    """CPU seconds all cores spent on anything but idle and I/O wait since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]  # user nice system idle iowait irq softirq steal ...
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()

"""Benchmark: the weight sync's share of an RPR step, full weights and LoRA, on this machine.

Two ``minirsi serve`` processes on 127.0.0.1 serve the rollouts (``OpenAISampler``, episodes
pinned); ``run_rpr`` runs ``--steps`` joint steps on the toy training suite in real sandboxes
with ``WeightSync`` as its ``after_actor_update`` hook, first with full weights (safetensors
written, both servers reload and reset their prefix caches), then with a LoRA adapter on the
synced model (written, hot-loaded by both, the previous one unloaded). Prints, per mode, the
bytes a sync moves, its seconds (write, then the servers' reload) and its share of a step,
sync / (rollout + update + sync), from the same run.

The model: ``--model DIR`` (e.g. the cached Base of ``minirsi pretrain``), else the random tiny
model of bench/rpr.py. Results are in scale/README.md; the 27B estimate there is by hand.

Run::

    python bench/sync.py
    python bench/sync.py --model ~/.cache/minirsi/base/base-* --steps 4
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from minirsi.core.critic import build_critic
from minirsi.core.rpr import RPRConfig, make_optimizers, run_rpr
from minirsi.engine.models import LoraSettings, attach_lora, save_actor
from minirsi.engine.rollout import RolloutConfig
from minirsi.engine.rollout import make_rollout_fn
from minirsi.engine.sampler import OpenAISampler
from minirsi.engine.weight_sync import WeightSync

sys.path.insert(0, str(Path(__file__).parent))
from model_under_test import load_model, toy_tasks  # noqa: E402  (bench/model_under_test.py)

REPO = Path(__file__).resolve().parents[1]


def start_server(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "minirsi.cli", "serve", "--model", str(model_dir), "--port", "0",
           "--served-model-name", "policy", "--enable-lora"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("minirsi serve: http://"):
        proc.kill()
        raise SystemExit(f"minirsi serve did not start: {line!r}; see {log}")
    return proc, line.split()[2].rsplit("/v1/", 1)[0]


def run_mode(actor, tok, tasks, sampler, sync, args) -> list[dict]:
    critic = build_critic(actor)
    cfg = RPRConfig(minibatch_size=args.minibatch, ppo_epochs=1, episodes_per_step=args.episodes, steps=args.steps,
                    critic_calibration_updates=0, lr_actor=1e-4, lr_critic=1e-5, reward="spr", tis_cap=2.0, seed=0)
    rcfg = RolloutConfig(max_turns=args.max_turns, max_new_tokens=args.max_new_tokens, temperature=1.0,
                         max_context_tokens=4096, concurrency=args.episodes, seed=0)
    sync(actor)  # the servers start from this actor (not timed as a step's sync)
    rollout_fn = make_rollout_fn(tok, rcfg, sampler_factory=lambda m, t: sampler, progress=False)
    return run_rpr(actor, critic, tok, tasks, cfg, rollout_fn, {t.family: 2.0 for t in tasks},
                   optimizers=make_optimizers(actor, critic, cfg), after_actor_update=sync)


def report(name: str, history: list[dict]) -> None:
    ro, up, sy = (sum(h[k] for h in history) for k in ("rollout_s", "update_s", "sync_s"))
    wr = sum(h["sync_write_s"] for h in history)
    mb = history[-1]["sync_bytes"] / 1e6
    print(f"{name:5} {mb:9.2f} MB  sync {sy / len(history):6.3f} s/step (write {wr / len(history):.3f} s, "
          f"servers {(sy - wr) / len(history):.3f} s)  rollout {ro / len(history):6.2f} s  update "
          f"{up / len(history):5.2f} s  -> sync = {100 * sy / (ro + up + sy):.1f}% of an RPR step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: random tiny model)")
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="joint RPR steps per mode")
    p.add_argument("--minibatch", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        tasks = toy_tasks(d / "tasks", args.episodes)
        actor, tok = load_model(args.model, tasks)
        save_actor(actor, tok, d / "start")
        servers = [start_server(d / "start", d / f"serve{i}.log") for i in range(2)]
        try:
            sampler = OpenAISampler([url for _, url in servers], "policy", max_retries=1)
            t0 = time.perf_counter()
            full = run_mode(actor, tok, tasks, sampler, WeightSync(sampler, d / "full"), args)
            lora_actor = attach_lora(copy.deepcopy(actor), LoraSettings(r=args.lora_r))
            lora = run_mode(lora_actor, tok, tasks, sampler, WeightSync(sampler, d / "lora", mode="lora"), args)
            wall = time.perf_counter() - t0
        finally:
            for proc, _ in servers:
                proc.terminate()
                proc.wait(30)
    n = sum(p.numel() for p in actor.parameters())
    print(f"model: {args.model or 'random tiny model'}, {n / 1e6:.2f}M parameters; 2 minirsi serve processes; "
          f"{args.episodes} episodes x {args.max_turns} turns a step, {args.steps} steps per mode ({wall:.0f} s)")
    report("full", full)
    report("lora", lora)


if __name__ == "__main__":
    main()

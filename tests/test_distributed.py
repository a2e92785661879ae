"""FSDP2 data parallelism (minirsi/distributed.py): 2 gloo processes on the CPU give the
one-process update, the world-size-1 hooks are the identity, and checkpoints reload anywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minirsi import distributed
from minirsi.distributed import SINGLE, World, max_abs_diff

ROOT = Path(__file__).parents[1]
TOL = 1e-5


def torchrun(*args: str, nproc: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc ARGS`` from the repository root."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(nproc), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def test_world_size_one_hooks_are_the_identity():
    batch = {"input_ids": torch.ones(3, 4, dtype=torch.long), "attention_mask": torch.ones(3, 4),
             "action_mask": torch.ones(3, 4)}
    assert SINGLE.local(batch) is batch
    n = torch.tensor(7.0)
    assert SINGLE.normalizer(n) is n
    assert SINGLE.all_sum([1.5, 2.0]) == [1.5, 2.0]
    model = torch.nn.Linear(2, 2)
    assert SINGLE.shard(model) is model and SINGLE.unsharded(model) is model
    assert SINGLE.broadcast({"a": 1}) == {"a": 1}


def test_init_without_a_launcher_is_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed.init() is SINGLE and distributed.current() is SINGLE


def test_local_rows_and_stand_in_row():
    # rank 1 of 2 on a 3-row batch takes row 1; on a 1-row batch it gets row 0 with no action token
    w = World(rank=1, size=2)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    batch = {"input_ids": torch.arange(12).view(3, 4), "attention_mask": mask, "action_mask": mask.float()}
    mine = w.local(batch)
    assert mine["input_ids"].tolist() == [[4, 5]]  # row 1, cut after its 2 tokens
    one = w.local({k: v[:1] for k, v in batch.items()})
    assert one["input_ids"].shape == (1, 3) and one["action_mask"].sum() == 0


def test_max_abs_diff_names_missing_keys():
    with pytest.raises(ValueError, match="keys"):
        max_abs_diff({"a": torch.zeros(1)}, {"b": torch.zeros(1)})


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_process_updates_equal_one_process(tmp_path, lora):
    """PPO update (2 epochs, grad accumulation, a stand-in row), RSR SFT step and critic warm-up
    update: FSDP2 over 2 ranks vs one process on the same episodes (LoRA: with a KL term against
    the adapter-free reference)."""
    out = tmp_path / "eq.json"
    proc = torchrun("tests/dist_equal.py", str(out), *(["--lora"] if lora else []))
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2
    for key in ("ppo_actor", "ppo_critic", "sft_actor", "warmup_critic", "ppo_old_logprobs", "ppo_old_values"):
        assert r[key] <= TOL, (key, r[key])
    assert r["ppo_metrics"] <= 1e-5 and r["sft_loss"] <= 1e-5 and r["warmup_ev"] <= 1e-6
    # the update really moved the weights, by far more than the two runs differ
    assert r["ppo_actor_moved"] > 100 * max(r["ppo_actor"], 1e-7)
    if not lora:
        assert r["reload_2proc"] == 0.0  # saved from 2 ranks, loaded and re-sharded on 2 ranks
        from transformers import AutoModelForCausalLM

        saved = torch.load(out.with_suffix(".state.pt"))
        one = AutoModelForCausalLM.from_pretrained(out.with_suffix(".ckpt")).state_dict()
        assert max_abs_diff(saved, {k: v for k, v in one.items() if k in saved}) == 0.0  # 1 process

"""RSR: transcript cleaning, the replay minimiser, the action-only SFT loss, the config, and
(slow, real bwrap sandboxes + the verifier) a stage that makes a tiny actor succeed more often,
trains only on re-verified rewrites, and leaves the critic bit-identical."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from minirsi.rsr import (
    Replay,
    ReplayMinimiser,
    RSRConfig,
    Step,
    clean_transcript,
    sft_loss,
)

VOCAB = 300


def tiny_qwen(vocab: int = VOCAB, seed: int = 0) -> Qwen3ForCausalLM:
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


# ----------------------------------------------------------------------------- cleaning


def test_clean_transcript_drops_failures_noise_and_repeats():
    transcript = [
        {"commands": ["ls /app"], "observation": "a.txt\n[exit 0]"},
        {"commands": [], "observation": "No command found. ..."},  # a format error: ran nothing
        {"commands": ["cat nope"], "observation": "cat: nope: No such file or directory\n[exit 1]"},
        {"commands": ["mkdir out", "cp a.txt out/"], "observation": "[exit 0]\n[exit 0]"},
        {"commands": ["cp a.txt out/"], "observation": "[exit 0]"},  # consecutive repeat
        {"commands": ["ls /app"], "observation": "a.txt\nout\n[exit 0]"},  # read-only, seen before
        {"commands": ["sleep 99"], "observation": "[timed out]"},
        {"commands": ["echo x >> log"], "observation": None},  # the sandbox died
        {"commands": ["gzip out/a.txt", "bogus"], "observation": "[exit 0]\nbash: bogus: command not found\n[exit 127]"},
        {"commands": [], "observation": "", "action": "TASK_COMPLETE"},
    ]
    steps = clean_transcript(transcript)
    assert [s.command for s in steps] == ["ls /app", "mkdir out", "cp a.txt out/", "gzip out/a.txt"]
    assert steps[0].output == "a.txt"


def test_clean_keeps_repeated_writes_that_are_not_consecutive():
    transcript = [{"commands": ["echo a >> f"], "observation": "[exit 0]"},
                  {"commands": ["echo b >> f"], "observation": "[exit 0]"},
                  {"commands": ["echo a >> f"], "observation": "[exit 0]"}]
    assert len(clean_transcript(transcript)) == 3


# ----------------------------------------------------------------------------- minimiser


class FakeReplay:
    """Passes when every required command was run, in order (extra commands are harmless)."""

    def __init__(self, required):
        self.required, self.calls = list(required), 0

    def __call__(self, task, commands):
        self.calls += 1
        it = iter(commands)
        ok = all(any(c == r for c in it) for r in self.required)
        return Replay(list(commands), [""] * len(commands), [0] * len(commands), ok, int(ok), 1)


def test_replay_minimiser_drops_every_unneeded_command():
    replay = FakeReplay(["mkdir out", "cp a out/"])
    cleaned = [Step(c, "") for c in ["ls", "mkdir out", "pwd", "cp a out/", "ls out"]]
    out = ReplayMinimiser(replay).rewrite(SimpleNamespace(task_id="t"), cleaned)
    assert out == ["mkdir out", "cp a out/"]
    assert replay.calls == len(cleaned) + 1


def test_replay_minimiser_returns_a_broken_run_unchanged():
    replay = FakeReplay(["never run"])
    cleaned = [Step("ls", ""), Step("pwd", "")]
    assert ReplayMinimiser(replay).rewrite(SimpleNamespace(task_id="t"), cleaned) == ["ls", "pwd"]
    assert replay.calls == 1


# ----------------------------------------------------------------------------- SFT loss


def test_sft_loss_reads_action_tokens_only():
    """Changing prompt/observation targets changes nothing but the context of later tokens;
    changing padding (right of the sequence) changes nothing at all."""
    model = tiny_qwen()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    att = torch.ones(2, 12, dtype=torch.long)
    att[1, 9:] = 0
    act = torch.zeros(2, 12)
    act[0, 4:7] = 1
    act[1, 3:9] = 1
    base = sft_loss(model, ids, att, act)
    ids2 = ids.clone()
    ids2[1, 9:] = torch.randint(1, VOCAB, (3,), generator=g)  # padding
    ids2[0, 7:] = torch.randint(1, VOCAB, (5,), generator=g)  # after the last action token of row 0
    assert torch.allclose(sft_loss(model, ids2, att, act), base, atol=1e-6)
    # hand check against the model's own loss on one row with labels = -100 off-action
    labels = torch.where(act[0].bool(), ids[0], torch.tensor(-100))[None]
    ref = model(input_ids=ids[:1], labels=labels).loss
    assert torch.allclose(sft_loss(model, ids[:1], att[:1], act[:1]), ref, atol=1e-5)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="'llm' or 'replay'"):
        RSRConfig(planner="oracle")
    with pytest.raises(ValueError, match="samples_per_task"):
        RSRConfig(samples_per_task=0)

"""Tests for minirsi/run/pretrain.py: config validation, loss weights, schedule, a short real run."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch

from minirsi.config import ConfigError, load_config
from minirsi.engine.models import load_actor
from minirsi.run.pretrain import PretrainConfig, collate_weighted, lr_at, make_batches, pretrain


@dataclass
class Turn:
    commands: list[str]
    output: str
    exit_code: int = 0


@dataclass
class Session:
    instruction: str
    turns: list[Turn] = field(default_factory=list)


def hand_sessions(n: int, seed: int) -> list[Session]:
    """Hand-written sessions over a few shell verbs (stand-in for toy_envs.corpus)."""
    rng = random.Random(seed)
    names = ["cat", "dog", "owl", "fox", "bee", "elk"]
    out = []
    for _ in range(n):
        a, b = rng.sample(names, 2)
        kind = rng.randrange(3)
        if kind == 0:
            out.append(Session(f"Copy {a}.txt to {b}.txt.", [Turn([f"cp {a}.txt {b}.txt"], "")]))
        elif kind == 1:
            out.append(Session(f"Create the directory {a}.", [Turn([f"mkdir -p {a}"], "")]))
        else:
            out.append(Session(f"Count the lines of {a}.txt into {b}.txt.",
                               [Turn([f"wc -l < {a}.txt"], "3\n"), Turn([f"wc -l < {a}.txt > {b}.txt"], "")]))
    return out


def test_config_validation_and_overrides():
    with pytest.raises(ValueError, match="eval_every"):
        PretrainConfig(eval_every=-1)
    with pytest.raises(ValueError, match="preset"):
        PretrainConfig(preset="huge")
    with pytest.raises(ValueError, match="threads"):
        PretrainConfig(threads=-1)
    with pytest.raises(ConfigError, match="context_weight"):
        load_config(PretrainConfig, None, ["context_weight=2"])
    with pytest.raises(ConfigError):
        load_config(PretrainConfig, None, ["no_such_knob=1"])
    cfg = load_config(PretrainConfig, None, ["lr=1e-3", "sessions=10"])
    assert cfg.lr == 1e-3 and cfg.sessions == 10


def test_collate_weights():
    rows = [([5, 6, 7, 8], [0, 0, 1, 1]), ([5, 6], [0, 1])]
    ids, am, w, act = collate_weighted(rows, pad_id=0, context_weight=0.1)
    assert ids.tolist() == [[5, 6, 7, 8], [5, 6, 0, 0]]
    # t=0 predicts nothing; context 0.1; action 1; padding 0
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.1, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]]))
    assert act.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]


def test_lr_schedule():
    cfg = PretrainConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10)
    assert lr_at(cfg, 0, 0.0) == pytest.approx(0.1)  # warm-up: (0 + 1) / 10
    assert lr_at(cfg, 10, 0.0) == pytest.approx(1.0)
    assert lr_at(cfg, 50, 0.5) == pytest.approx(0.55)  # 0.1 + 0.45 * (1 + cos(pi/2))
    assert lr_at(cfg, 99, 1.0) == pytest.approx(0.1)


def test_batches_cover_every_index_once():
    lengths = [random.Random(i).randrange(10, 500) for i in range(203)]
    batches = make_batches(lengths, 8, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(203))
    assert all(1 <= len(b) <= 8 for b in batches)


def test_pretrain_lowers_loss_and_saves_loadable_model(tmp_path):
    # threads=2 holds for the pretraining only: the recipe's later stages keep their setting.
    # max_steps decides, not the clock: minutes=5 let a loaded machine stop it after 12 of 40 steps.
    cfg = PretrainConfig(sessions=60, val_sessions=8, minutes=120, max_steps=40, batch_size=8,
                         vocab_size=400, warmup_steps=5, log_every=5, lr=3e-3, threads=2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = pretrain(cfg, tmp_path / "base", sessions=hand_sessions(60, 0), val=hand_sessions(8, 1),
                     progress_bar=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert m["steps"] == 40
    first, last = m["curve"][0]["loss"], m["curve"][-1]["loss"]
    assert last < 0.6 * first, (first, last)
    saved = json.loads((tmp_path / "base" / "pretrain_metrics.json").read_text())
    assert saved["steps"] == 40 and saved["tokens"] > 0 and "val_action_loss" in saved
    model, tok = load_actor(tmp_path / "base")
    assert len(tok) == model.config.vocab_size
    assert (tmp_path / "base" / "pretrain_config.yaml").exists()


@pytest.mark.slow
def test_pretrain_cli_smoke(tmp_path, monkeypatch):
    """The entry point end to end, in a subprocess, on the toy corpus: the name-accuracy curve,
    the clean-easy episodes in the sandbox and the verdict are measured and reported."""
    r = subprocess.run(
        [sys.executable, "-m", "minirsi.cli", "pretrain", "--out", str(tmp_path / "b"), "--minutes", "1",
         "--sessions", "50", "--quiet", "val_sessions=4", "max_steps=6", "batch_size=4", "eval_every=3",
         "clean_easy=2"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "saved" in r.stdout and "past the copy transition: False" in r.stdout
    m = json.loads((tmp_path / "b" / "pretrain_metrics.json").read_text())
    assert [p["step"] for p in m["name_curve"]] == [3, 6] and m["name_tokens"] > 0
    assert m["clean_easy_success"] == 0.0 and m["config_hash"] and m["past_copy_transition"] is False
    load_actor(tmp_path / "b")


# ----------------------------------------------------------------------------- the shipped Base


def test_the_shipped_base_is_what_the_presets_pretrain():
    """minirsi/presets/toy-base was written by `minirsi pretrain` with the pretrain config the
    presets hold (its recorded hash is theirs, so the recipe takes it instead of pretraining),
    and the config saved beside it hashes to the same value."""
    from minirsi.run import stages
    from minirsi.run.pretrain import config_hash
    from minirsi.run.config import RunConfig, resolve_preset

    m = json.loads((stages.SHIPPED_BASE / "pretrain_metrics.json").read_text())
    saved = load_config(PretrainConfig, stages.SHIPPED_BASE / "pretrain_config.yaml")
    assert config_hash(saved) == m["config_hash"]
    for preset in ("toy-cpu", "smoke"):
        cfg = load_config(RunConfig, resolve_preset(preset))
        assert stages.shipped_base(cfg.base.pretrain) == stages.SHIPPED_BASE, preset
    other = load_config(RunConfig, resolve_preset("toy-cpu"), ["base.pretrain.max_steps=10"])
    assert stages.shipped_base(other.base.pretrain) is None  # another config: pretrain it


def test_the_shipped_base_is_measured_as_recorded():
    """The shipped Base's figures are the weights' own: the held-out name accuracy recomputed now
    equals the recorded one, and the recorded verdict on issue 22's bar (>= 97% name accuracy,
    >= 90% clean easy, >= 1.5x the 90% step) is what those figures give. The bar itself is not
    asserted: the shipped Base does not meet it yet (README, "The toy Base"), and a test that
    claimed it would be a hard-coded pass."""
    from minirsi.run import stages
    from minirsi.run.pretrain import held_out_name_accuracy, past_copy_transition

    m = json.loads((stages.SHIPPED_BASE / "pretrain_metrics.json").read_text())
    assert m["past_copy_transition"] is past_copy_transition(m)
    assert m["name_curve"][-1]["name_accuracy"] == m["name_accuracy"]
    cfg = load_config(PretrainConfig, stages.SHIPPED_BASE / "pretrain_config.yaml")
    assert m["steps"] == cfg.max_steps  # the whole step budget: not cut short by the time budget
    model, tok = load_actor(stages.SHIPPED_BASE)
    now = held_out_name_accuracy(model, tok, cfg)
    assert now["name_tokens"] == m["name_tokens"]
    # another CPU may round a near-tie the other way: a handful of the ~2,700 tokens at most
    assert abs(now["name_accuracy"] - m["name_accuracy"]) <= 3 / m["name_tokens"]

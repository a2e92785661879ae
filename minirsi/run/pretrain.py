"""``minirsi pretrain``: train the tiny Base model on synthetic shell sessions.

The paper starts from an instruction-tuned Qwen3; on this CPU there is no such model, so Base
is made here: a byte-level BPE tokenizer and a ~1M-parameter Qwen3 (models.py) trained for a
few minutes on ``toy_envs.corpus.sessions(n, seed)``, a demonstrator's sessions over the
training families (never the evaluation instances), rendered into ChatML ids by
``actions.render_session`` exactly as a rollout would lay them out. The demonstrator copies
names right and decides wrong at fixed rates (toy_envs/obstacles.py): what keeps Base imperfect
is its decisions after an error and when to stop, which RSR and RPR can improve.

Past the copy transition. A tiny model learns to copy names from the step's line the agent
printed (``sed -n Kp steps.txt``, toy_envs/base.py ``STEPS_FILE``) abruptly (a phase transition in
the step count); a Base sitting on it swings between runs and machines. So
the run records, every ``eval_every`` steps, the teacher-forced *name accuracy* on held-out
sessions (greedy next-token accuracy at the action tokens that are a name from
toy_envs/words.py, command words excluded) and the step where it first reaches 90%; at the end,
``clean_easy`` episodes on held-out easy tasks without obstacles are rolled out in the sandbox.
The shipped toy Base is trained to >= 97% name accuracy, >= 90% clean-easy success, and at least
1.5x the 90% step (``past_copy_transition``; tests/test_pretrain.py checks the shipped one).

Loss. Token-weighted cross-entropy over the whole sequence,

    L = sum_t w_t * CE_t / sum_t w_t,   CE_t = -log p_theta(x_t | x_<t),
    w_t = 1 on action tokens, ``context_weight`` (default 0.1) on prompt and observation tokens,

(t >= 1; padding has w = 0). Why not actions only: the policy must copy file names and words
from the observations (the step's line, an error, ``ls``) into its commands; a small weight on those tokens
gives their embeddings a direct gradient from every session, which a one-million-parameter
model trained for minutes benefits from. Why not uniform weights: observations (command
output) and the fixed system prompt are most of the tokens, and the policy never generates
them. ``context_weight=0`` gives the SFT loss on actions only.

Budget. ``minutes`` caps the training loop (rendering the corpus and training the tokenizer
come before it). Steps per minute depend on the machine and its load, so a Base trained to a
time budget differs between machines; set ``max_steps`` (and a generous ``minutes``) for a
reproducible Base. Measured rates: docs/experiments.md, "Measurements behind the code's defaults".

Optimiser: AdamW, linear warm-up then cosine decay to ``min_lr_ratio * lr``. The schedule runs
on progress = step / max_steps when ``max_steps`` is set, else elapsed time / time budget, so a
time-boxed run still ends its cosine at the budget. Sequences are padded in length-bucketed
batches (no packing: every sequence starts at position 0 with the system prompt, as in a
rollout).

Run:

    minirsi pretrain --out runs/toy/base --minutes 4 --sessions 20000
    minirsi pretrain --out runs/toy/base --minutes 15 max_steps=600 threads=1   # reproducible
    minirsi pretrain --out runs/toy/base --config pretrain.yaml lr=4e-3   # PretrainConfig fields

Writes ``DIR/`` (config.json, model.safetensors, tokenizer files: ``load_actor(DIR)`` reads
it), ``DIR/pretrain_metrics.json`` (loss curve, name-accuracy curve, the 90% step, clean-easy
success, tokens, time, held-out action loss) and ``DIR/pretrain_config.yaml``
(``config_hash`` in the metrics is what the recipe's Base cache is keyed by).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm import tqdm

from minirsi.config import load_config, save_config, to_dict
from minirsi.core import actions
from minirsi.core.episode import right_pad
from minirsi.engine.models import PRESETS, build_tiny_actor, build_tokenizer, count_parameters, save_actor, torch_threads

logger = logging.getLogger(__name__)


@dataclass
class PretrainConfig:
    """Knobs of the Base pretraining run (the recipe helper tunes these)."""

    sessions: int = 20000
    """Number of corpus sessions generated (``toy_envs.corpus.sessions(n=...)``); about half a
    pass in the budget, since a corpus seen several times is memorised instead of teaching the
    model to copy names from the context (docs/experiments.md, "Measurements behind the
    code's defaults")."""
    val_sessions: int = 256
    """Held-out sessions (another seed) for the action-token loss and the name accuracy."""
    seed: int = 0
    """Seeds the corpus, the model initialisation and the batch order."""
    eval_every: int = 100
    """Steps between two measurements of the held-out name accuracy (0: only at the end)."""
    clean_easy: int = 48
    """Episodes (one per task) on held-out easy toy tasks without obstacles, rolled out in the
    sandbox after training (0: skip; needs bubblewrap and the rootfs)."""
    preset: str = "tiny"
    """Model size: a key of models.PRESETS ("tiny", "small")."""
    vocab_size: int = 2048
    """BPE vocabulary size (bytes + special tokens + learned merges)."""
    minutes: float = 4.0
    """Wall-clock budget for the training loop; training stops when it is spent."""
    max_steps: int = 0
    """If > 0, stop after this many optimiser steps and run the cosine on steps, not time."""
    batch_size: int = 16
    """Sequences per optimiser step."""
    max_len: int = 1024
    """Sessions rendered longer than this many tokens are dropped (counted in the metrics)."""
    lr: float = 6e-3
    """Peak AdamW learning rate; the best of those tried for Base's strict success
    (docs/experiments.md, "Measurements behind the code's defaults"). Copying names from the
    context appears abruptly, so Base varies between runs; check it before a recipe run."""
    min_lr_ratio: float = 0.1
    """The cosine decays to lr * min_lr_ratio."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    context_weight: float = 0.1
    """Loss weight w_t on prompt and observation tokens (action tokens have 1); 0 = SFT."""
    log_every: int = 10
    """Record the loss curve every this many steps."""
    threads: int = 0
    """torch intra-op threads for this run (0: leave torch's setting). On a machine that other
    jobs share, 1 is several times faster than 2 (idle threads spin waiting for a core)."""

    def __post_init__(self) -> None:
        if self.sessions < 1:
            raise ValueError(f"sessions={self.sessions}: need at least 1 corpus session, e.g. 20000")
        if self.val_sessions < 0:
            raise ValueError(f"val_sessions={self.val_sessions}: use 0 (none) or more")
        if self.eval_every < 0 or self.clean_easy < 0:
            raise ValueError(f"eval_every={self.eval_every}, clean_easy={self.clean_easy}: use 0 (off) or a count")
        if self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r}: use one of {sorted(PRESETS)}")
        if self.minutes <= 0:
            raise ValueError(f"minutes={self.minutes}: the time budget must be positive, e.g. 4")
        if self.max_steps < 0:
            raise ValueError(f"max_steps={self.max_steps}: use 0 (time budget) or a positive count")
        if self.threads < 0:
            raise ValueError(f"threads={self.threads}: use 0 (torch default) or a positive count")
        if self.batch_size < 1 or self.log_every < 1:
            raise ValueError("batch_size and log_every must be >= 1")
        if self.max_len < 64:
            raise ValueError(f"max_len={self.max_len}: too short for a prompt and one turn; use >= 64")
        if not (self.lr > 0 and 0.0 <= self.min_lr_ratio <= 1.0):
            raise ValueError(f"lr={self.lr}, min_lr_ratio={self.min_lr_ratio}: need lr > 0, ratio in [0, 1]")
        if self.warmup_steps < 0 or self.weight_decay < 0 or self.grad_clip <= 0:
            raise ValueError("warmup_steps and weight_decay must be >= 0, grad_clip > 0")
        if not 0.0 <= self.context_weight <= 1.0:
            raise ValueError(f"context_weight={self.context_weight}: use a weight in [0, 1] (0 = actions only)")


def corpus_sessions(n: int, seed: int) -> list[Any]:
    """The toy corpus (imported here so that tests can pretrain on hand-written sessions)."""
    from toy_envs import corpus

    return list(corpus.sessions(n, seed=seed))


def held_out_sessions(cfg: PretrainConfig) -> list[Any]:
    """The ``val_sessions`` corpus sessions that name accuracy and the held-out loss are measured
    on: another seed (``seed + 1,000,003``) than the training corpus."""
    return corpus_sessions(cfg.val_sessions, cfg.seed + 1_000_003)


def name_words() -> frozenset[str]:
    """The words a toy task's names are made of (file stems, directories, fruits, git names)."""
    from toy_envs import words

    return frozenset(words.FILES + words.DIRS + words.FRUITS + words.TAGS)


def name_positions(tokenizer: Any, ids: Sequence[int], mask: Sequence[int], names: frozenset[str]) -> list[int]:
    """Positions t of action tokens that are a whole name (``Ġcat`` or ``cat``), except a
    command's first word (``cat`` in ``cat cat.txt``): what copying from the context is."""
    toks = tokenizer.convert_ids_to_tokens(list(ids))
    out = []
    for t in range(1, len(ids)):
        if mask[t] and toks[t].lstrip("Ġ") in names and not toks[t - 1].endswith(("Ċ", "\n")):
            out.append(t)
    return out


def past_copy_transition(metrics: dict) -> bool:
    """The shipped Base's bar: name accuracy >= 97%, clean easy tasks >= 90%, and trained for at
    least 1.5x the step where name accuracy first reached 90%."""
    step90 = metrics.get("name_accuracy_90_step")
    return (metrics.get("name_accuracy", 0.0) >= 0.97 and metrics.get("clean_easy_success", 0.0) >= 0.90
            and step90 is not None and metrics["steps"] >= 1.5 * step90)


def session_text(session: Any) -> str:
    """Plain text of a session (no special tokens), what the BPE merges are learned from."""
    parts = [actions.SYSTEM_PROMPT, "system", "user", "assistant", session.instruction]
    for act, obs in actions.session_turns(session):
        parts.append(act)
        if obs is not None:
            parts.append(obs)
    return "\n".join(parts)


def make_batches(lengths: Sequence[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Length-bucketed batches of indices: shuffle, sort within windows of 32 batches, split,
    shuffle the batches. Less padding than random batches, still a random order."""
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    window = batch_size * 32
    batches = []
    for s in range(0, len(idx), window):
        chunk = sorted(idx[s : s + window], key=lambda i: lengths[i])
        batches += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def collate_weighted(
    rows: Sequence[tuple[list[int], list[int]]], pad_id: int, context_weight: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad (ids, action_mask) rows -> input_ids, attention_mask, weights, action_mask, all (B, T).

    ``weights[b, t]`` is w_t of the loss for predicting token t (0 at t = 0 and on padding).
    """
    input_ids, attention_mask, act = right_pad([ids for ids, _ in rows], pad_id, [mask for _, mask in rows])
    weights = attention_mask.float() * (context_weight + (1.0 - context_weight) * act)  # (B, T)
    weights[:, 0] = 0.0  # nothing predicts the first token
    return input_ids, attention_mask, weights, act


def weighted_loss(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, CE) with L = sum_t w_t CE_t / sum_t w_t; CE (B, T) holds -log p(x_t | x_<t), 0 at t = 0."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten(), reduction="none"
    ).view(input_ids.shape[0], -1)  # (B, T-1)
    ce = torch.cat([torch.zeros_like(ce[:, :1]), ce], dim=1)  # (B, T)
    return (ce * weights).sum() / weights.sum().clamp_min(1.0), ce


def config_hash(cfg: PretrainConfig) -> str:
    """16 hex digits of the config's JSON and the corpus's version (``toy_envs.corpus.VERSION``,
    so a Base of an older toy world is never taken for this one): what the recipe's Base cache
    (and the shipped Base's directory name) is keyed by."""
    from toy_envs import corpus

    keyed = {**to_dict(cfg), "corpus_version": corpus.VERSION}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]


def lr_at(cfg: PretrainConfig, step: int, progress: float) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine from lr to lr * min_lr_ratio on progress in [0, 1]."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * min(progress, 1.0)))


@torch.no_grad()
def evaluate(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]], pad_id: int, batch_size: int,
             names: Sequence[Sequence[int]] | None = None) -> dict:
    """Held-out action-token loss and greedy next-token accuracy on action tokens; with
    ``names`` (per row, the positions of name tokens: ``name_positions``) the accuracy there."""
    model.eval()
    tot_ce, tot_hit, tot_n, name_hit, name_n = 0.0, 0.0, 0.0, 0.0, 0
    for s in range(0, len(rows), batch_size):
        ids, am, _, act = collate_weighted(rows[s : s + batch_size], pad_id, 0.0)
        logits = model(input_ids=ids, attention_mask=am).logits  # (B, T, V)
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        hit2d = (logits[:, :-1].argmax(-1) == ids[:, 1:]).float()  # (B, T-1): token t+1 predicted at t
        m = act[:, 1:].flatten()
        tot_ce += float((ce * m).sum())
        tot_hit += float((hit2d.flatten() * m).sum())
        tot_n += float(m.sum())
        if names is not None:
            for b, pos in enumerate(names[s : s + batch_size]):
                name_hit += float(sum(hit2d[b, t - 1] for t in pos))
                name_n += len(pos)
    model.train()
    n = max(tot_n, 1.0)
    out = {"val_action_loss": tot_ce / n, "val_action_accuracy": tot_hit / n, "val_action_tokens": int(tot_n)}
    if names is not None:
        out.update(name_accuracy=name_hit / max(name_n, 1), name_tokens=name_n)
    return out


def held_out_name_accuracy(model: torch.nn.Module, tokenizer: Any, cfg: PretrainConfig) -> dict:
    """``evaluate`` on the held-out sessions ``cfg`` names (``held_out_sessions``), rendered with
    ``tokenizer``: recomputes a saved Base's recorded name accuracy."""
    rows = [actions.render_session(tokenizer, s)[:2] for s in held_out_sessions(cfg)]
    rows = [r for r in rows if len(r[0]) <= cfg.max_len]
    names = name_words()
    return evaluate(model, rows, tokenizer.pad_token_id, cfg.batch_size,
                    [name_positions(tokenizer, ids, mask, names) for ids, mask in rows])


def clean_easy_success(model: torch.nn.Module, tokenizer: Any, n: int, seed: int = 0) -> float:
    """Strict success of one episode each on ``n`` held-out easy toy tasks with no obstacle
    (``toy_envs.suites.clean_easy``), sampled at temperature 1 in the bubblewrap sandbox."""
    import tempfile

    from minirsi.engine.rollout import RolloutConfig, collect
    from minirsi.engine.sampler import HFSampler
    from minirsi.env.tasks import load_task
    from toy_envs.suites import clean_easy
    from toy_envs.base import write_task

    with tempfile.TemporaryDirectory(prefix="minirsi-clean-easy-") as root:
        os.chmod(root, 0o755)  # the sandbox's user must traverse it (git tasks' set-up script)
        tasks = [load_task(write_task(inst, Path(root))) for inst in clean_easy(n, seed)]
        was = model.training
        model.eval()
        episodes = collect(tasks, HFSampler(model, tokenizer), tokenizer, RolloutConfig(seed=seed, max_turns=6))
        model.train(was)
    return sum(e.success for e in episodes) / len(episodes)


def pretrain(
    cfg: PretrainConfig,
    out_dir: str | Path,
    sessions: Sequence[Any] | None = None,
    val: Sequence[Any] | None = None,
    progress_bar: bool = True,
) -> dict:
    """Build tokenizer and model, train on the corpus, save to ``out_dir``; returns the metrics.

    ``sessions`` / ``val`` replace the toy corpus (tests pass hand-written sessions).
    ``cfg.threads`` applies to this call only (the caller's setting is restored).
    """
    with torch_threads(cfg.threads):
        return _pretrain(cfg, out_dir, sessions, val, progress_bar)


def _pretrain(
    cfg: PretrainConfig,
    out_dir: str | Path,
    sessions: Sequence[Any] | None,
    val: Sequence[Any] | None,
    progress_bar: bool,
) -> dict:
    t_start = time.perf_counter()
    out = Path(out_dir)
    toy = sessions is None
    if sessions is None:
        sessions = corpus_sessions(cfg.sessions, cfg.seed)
    if val is None:
        val = held_out_sessions(cfg) if cfg.val_sessions else []
    tokenizer = build_tokenizer([session_text(s) for s in sessions], vocab_size=cfg.vocab_size)
    pad_id = tokenizer.pad_token_id

    def render(ss: Sequence[Any]) -> tuple[list[tuple[list[int], list[int]]], int]:
        rows, dropped = [], 0
        for s in ss:
            ids, mask, _ = actions.render_session(tokenizer, s)
            if len(ids) > cfg.max_len:
                dropped += 1
                continue
            rows.append((ids, mask))
        return rows, dropped

    rows, dropped = render(sessions)
    val_rows, _ = render(val)
    names = name_words()
    val_names = [name_positions(tokenizer, ids, mask, names) for ids, mask in val_rows]
    name_curve: list[dict] = []
    step90 = None

    def measure(step: int) -> None:
        nonlocal step90
        m = evaluate(model, val_rows, pad_id, cfg.batch_size, val_names)
        name_curve.append({"step": step, "name_accuracy": m["name_accuracy"], "val_action_loss": m["val_action_loss"]})
        if step90 is None and m["name_accuracy"] >= 0.90:
            step90 = step
        logger.info("pretrain step %d: held-out name accuracy %.4f, action loss %.4f", step, m["name_accuracy"],
                    m["val_action_loss"])

    if not rows:
        raise ValueError(f"every session is longer than max_len={cfg.max_len} tokens; raise max_len")
    lengths = [len(r[0]) for r in rows]
    logger.info("pretrain: %d sessions (%d dropped > max_len), mean %.0f tokens", len(rows), dropped, sum(lengths) / len(rows))

    model = build_tiny_actor(tokenizer, cfg.preset, seed=cfg.seed)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]  # norms: no weight decay
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    budget = cfg.minutes * 60.0
    curve: list[dict] = []
    step, epoch, seen, tokens, action_tokens = 0, 0, 0, 0, 0
    t0 = time.perf_counter()
    total = cfg.max_steps if cfg.max_steps else None
    bar = tqdm(total=total, desc="pretrain", unit="step", disable=not progress_bar)
    stop = False
    while not stop:
        for batch in make_batches(lengths, cfg.batch_size, rng):
            elapsed = time.perf_counter() - t0
            progress = step / cfg.max_steps if cfg.max_steps else elapsed / budget
            if elapsed >= budget or (cfg.max_steps and step >= cfg.max_steps):
                stop = True
                break
            lr = lr_at(cfg, step, progress)
            for g in opt.param_groups:
                g["lr"] = lr
            ids, am, w, act = collate_weighted([rows[i] for i in batch], pad_id, cfg.context_weight)
            loss, ce = weighted_loss(model, ids, am, w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            step += 1
            seen += len(batch)
            tokens += int(am.sum())
            action_tokens += int(act.sum())
            loss_v = float(loss.detach())
            a_loss = float((ce.detach() * act).sum() / act.sum().clamp_min(1.0))
            if step % cfg.log_every == 0 or step == 1:
                curve.append({"step": step, "time_s": round(elapsed, 2), "lr": lr, "loss": loss_v, "action_loss": a_loss})
            if val_rows and cfg.eval_every and step % cfg.eval_every == 0:
                measure(step)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_v:.3f}", act=f"{a_loss:.3f}", ep=epoch)
        else:
            epoch += 1
    bar.close()
    train_time = time.perf_counter() - t0

    metrics = {
        "config": to_dict(cfg),
        "parameters": count_parameters(model),
        "vocab_size": len(tokenizer),
        "sessions": len(rows),
        "dropped_sessions": dropped,
        "mean_session_tokens": sum(lengths) / len(lengths),
        "steps": step,
        "epochs": seen / len(rows),  # passes over the corpus (fractional)
        "tokens": tokens,
        "action_tokens": action_tokens,
        "train_time_s": train_time,
        "tokens_per_s": tokens / max(train_time, 1e-9),
        "curve": curve,
        "first_loss": curve[0]["loss"] if curve else None,
        "final_loss": curve[-1]["loss"] if curve else None,
    }
    if val_rows:
        metrics.update(evaluate(model, val_rows, pad_id, cfg.batch_size, val_names))
        if not name_curve or name_curve[-1]["step"] != step:
            name_curve.append({"step": step, "name_accuracy": metrics["name_accuracy"],
                               "val_action_loss": metrics["val_action_loss"]})
        if step90 is None and metrics["name_accuracy"] >= 0.90:
            step90 = step
    metrics["name_curve"] = name_curve
    metrics["name_accuracy_90_step"] = step90
    if toy and cfg.clean_easy:
        metrics["clean_easy_success"] = clean_easy_success(model, tokenizer, cfg.clean_easy, seed=cfg.seed)
    metrics["config_hash"] = config_hash(cfg)
    metrics["past_copy_transition"] = past_copy_transition(metrics) if toy else None
    save_actor(model, tokenizer, out)
    metrics["total_time_s"] = time.perf_counter() - t_start
    (out / "pretrain_metrics.json").write_text(json.dumps(metrics, indent=1))
    save_config(cfg, out / "pretrain_config.yaml")
    logger.info("pretrain: name accuracy %.4f (90%% at step %s of %d), clean easy success %s",
                metrics.get("name_accuracy", float("nan")), step90, step, metrics.get("clean_easy_success"))
    logger.info(
        "pretrain: %d steps, %.0f s, %d tokens, loss %.3f -> %.3f; saved to %s",
        step, train_time, tokens, metrics["first_loss"] or float("nan"), metrics["final_loss"] or float("nan"), out,
    )
    return metrics


def cli(argv: Sequence[str] | None = None, command: str = "pretrain") -> int:
    p = argparse.ArgumentParser(prog=f"minirsi {command}", description="Train the tiny Base model on toy shell sessions.")
    p.add_argument("--out", required=True, help="directory to write the model (load with --model DIR)")
    p.add_argument("--config", help="YAML file with PretrainConfig fields")
    p.add_argument("--section", help="top-level section of the YAML file to read (e.g. pretrain)")
    p.add_argument("--minutes", type=float, help="time budget of the training loop")
    p.add_argument("--sessions", type=int, help="number of corpus sessions")
    p.add_argument("--seed", type=int)
    p.add_argument("--preset", help=f"model size: {', '.join(PRESETS)}")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", help="PretrainConfig key=value overrides, e.g. lr=2e-3")
    args = p.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    flags = [f"{k}={getattr(args, k)}" for k in ("minutes", "sessions", "seed", "preset") if getattr(args, k) is not None]
    cfg = load_config(PretrainConfig, args.config, list(args.overrides) + flags, section=args.section)
    m = pretrain(cfg, args.out, progress_bar=not args.quiet)
    print(
        f"saved {args.out}: {m['parameters'] / 1e6:.2f}M params, {m['steps']} steps, {m['tokens']} tokens, "
        f"{m['train_time_s']:.0f} s, loss {m['first_loss']:.3f} -> {m['final_loss']:.3f}"
        + (f", held-out action loss {m['val_action_loss']:.3f}" if "val_action_loss" in m else "")
    )
    if "name_accuracy" in m:
        print(f"name accuracy {m['name_accuracy']:.4f} (reached 90% at step {m['name_accuracy_90_step']}), "
              f"clean easy success {m.get('clean_easy_success')}, past the copy transition: {m['past_copy_transition']}")
    return 0

"""The critic: a value model carried from stage to stage, its loss, and its warm-up.

docs/method.md sections 4 and 5. The critic is a separate model, an LM backbone (the actor's
transformer without its LM head) plus a scalar head, that reads the same token sequence as the
actor and predicts at every position t a baseline V_t of the episode's reward. Only action
positions matter: TB-GAE (minirsi/core/tb_gae.py) reads V at action tokens and skips observation
tokens.

Alignment. V_t is the value of the state *before* token x_t is sampled, so it may depend on
x_<t only. The actor scores x_t with the logits at position t-1; the critic reads V_t at the
same place::

    V_t = head(h_{t-1})   (t >= 1),    V_0 = 0   (position 0 is the prompt, never an action)

where h is the backbone's last hidden state. ``head(h_t)`` would be Q(s_t, x_t): it has seen
the action it is the baseline for, the advantage of a decisive token cancels, and PPO cannot
learn even a one-token bandit (tests/test_learning.py; tutorials/06_value_alignment.py shows
both curves).

Value loss (clipped, PPO style; over action tokens only)::

    V_clip_t = V_old_t + clip(V_t - V_old_t, -eps_v, +eps_v)
    L_V      = sum_t m_t * 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2) / N

with m the action mask, R the TB-GAE returns, V_old the values the returns were computed
with, eps_v = ``value_clip`` and N the number of action tokens of the minibatch (token mean).

Explained variance, logged at every update (paper: -1.15 at warm-up start, 0.01-0.52 in
RPR-2)::

    EV = 1 - Var(R - V) / Var(R)        over action tokens

Lifecycle (the "handoff"):

* ``build_critic(actor)`` copies the actor's backbone weights and adds a zero-initialised head,
  so the first values are exactly 0 (our choice; the paper does not say how the head starts).
  Every critic parameter trains, whatever the actor's ``requires_grad`` flags (a frozen actor
  must never freeze the critic built from it).
* ``warmup_critic`` is the Warm-up Critic Model: ``WarmupConfig.epochs`` (paper: 1) critic-only
  epochs over rollouts of the frozen RSR-1 actor, backbone and head, before the first refine
  phase. It has its own settings (``WarmupConfig``), not RPR-1's, except the discount of the
  returns it regresses on: RPR-1's (the recipe hands it on).
* ``save_critic`` / ``load_critic`` carry it between stages; RSR stages never load it, so it
  leaves them bit-identical (``fingerprint`` is the hash a test compares).
* Each refine phase starts with ``critic_calibration_updates`` critic-only updates; they are
  run by ``minirsi.core.rpr.run_rpr`` because they need fresh rollouts.

Call it::

    critic = build_critic(actor)                      # or build_critic("runs/x/rsr1/actor")
    evs = warmup_critic(critic, episodes, rewards, WarmupConfig(gamma_turn=0.9, lam_turn=0.95))  # RPR-1's
    save_critic(critic, "runs/x/critic"); critic = load_critic("runs/x/critic")
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel

from minirsi.core.distributed import SINGLE, World
from minirsi.core.episode import Episode, collate, forward_by_length, masked_mean, minibatches
from minirsi.core.optim import adamw, clipped_step
from minirsi.core.tb_gae import tb_gae

logger = logging.getLogger(__name__)

CRITIC_FORMAT = "minirsi-critic"
CRITIC_VERSION = 2
"""2: V_t = head(h_{t-1}), the value before token t. Version 1 read V_t = head(h_t) (it had seen
x_t); its weights were trained for the wrong target, so ``load_critic`` refuses them."""


@dataclass
class WarmupConfig:
    """The Warm-up Critic Model: critic-only training on rollouts of the frozen RSR-1 actor."""

    samples_per_task: int = 1
    """Rollouts of the frozen RSR-1 actor per training task (the epoch's data)."""
    tasks: int = 0
    """Training tasks rolled out: 0 every one, N a seeded sample of N of them."""
    reward: str = "fdr"
    """Reward the critic learns to predict: fdr or spr (RPR-1's reward in the paper: FDR)."""
    epochs: int = 1
    """Passes over the rollouts (paper: one epoch)."""
    lr_critic: float = 1e-4
    """Critic learning rate (AdamW) for the whole critic, backbone and head."""
    gamma_turn: float | None = None
    """gamma_turn of the TB-GAE returns the critic regresses on: RPR-1's, whose values the critic
    will be. None: the recipe takes RPR-1's (a direct call of ``warmup_critic`` must set it)."""
    lam_turn: float | None = None
    """lambda_turn of those returns: RPR-1's, for the same reason (None as for gamma_turn)."""
    value_clip: float = 0.0
    """epsilon_v around V_old; 0 (default) is plain regression: with a frozen actor there is no
    policy to keep the critic's targets consistent with."""
    minibatch_size: int = 8
    """Episodes per optimizer step."""
    grad_accum: int = 1
    """Micro-batches per minibatch (gradient accumulation, bounds memory)."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip."""
    forward_chunk: int = 0
    """Sequences per no-grad pass of V_old; 0: a micro-batch's rows at once (the CPU presets).
    At scale 1: one long episode's activations at a time (``minirsi plan`` counts it)."""
    seed: int = 0
    """Seeds the minibatch shuffle (the recipe sets it from the run seed)."""

    def __post_init__(self) -> None:
        if self.forward_chunk < 0:
            raise ValueError(f"warmup.forward_chunk={self.forward_chunk}: use 0 (a micro-batch at once) or >= 1")
        for name in ("samples_per_task", "epochs", "minibatch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"warmup.{name}={getattr(self, name)}: use >= 1")
        if self.tasks < 0:
            raise ValueError(f"warmup.tasks={self.tasks}: use 0 (every training task) or a count")
        if self.grad_accum > self.minibatch_size:
            raise ValueError(f"warmup.grad_accum={self.grad_accum} > minibatch_size={self.minibatch_size}; "
                             "lower grad_accum")
        for name in ("lr_critic", "max_grad_norm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"warmup.{name}={getattr(self, name)}: use a positive value, e.g. 1e-4")
        for name in ("gamma_turn", "lam_turn"):
            if getattr(self, name) is not None and not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"warmup.{name}={getattr(self, name)}: must be in [0, 1]")
        if self.value_clip < 0:
            raise ValueError(f"warmup.value_clip={self.value_clip}: use 0 (off) or a positive clip")
        if self.reward not in ("fdr", "spr"):
            raise ValueError(f"warmup.reward='{self.reward}': use fdr or spr")


class ValueModel(nn.Module):
    """LM backbone + scalar head: ``V_t = head(h_{t-1})``, the value before token t.

    Args:
        backbone: a transformers base model (e.g. ``Qwen3Model``) whose output has
            ``last_hidden_state`` of shape (B, T, H).
        hidden: H, the backbone's hidden size.
        head_init_std: 0 gives a zero head (every value starts at 0); > 0 draws N(0, std^2).
    """

    def __init__(self, backbone: PreTrainedModel, hidden: int, head_init_std: float = 0.0):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden, 1)
        with torch.no_grad():
            if head_init_std > 0:
                self.head.weight.normal_(0.0, head_init_std)
            else:
                self.head.weight.zero_()
            self.head.bias.zero_()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask: (B, T) -> values (B, T), float32; V_t depends on x_<t only
        (the module docstring's alignment), V_0 = 0."""
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
        v = self.head(h[:, :-1].to(self.head.weight.dtype)).squeeze(-1).float()  # (B, T-1): v[:, t-1] = V_t
        return torch.cat([v.new_zeros(v.shape[0], 1), v], dim=1)  # (B, T)


def build_critic(
    source: PreTrainedModel | PretrainedConfig | str | Path, head_init_std: float = 0.0
) -> ValueModel:
    """A new critic whose backbone starts from the actor's.

    ``source`` is the actor itself (a causal LM, possibly a peft LoRA model whose adapters are
    merged into the copy), a checkpoint directory of the actor, or a config (random backbone,
    for tests and for a critic trained from scratch). The actor is never modified.
    """
    if isinstance(source, PretrainedConfig):
        backbone = AutoModel.from_config(source)
    elif isinstance(source, (str, Path)):
        if not Path(source).is_dir():
            raise ValueError(f"build_critic: {source} is not a checkpoint directory; pass the actor's saved dir")
        backbone = AutoModel.from_pretrained(str(source))
    elif isinstance(source, nn.Module):
        model = copy.deepcopy(source)
        if hasattr(model, "merge_and_unload"):  # peft: fold the LoRA deltas into the copy
            model = model.merge_and_unload()
        backbone = model.base_model  # e.g. Qwen3ForCausalLM -> its Qwen3Model
        if backbone is model:
            raise ValueError(f"build_critic: {type(source).__name__} has no base model to copy")
    else:
        raise ValueError(f"build_critic: cannot build from {type(source).__name__}; pass a model, dir or config")
    backbone.float()
    critic = ValueModel(backbone, backbone.config.hidden_size, head_init_std)
    return critic.requires_grad_(True)  # a copy of a frozen actor carries its flags: drop them


def save_critic(critic: ValueModel, out_dir: str | Path) -> Path:
    """Write ``backbone/`` (save_pretrained, safetensors), ``value_head.safetensors`` and
    ``critic.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    critic.backbone.save_pretrained(out / "backbone", safe_serialization=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in critic.head.state_dict().items()},
              str(out / "value_head.safetensors"))
    meta = {"format": CRITIC_FORMAT, "version": CRITIC_VERSION, "value_position": "t-1",
            "hidden_size": critic.head.in_features, "fingerprint": fingerprint(critic)}
    (out / "critic.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def load_critic(path: str | Path) -> ValueModel:
    """Read a critic written by ``save_critic``; checks its fingerprint."""
    path = Path(path)
    meta_path = path / "critic.json"
    if not meta_path.is_file():
        raise ValueError(f"load_critic: {meta_path} not found; is {path} a directory written by save_critic?")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") == CRITIC_FORMAT and meta.get("version") == 1:
        raise ValueError(f"load_critic: {meta_path} is a version-1 critic, whose value at token t had already "
                         "seen token t; its weights do not estimate the value before the token. Fix: train a "
                         "new critic (re-run the warm-up stage: delete the run's *-warmup directory and every "
                         "stage after it, then `minirsi run --resume`)")
    if meta.get("format") != CRITIC_FORMAT or meta.get("version") != CRITIC_VERSION:
        raise ValueError(f"load_critic: {meta_path} has format {meta.get('format')} v{meta.get('version')}, "
                         f"expected {CRITIC_FORMAT} v{CRITIC_VERSION}")
    backbone = AutoModel.from_pretrained(str(path / "backbone"))
    critic = ValueModel(backbone.float(), int(meta["hidden_size"]))
    critic.head.load_state_dict(load_file(str(path / "value_head.safetensors")))
    if "fingerprint" in meta and fingerprint(critic) != meta["fingerprint"]:
        raise ValueError(f"load_critic: weights in {path} do not match critic.json's fingerprint (corrupt copy?)")
    return critic


def critic_skeleton(path: str | Path) -> ValueModel:
    """The critic ``load_critic(path)`` (a critic directory) or ``build_critic(path)`` (an actor
    checkpoint directory) returns, without its weights: built from the config alone, so under
    ``torch.device("meta")`` (as ``World.load_sharded`` calls it) it takes no memory."""
    path = Path(path)
    if (path / "critic.json").is_file():
        config = AutoConfig.from_pretrained(str(path / "backbone"))
        hidden = int(json.loads((path / "critic.json").read_text())["hidden_size"])
    elif (path / "config.json").is_file():
        config = AutoConfig.from_pretrained(str(path))
        hidden = config.hidden_size
    else:
        raise ValueError(f"critic_skeleton: {path} has neither critic.json (a saved critic) nor config.json "
                         "(an actor checkpoint); pass the directory the critic is loaded or built from")
    backbone = AutoModel.from_config(config, dtype=torch.float32)
    return ValueModel(backbone, hidden).requires_grad_(True)


def load_critic_sharded(path: str | Path, world: "World", device: str | torch.device = "cpu") -> ValueModel:
    """``load_critic(path)`` for a saved critic, ``build_critic(path)`` for an actor checkpoint,
    sharded over ``world`` by ``World.load_sharded`` (rank 0 reads, the others build
    ``critic_skeleton`` on the meta device; the shards live on the world's device). Rank 0 keeps
    no unsharded copy: the critic is only gathered to be saved. At world size 1, the loaded
    critic itself, on ``device``."""
    path = Path(path)
    load = (lambda: load_critic(path)) if (path / "critic.json").is_file() else (lambda: build_critic(path))
    if world.size == 1:
        return load().to(device)
    return world.load_sharded(load, lambda: critic_skeleton(path), keep_unsharded=False)


def fingerprint(module: nn.Module) -> str:
    """sha256 over the state dict (names, dtypes, shapes, bytes): equal iff bit-identical."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# --------------------------------------------------------------------------- the math


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    clip: float | None,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Clipped value loss L_V (module docstring) over action tokens.

    Args:
        values: V, (B, T), with grad.
        old_values: V_old, (B, T), the values the returns were computed with.
        returns: R, (B, T).
        action_mask: m, (B, T), 1 on action tokens.
        clip: eps_v; ``None`` or 0 turns clipping off (plain 0.5 (V - R)^2).
        normalizer: N; defaults to m.sum(). Gradient accumulation passes the minibatch's
            token count so that micro-batch losses add up to the minibatch token mean.
    Returns:
        scalar loss. Positions with m = 0 never enter it (``episode.masked_mean``).
    """
    err = (values - returns) ** 2  # (B, T)
    if clip:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (v_clip - returns) ** 2)
    return 0.5 * masked_mean(err, action_mask, normalizer)  # x 0.5 is exact: same bits as (0.5 sum) / N


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """EV = 1 - Var(R - V) / Var(R) over positions with mask = 1 (population variances).

    1 is a perfect critic, 0 a constant one, negative worse than a constant. NaN when
    Var(R) = 0 (no signal to explain: every return equal) or no position is masked in.
    """
    m = mask.bool()
    r, v = returns[m].double(), values[m].double()
    if r.numel() == 0:
        return float("nan")
    var_r = r.var(unbiased=False)
    if var_r <= 0:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / var_r)


# --------------------------------------------------------------------------- training loops


def compute_values(critic: ValueModel, batch: dict[str, torch.Tensor], chunk: int) -> torch.Tensor:
    """V (B, T) without grad (``forward_by_length``)."""
    return forward_by_length(critic, batch, chunk)


def warmup_critic(
    critic: ValueModel,
    episodes: Sequence[Episode],
    rewards: Sequence[float],
    cfg: WarmupConfig,
    optimizer: torch.optim.Optimizer | None = None,
    pad_id: int = 0,
    world: World | None = None,
) -> list[float]:
    """Warm-up Critic Model: ``cfg.epochs`` critic-only epochs over rollouts of a frozen actor.

    Each epoch shuffles the episodes (``cfg.seed``) into minibatches of ``cfg.minibatch_size``;
    for each, V_old = critic(x), (A, R) = TB-GAE(r, V_old) with ``cfg.gamma_turn`` /
    ``cfg.lam_turn``, then one optimizer step on L_V (``cfg.value_clip``, gradients accumulated
    over ``cfg.grad_accum`` micro-batches, clipped to ``cfg.max_grad_norm``) for every critic
    parameter. The EV of V_old against R is measured before each step, on sequences the critic
    has not yet trained on in this epoch, so the list tracks how well the critic generalises.
    Sharded (``world``): each rank trains on its rows of each micro-batch, with N all-reduced
    (minirsi.core.distributed); V_old and the EV are computed on the whole minibatch by every rank.

    Returns:
        EV per update, in order.
    """
    world = world or SINGLE
    if len(episodes) != len(rewards):
        raise ValueError(f"warmup_critic: {len(episodes)} episodes but {len(rewards)} rewards")
    for name in ("gamma_turn", "lam_turn"):
        if getattr(cfg, name) is None:
            raise ValueError(f"warmup_critic: WarmupConfig.{name} is None; pass the {name} of the RPR stage this "
                             "critic will serve (the recipe takes RPR-1's)")
    if optimizer is None:
        optimizer = adamw(critic.parameters(), cfg.lr_critic)
    gen = torch.Generator().manual_seed(cfg.seed)
    device = critic.head.weight.device
    lengths = torch.tensor([len(e.token_ids) for e in episodes])
    critic.train()
    evs = []
    for _ in range(cfg.epochs):
        for micro in minibatches(len(episodes), cfg.minibatch_size, cfg.grad_accum, gen, lengths):
            parts = []
            for idx in micro:
                b = collate([episodes[i] for i in idx], [rewards[i] for i in idx], pad_id=pad_id, device=device)
                b["old_values"] = compute_values(critic, b, chunk=cfg.forward_chunk or len(idx))
                _, b["returns"] = tb_gae(b["rewards"], b["old_values"], b["action_mask"], b["turn_ids"],
                                         cfg.gamma_turn, cfg.lam_turn)
                parts.append(b)
            n_tok = sum(b["action_mask"].sum() for b in parts).clamp(min=1)
            r = torch.cat([b["returns"][b["action_mask"].bool()] for b in parts])  # (N,)
            v = torch.cat([b["old_values"][b["action_mask"].bool()] for b in parts])  # (N,)
            evs.append(explained_variance(r, v, torch.ones_like(r)))
            if world.size > 1:  # train on this rank's rows, normalised by N / W (minirsi.core.distributed)
                parts = [world.local(b) for b in parts]
                n_tok = world.normalizer(sum(b["action_mask"].sum() for b in parts).clamp(min=1))
            critic_step(critic, optimizer, parts, n_tok, cfg.value_clip, cfg.max_grad_norm, world=world)
            logger.info("critic warm-up update %d: EV %.3f", len(evs), evs[-1])
    return evs


def critic_step(
    critic: ValueModel,
    optimizer: torch.optim.Optimizer,
    parts: Sequence[dict[str, torch.Tensor]],
    n_tok: torch.Tensor,
    value_clip: float | None,
    max_grad_norm: float,
    value_coef: float = 1.0,
    world: World | None = None,
) -> tuple[float, float]:
    """One optimizer step of the critic alone: the warm-up's update and an RPR calibration
    update (``rpr.ppo_update(update_actor=False)``).

    ``parts`` are one minibatch's micro-batches (this rank's rows), each with ``input_ids``,
    ``attention_mask``, ``old_values``, ``returns`` and ``action_mask`` (all (b, T)); every
    micro-batch's loss is divided by the minibatch's token count ``n_tok``, so the accumulated
    gradient is that of the minibatch's token mean of ``value_coef`` * L_V.

    Returns:
        (sum over micro-batches of L_V, the gradient norm before clipping).
    """
    world = world or SINGLE
    optimizer.zero_grad(set_to_none=True)
    loss = 0.0
    for i, b in enumerate(parts):
        world.grad_sync([critic], last=i == len(parts) - 1)  # reduce-scatter in the last micro-batch only
        values = critic(b["input_ids"], b["attention_mask"])  # (b, T)
        l_v = value_loss(values, b["old_values"], b["returns"], b["action_mask"], value_clip, n_tok)
        (value_coef * l_v).backward()
        loss += float(l_v.detach())
    return loss, clipped_step(optimizer, max_grad_norm)

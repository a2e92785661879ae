"""The planner: will an RPR step of a given model fit on given GPUs, and how long will it take?

``minirsi plan`` answers, before anything is loaded, for the FSDP2 layout of minirsi.distributed:
actor and critic each sharded over all ``G`` GPUs (every parameter, gradient and Adam moment
split G ways), trained in the same micro-batch loop (``rpr.ppo_update`` backpropagates
``l_actor + c_v l_V`` at once, so both models' activations are alive together).

Memory per GPU, in bytes, of one model with ``P`` parameters (``L`` layers of ``P_l`` each,
hidden ``h``, query width ``q = heads * head_dim``, key/value width ``k``, MLP width ``I``,
vocabulary ``V``), micro-batch ``b`` sequences of ``s`` tokens (``n = b s``)::

    states       full fine-tuning: 16 P / G     fp32 params 4 + fp32 grads 4 + Adam m, v 8
                 LoRA:              2 P / G     frozen bf16 base (adapter states < 1%: ignored)
    gathered     2 (2 P_l + P_root) + 4 P_l     bf16 all-gathered units (the layer in use and
                                                the prefetched one, and the root: embeddings,
                                                head, final norm) + one layer's fp32 unsharded grads
    activations  2 n L a                        bf16, a = 4h + 2q + 2k + 4I saved elements per
                                                token per layer (norm in/out, q, k, v, attention
                                                out; norm in/out, gate, up, silu(gate), product)
                 with checkpointing: 2 n (L h + a)   layer inputs + one layer recomputed
    logits       14 n V (actor only)            bf16 logits 2 + fp32 copy 4 + log-softmax 4 +
                                                entropy term 4 (rpr.policy_forward)

A frozen KL reference (``kl_coef > 0`` without LoRA) adds its bf16 shard, 2 P / G. A config
fits when actor + critic (+ reference) <= ``gpu_mem_gib - reserve_gib`` (the reserve covers the
CUDA context, NCCL buffers and allocator fragmentation).

Step time, from FLOPs at a stated utilisation (``mfu`` of ``peak_tflops`` per GPU). A forward
pass costs per token ``2 P_mm + 2 L q s`` (matmul parameters ``P_mm``: every parameter but an
untied input embedding; causal attention scores and values, each token seeing s/2 positions
on average). One RPR step on ``T`` tokens runs, per model, one no-grad forward (logp_old, V_old;
another for the reference) then ``ppo_epochs`` x (forward + backward = 3 forwards, +1 with
checkpointing)::

    FLOPs = sum over actor, critic of  T fwd (1 + ppo_epochs (3 + ckpt))  [+ T fwd_actor for the reference]
    time  = FLOPs / (G peak_tflops 1e12 mfu)

Rollouts are not in it: at scale they run on separate vLLM nodes (scale/README.md). These are
estimates to size a job before queueing it; the GPU check (``scale/gpu_check.py``) prints them
beside measured figures.

Call it::

    minirsi plan --model Qwen/Qwen3-32B --gpus 32 --gpu-mem-gib 80 --seq-len 8192 --micro-batch 1
    minirsi plan --config scale/configs/qwen3-32b-4x8.yaml     # the scale: section of a run config
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

GIB = 1024 ** 3
ACTOR_LOGIT_BYTES = 14
"""Bytes per token per vocabulary entry alive in the actor's loss (module docstring)."""


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer's config.json that size its memory."""

    hidden: int
    layers: int
    vocab: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def from_config(cls, cfg: Any) -> "ModelShape":
        """From a transformers config (object or config.json dict); head_dim defaults to hidden / heads."""
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size",
                               "num_attention_heads") if get(k) is None]
        if missing:
            raise ValueError(f"model config lacks {missing}; pass a decoder-only LM's config.json")
        heads = int(get("num_attention_heads"))
        return cls(hidden=int(get("hidden_size")), layers=int(get("num_hidden_layers")), vocab=int(get("vocab_size")),
                   intermediate=int(get("intermediate_size")), heads=heads,
                   kv_heads=int(get("num_key_value_heads") or heads),
                   head_dim=int(get("head_dim") or int(get("hidden_size")) // heads),
                   tied=bool(get("tie_word_embeddings", False)))

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """P_l: q, k, v, o projections, q/k norms, two RMSNorms, the SwiGLU MLP (no biases)."""
        h = self.hidden
        return h * self.q + 2 * h * self.kv + self.q * h + 2 * self.head_dim + 2 * h + 3 * h * self.intermediate

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def actor_params(self) -> int:
        """P of the causal LM: layers, input embedding, final norm, LM head unless tied."""
        return self.layers * self.layer_params + self.embed_params * (1 if self.tied else 2) + self.hidden

    @property
    def critic_params(self) -> int:
        """P of the value model: the backbone (no LM head) + a scalar head (h + 1)."""
        return self.layers * self.layer_params + self.embed_params + self.hidden + self.hidden + 1

    def act_elems(self) -> int:
        """a: elements saved for backward per token per layer (module docstring)."""
        return 4 * self.hidden + 2 * self.q + 2 * self.kv + 4 * self.intermediate


KNOWN_SHAPES: dict[str, ModelShape] = {
    # Copied from each repository's config.json on the Hugging Face hub (no download at run time).
    "Qwen/Qwen3-32B": ModelShape(5120, 64, 151936, 25600, 64, 8, 128, False),
    "Qwen/Qwen3-8B": ModelShape(4096, 36, 151936, 12288, 32, 8, 128, False),
    "Qwen/Qwen3-0.6B": ModelShape(1024, 28, 151936, 3072, 16, 8, 128, True),
}


@dataclass
class ScaleConfig:
    """The hardware a run is planned for (the ``scale:`` section of a run config)."""

    gpus: int = 0
    """G: GPUs that shard actor and critic (0: the world size at run time)."""
    gpu_mem_gib: float = 0.0
    """Memory of one GPU in GiB (0: no plan, no check; the CPU presets leave it at 0)."""
    reserve_gib: float = 6.0
    """Per-GPU memory kept out of the plan: CUDA context, NCCL buffers, fragmentation."""
    seq_len: int = 4096
    """s: tokens of the longest episode a micro-batch holds (prompt + all turns)."""
    micro_batch: int = 1
    """b: sequences per GPU per forward/backward (RPR: minibatch_size / grad_accum / G)."""
    activation_checkpointing: bool = True
    """Recompute each decoder layer in backward (keeps only layer inputs)."""
    lora: bool = False
    """Actor trained through LoRA adapters (frozen bf16 base)."""
    kl_reference: bool = False
    """A frozen reference copy of the actor (kl_coef > 0 without LoRA)."""
    peak_tflops: float = 989.0
    """Dense bf16 peak of one GPU in TFLOP/s (H100 SXM: 989)."""
    mfu: float = 0.35
    """Model FLOP utilisation assumed for the step-time estimate."""
    tokens_per_step: int = 0
    """T: tokens trained on per RPR step (0: episodes_per_step x seq_len, set by the caller)."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""

    def __post_init__(self) -> None:
        for name in ("gpus", "tokens_per_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"scale.{name}={getattr(self, name)}: must be >= 0")
        for name in ("seq_len", "micro_batch", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"scale.{name}={getattr(self, name)}: must be >= 1")
        if self.gpu_mem_gib < 0 or self.reserve_gib < 0:
            raise ValueError("scale.gpu_mem_gib and scale.reserve_gib must be >= 0 (0 GiB: no plan)")
        if self.gpu_mem_gib and self.reserve_gib >= self.gpu_mem_gib:
            raise ValueError(f"scale.reserve_gib={self.reserve_gib} leaves nothing of gpu_mem_gib={self.gpu_mem_gib}")
        if not 0 < self.mfu <= 1 or self.peak_tflops <= 0:
            raise ValueError(f"scale.mfu={self.mfu} must be in (0, 1] and peak_tflops={self.peak_tflops} > 0")


@dataclass
class ModelMemory:
    """Bytes per GPU of one model, by kind."""

    states: float
    gathered: float
    activations: float
    logits: float

    @property
    def total(self) -> float:
        return self.states + self.gathered + self.activations + self.logits


@dataclass
class Plan:
    """What ``plan`` computed; ``table()`` prints it."""

    shape: ModelShape
    scale: ScaleConfig
    gpus: int
    actor: ModelMemory
    critic: ModelMemory
    reference: float
    activations_no_ckpt: float
    """Actor + critic activations without checkpointing (for the table's comparison)."""
    activations_ckpt: float
    flops: float
    step_seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.actor.total + self.critic.total + self.reference

    @property
    def budget(self) -> float:
        return (self.scale.gpu_mem_gib - self.scale.reserve_gib) * GIB

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def table(self) -> str:
        s, g = self.scale, lambda x: f"{x / GIB:8.2f}"
        rows = [("", "actor", "critic"),
                ("params (B)", f"{self.shape.actor_params / 1e9:8.2f}", f"{self.shape.critic_params / 1e9:8.2f}"),
                ("states (params, grads, Adam) GiB", g(self.actor.states), g(self.critic.states)),
                ("all-gathered units GiB", g(self.actor.gathered), g(self.critic.gathered)),
                (f"activations GiB ({'with' if s.activation_checkpointing else 'without'} checkpointing)",
                 g(self.actor.activations), g(self.critic.activations)),
                ("logits GiB", g(self.actor.logits), g(self.critic.logits)),
                ("total GiB", g(self.actor.total), g(self.critic.total))]
        w = max(len(r[0]) for r in rows)
        out = [f"{r[0]:<{w}}  {r[1]:>8}  {r[2]:>8}" for r in rows]
        out += [f"reference policy GiB: {self.reference / GIB:.2f}",
                f"activations, actor + critic: {self.activations_no_ckpt / GIB:.2f} GiB without checkpointing, "
                f"{self.activations_ckpt / GIB:.2f} GiB with",
                f"per GPU: {self.total / GIB:.2f} GiB of {s.gpu_mem_gib:g} GiB ({s.reserve_gib:g} GiB reserved) -> "
                f"{'FITS' if self.fits else 'DOES NOT FIT'}",
                f"RPR step on {self.scale.tokens_per_step} tokens: {self.flops / 1e15:.1f} PFLOP, "
                f"~{self.step_seconds:.1f} s on {self.gpus} GPUs at {s.mfu:.0%} of {s.peak_tflops:g} TFLOP/s"]
        return "\n".join(out + self.notes)


def _model_memory(shape: ModelShape, params: int, gpus: int, tokens: int, ckpt: bool, frozen_bf16: bool,
                  logits: bool) -> ModelMemory:
    states = (2 if frozen_bf16 else 16) * params / gpus
    root = params - shape.layers * shape.layer_params
    gathered = 2 * (2 * shape.layer_params + root) + (0 if frozen_bf16 else 4 * shape.layer_params)
    a = shape.act_elems()
    acts = 2 * tokens * (shape.layers * shape.hidden + a) if ckpt else 2 * tokens * shape.layers * a
    return ModelMemory(states, gathered, acts, ACTOR_LOGIT_BYTES * tokens * shape.vocab if logits else 0.0)


def forward_flops_per_token(shape: ModelShape, critic: bool, seq_len: int) -> float:
    """2 P_mm + 2 L q s (module docstring)."""
    p_mm = (shape.critic_params - shape.embed_params) if critic else (
        shape.actor_params - (0 if shape.tied else shape.embed_params))
    return 2 * p_mm + 2 * shape.layers * shape.q * seq_len


def plan(shape: ModelShape, scale: ScaleConfig, gpus: int | None = None) -> Plan:
    """Memory per GPU and step time of one RPR step (module docstring); ``gpus`` overrides scale.gpus."""
    G = gpus or scale.gpus
    if G < 1:
        raise ValueError("plan: set scale.gpus (or run under torchrun, where it is the world size)")
    n = scale.micro_batch * scale.seq_len
    ck = scale.activation_checkpointing
    actor = _model_memory(shape, shape.actor_params, G, n, ck, scale.lora, logits=True)
    critic = _model_memory(shape, shape.critic_params, G, n, ck, False, logits=False)
    reference = 2 * shape.actor_params / G if scale.kl_reference and not scale.lora else 0.0
    both = lambda c: sum(_model_memory(shape, p, G, n, c, False, False).activations  # noqa: E731
                         for p in (shape.actor_params, shape.critic_params))
    T = scale.tokens_per_step
    passes = 1 + scale.ppo_epochs * (3 + int(ck))
    f_actor = forward_flops_per_token(shape, False, scale.seq_len)
    flops = T * (f_actor + forward_flops_per_token(shape, True, scale.seq_len)) * passes
    if scale.kl_reference:
        flops += T * f_actor
    seconds = flops / (G * scale.peak_tflops * 1e12 * scale.mfu)
    return Plan(shape, scale, G, actor, critic, reference, both(False), both(True), flops, seconds)


def fit_error(p: Plan) -> str:
    """The refusal message of a plan that does not fit, with the fixes in the order to try."""
    return (f"the planner says this config does not fit: {p.total / GIB:.1f} GiB per GPU needed, "
            f"{p.budget / GIB:.1f} GiB usable.\n{p.table()}\n"
            "Fix: set scale.activation_checkpointing=true, lower scale.micro_batch (raise the RPR grad_accum), "
            "add GPUs (scale.gpus), or train LoRA adapters (scale.lora=true with lora.enabled=true); "
            "`minirsi plan --config FILE` shows the effect of each.")


def shape_of(model: str, model_config: str | None = None) -> ModelShape:
    """A model's shape: an explicit config.json, a checkpoint dir's, or ``KNOWN_SHAPES``."""
    path = Path(model_config) if model_config else Path(model) / "config.json"
    if path.is_file():
        return ModelShape.from_config(json.loads(path.read_text()))
    if model in KNOWN_SHAPES:
        return KNOWN_SHAPES[model]
    raise ValueError(f"plan: no shape for {model!r}: pass --model-config PATH/config.json "
                     f"(or one of {sorted(KNOWN_SHAPES)})")


def cli(argv: Sequence[str] | None = None, command: str = "plan") -> int:
    p = argparse.ArgumentParser(prog=f"minirsi {command}", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="a run config YAML: its base.model and scale: section")
    p.add_argument("--model", help="Hugging Face id (see KNOWN_SHAPES) or checkpoint dir")
    p.add_argument("--model-config", help="a config.json giving the model's shape")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    for f in ScaleConfig.__dataclass_fields__.values():
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, default=None, type=lambda s: s.lower() in ("1", "true", "yes"), metavar="BOOL")
        else:
            p.add_argument(flag, default=None, type=float if f.type in ("float", float) else int)
    args = p.parse_args(argv)
    scale_dict: dict[str, Any] = {}
    model, episodes = args.model, 1
    if args.config:
        import yaml

        data = yaml.safe_load(Path(args.config).read_text()) or {}
        scale_dict = dict(data.get("scale") or {})
        model = model or (data.get("base") or {}).get("model")
        rpr = data.get("rpr1") or {}
        scale_dict.setdefault("ppo_epochs", rpr.get("ppo_epochs", 1))
        episodes = int(rpr.get("episodes_per_step", 1))
    for k in ScaleConfig.__dataclass_fields__:
        if getattr(args, k) is not None:
            scale_dict[k] = getattr(args, k)
    try:
        scale = ScaleConfig(**scale_dict)
        if not model:
            raise ValueError("plan: name the model (--model or base.model in --config)")
        if not scale.gpu_mem_gib:
            raise ValueError("plan: set --gpu-mem-gib (or scale.gpu_mem_gib in the config)")
        if not scale.tokens_per_step:
            scale.tokens_per_step = scale.seq_len * episodes  # every episode at the full length: an upper bound
        result = plan(shape_of(model, args.model_config), scale)
    except (ValueError, TypeError, OSError) as e:
        print(f"minirsi {command}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": model, "scale": asdict(scale), "fits": result.fits,
                          "per_gpu_gib": result.total / GIB, "actor_gib": result.actor.total / GIB,
                          "critic_gib": result.critic.total / GIB, "step_seconds": result.step_seconds}, indent=2))
    else:
        print(f"{model} on {result.gpus} GPUs x {scale.gpu_mem_gib:g} GiB, micro-batch {scale.micro_batch} x "
              f"{scale.seq_len} tokens\n{result.table()}")
    return 0 if result.fits else 1

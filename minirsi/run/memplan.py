"""The planner: will every pass of a run fit on given GPUs, and how long will an RPR step take?

``minirsi plan`` answers, before anything is loaded, for the FSDP2 layout of minirsi.core.distributed:
actor and critic each sharded over all ``G`` GPUs (every parameter, gradient and Adam moment
split G ways), layers in bf16, output heads in fp32 (``distributed.fsdp2``), the two models
trained in turn within each micro-batch (``rpr.ppo_update``).

Memory per GPU, in bytes, of one model with ``P`` parameters (``L`` layers of ``P_l`` each,
hidden ``h``, query width ``q = heads * head_dim``, key/value width ``k``, MLP width ``I``,
vocabulary ``V``, LM head ``P_v = V h``), a micro-batch of ``b`` sequences of ``s`` tokens
(``n = b s``)::

    states       full fine-tuning: 16 P / G     fp32 params 4 + fp32 grads 4 + Adam m, v 8
                 frozen (LoRA base, reference, warm-up's actor): 4 P / G   fp32 shards, no grads
    gathered     2 * 2 P_l                      bf16: the layer in use and the prefetched one
                 + 2 P_root + 4 P_v             root unit (embedding, final norm) in bf16, the
                                                untied LM head in fp32 (an fp32 unit of its own)
                 tied head: + 4 P_root          the root unit (embedding = head) in fp32 instead
                 + (g + r) P_u                  trainable: the largest unit's unsharded gradient
                                                (g: its compute bytes) and its reduce-scatter
                                                input (r: 4, or 2 with reduce_dtype bfloat16)
    deferred     4 P_trainable                  defer_grad_sync: every unit's unsharded fp32
                                                gradient, held until the minibatch's last micro-batch
    activations  2 n L a                        bf16, a = 4h + 2q + 2k + 4I saved elements per
                                                token per layer (norm in/out, q, k, v, attention
                                                out; norm in/out, gate, up, silu(gate), product)
                 with checkpointing: 2 n (L h + a)   layer inputs + one layer recomputed
    no-grad      2 n (h + a)                    a forward without grad holds one layer's tensors
                                                and the residual stream at a time

The logits of the actor (``V`` entries a token) are charged per pass as ``bench/logits.py``
measured the code (peak bytes per token, or per chunk position, per vocabulary entry; T = 2048,
V = 32768, c = 512, fp32 head; ``LOGIT_BYTES``)::

    pass                   whole sequence (logit_chunk 0)     chunked (logit_chunk c, minirsi.core.scoring)
    scoring, no grad       12 n V   head output, /tau, log-softmax     8 b c V + 4 n h
    PPO update (+backward) 24 n V   + entropy, and their gradients    16 b c V (20 with the entropy
                                                                      in the loss) + 8 n h
    SFT (+backward)        12 n V   head output, log-softmax, grad     12 b c V + 8 n h

(chunked: one piece of c positions at a time, plus the fp32 hidden states the head reads and,
with gradients, theirs.)

Every pass that runs is planned, each on top of what its stage holds resident::

    RPR update      states(actor, critic, ref) + max over the models of gathered + activations(n)
                    [+ logits(update)]: rpr.ppo_update backpropagates the actor, then the critic
    RPR scoring     states(actor, critic, ref) + max over the models of gathered + no-grad(n_s) [+ logits(scoring)]
                    with n_s = min(forward_chunk, episodes / G) x s: a GPU's rows of the no-grad
                    passes (logp_old, V_old, the reference), that many at a time
    RSR SFT         states(actor) + gathered(actor) + activations(actor, n) + logits(SFT)
    warm-up update  states(critic) + gathered(critic) + activations(critic, n)
    warm-up values  states(critic) + gathered(critic) + no-grad(warmup rows x s)

A config fits when the largest pass plus ``reserve_gib`` (CUDA context, NCCL buffers) leaves
a margin of at least ``margin`` x ``gpu_mem_gib`` free (10% by default): allocator
fragmentation and what a formula misses have to fit in it.

Step time, from FLOPs at a stated utilisation (``mfu`` of ``peak_tflops`` per GPU). A forward
pass costs per token ``2 P_mm + 2 L q s`` (matmul parameters ``P_mm``: every parameter but an
untied input embedding; causal attention scores and values, each token seeing s/2 positions
on average). One RPR step on ``T`` tokens runs, per model, one no-grad forward (logp_old, V_old;
another for the reference) then ``ppo_epochs`` x (forward + backward = 3 forwards, +1 with
checkpointing)::

    FLOPs = sum over actor, critic of  T fwd (1 + ppo_epochs (3 + ckpt))  [+ T fwd_actor for the reference]
    time  = FLOPs / (G peak_tflops 1e12 mfu)

and the communication FSDP2 adds, at ``net_gbps`` per GPU (ring collectives: each GPU sends
(G-1)/G of a collective's bytes): per model and micro-batch, the bf16 weights gathered for
forward and again for backward (2 x 2 P, fp32 units 4 P) and the gradients reduce-scattered
(4 P, or 2 P in bf16; with defer_grad_sync once per minibatch instead of per micro-batch); per
no-grad pass one gather. FSDP2 overlaps it with compute (the next layer is gathered while one
runs), so it is printed beside the compute time, not added to it.

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
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

GIB = 1024 ** 3
LOGIT_BYTES = {
    # (pass, chunked) -> peak bytes per (token, or chunk position) x vocabulary entry, measured by
    # `python bench/logits.py` (module docstring); the hidden-state terms come on top
    ("scoring", False): 12, ("scoring", True): 8,
    ("update", False): 24, ("update", True): 16,
    ("sft", False): 12, ("sft", True): 12,
}
ENTROPY_GRAD_BYTES = 4
"""Extra bytes per chunk position x vocabulary entry of a chunked update when the entropy is a
loss term (``entropy_coef > 0``: ``bench/logits.py --entropy-grad``; the whole-sequence update
measured the same 24 either way)."""


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
    """The hardware a run is planned for (the ``scale:`` section of a run config), and the FSDP2
    settings a sharded run uses (``distributed.init`` reads them, whatever the launcher)."""

    gpus: int = 0
    """G: GPUs that shard actor and critic (0: the world size at run time)."""
    gpu_mem_gib: float = 0.0
    """Memory of one GPU in GiB (0: no plan, no check; the CPU presets leave it at 0)."""
    reserve_gib: float = 6.0
    """Per-GPU memory kept out of the plan: CUDA context, NCCL buffers."""
    margin: float = 0.10
    """Share of ``gpu_mem_gib`` that must stay free beyond the plan and the reserve (allocator
    fragmentation, what the formulas miss); a plan that leaves less does not fit."""
    seq_len: int = 4096
    """s: tokens of the longest episode a micro-batch holds (prompt + all turns)."""
    micro_batch: int = 1
    """b: sequences per GPU per forward/backward (RPR: minibatch_size / grad_accum / G)."""
    activation_checkpointing: bool = True
    """Recompute each decoder layer in backward (keeps only layer inputs). Also what a sharded
    run does: ``distributed.init`` takes it from here under torchrun and accelerate alike."""
    reduce_dtype: str = "float32"
    """dtype of the gradient reduce-scatter on GPUs: "float32" (torchtitan's and verl's default)
    or "bfloat16" (half the bytes; the reduced shards still accumulate in fp32)."""
    defer_grad_sync: bool = False
    """Reduce-scatter once per minibatch instead of after every micro-batch (FSDP2
    ``set_requires_gradient_sync``): every unit's unsharded fp32 gradient stays until the last
    micro-batch (4 P per GPU: for LoRA only the adapters; for a 32B full fine-tune 131 GB,
    which no GPU has, so ZeRO-3 reduces per micro-batch)."""
    lora: bool = False
    """Actor trained through LoRA adapters (frozen base)."""
    kl_reference: bool = False
    """A frozen reference copy of the actor (kl_coef > 0 without LoRA)."""
    peak_tflops: float = 989.0
    """Dense bf16 peak of one GPU in TFLOP/s (H100 SXM: 989)."""
    mfu: float = 0.35
    """Model FLOP utilisation assumed for the step-time estimate."""
    net_gbps: float = 400.0
    """Per-GPU network bandwidth for the communication estimate, Gb/s (one 400G NIC per GPU)."""
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
        if not 0 <= self.margin < 1:
            raise ValueError(f"scale.margin={self.margin}: a share of the GPU's memory in [0, 1), e.g. 0.1")
        if not 0 < self.mfu <= 1 or self.peak_tflops <= 0 or self.net_gbps <= 0:
            raise ValueError(f"scale.mfu={self.mfu} must be in (0, 1], peak_tflops={self.peak_tflops} and "
                             f"net_gbps={self.net_gbps} > 0")
        if self.reduce_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"scale.reduce_dtype={self.reduce_dtype!r}: use 'float32' or 'bfloat16'")


@dataclass(frozen=True)
class Passes:
    """How the run's passes are cut, from its RPR / RSR / warm-up configs (``passes_of``)."""

    forward_chunk: int = 1
    """Sequences per no-grad scoring pass (``rpr*.forward_chunk``); a GPU scores at most its
    share of the step's episodes at once."""
    episodes: int = 0
    """Episodes per RPR step (``rpr*.episodes_per_step``; 0: no bound from it)."""
    logit_chunk: int = 0
    """Positions per logits piece of the PPO passes (``rpr*.logit_chunk``; 0: whole)."""
    sft_logit_chunk: int = 0
    """The same for RSR's SFT loss (``rsr*.logit_chunk``)."""
    entropy_grad: bool = False
    """The entropy is a loss term (``entropy_coef > 0``)."""
    warmup_rows: int = 1
    """Sequences per no-grad pass of the critic warm-up (its V_old)."""
    grad_accum: int = 1
    """Micro-batches per PPO minibatch (``rpr*.grad_accum``): how often a deferred sync reduces."""


def passes_of(run: Any) -> Passes:
    """``Passes`` of a run config (a ``RunConfig`` or its YAML as a dict): the larger of the
    two RPR stages' settings, each from its own section."""
    get = (lambda sec, k, d: (run.get(sec) or {}).get(k, d)) if isinstance(run, dict) else \
        (lambda sec, k, d: getattr(getattr(run, sec), k, d))
    chunk = lambda sec: get(sec, "logit_chunk", 0)  # noqa: E731
    logit = [chunk(s) for s in ("rpr1", "rpr2")]
    sft = [chunk(s) for s in ("rsr1", "rsr2")]
    wmb, wacc, wchunk = get("warmup", "minibatch_size", 8), get("warmup", "grad_accum", 1), get("warmup", "forward_chunk", 0)
    return Passes(forward_chunk=max(get(s, "forward_chunk", 8) for s in ("rpr1", "rpr2")),
                  episodes=max(get(s, "episodes_per_step", 16) for s in ("rpr1", "rpr2")),
                  logit_chunk=0 if 0 in logit else max(logit), sft_logit_chunk=0 if 0 in sft else max(sft),
                  entropy_grad=any(get(s, "entropy_coef", 0.0) > 0 for s in ("rpr1", "rpr2")),
                  warmup_rows=wchunk or -(-wmb // wacc), grad_accum=max(get(s, "grad_accum", 1) for s in ("rpr1", "rpr2")))


@dataclass
class ModelMemory:
    """Bytes per GPU of one model, by kind (``logits``: those of the PPO update pass)."""

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
    passes: Passes
    gpus: int
    actor: ModelMemory
    critic: ModelMemory
    reference: float
    deferred: float
    """Unsharded gradients kept by defer_grad_sync (actor + critic)."""
    by_pass: dict[str, float]
    """Peak bytes per GPU of each pass, resident states included."""
    activations_no_ckpt: float
    """Actor + critic activations without checkpointing (for the table's comparison)."""
    activations_ckpt: float
    flops: float
    step_seconds: float
    comm_seconds: float
    scoring_rows: int = 1
    """Sequences a GPU scores per no-grad pass: min(forward_chunk, its share of the episodes)."""
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        """The largest pass: what a GPU must hold."""
        return max(self.by_pass.values())

    @property
    def budget(self) -> float:
        """Bytes a plan may use: the GPU less the reserve and the margin."""
        return (self.scale.gpu_mem_gib * (1 - self.scale.margin) - self.scale.reserve_gib) * GIB

    @property
    def margin_left(self) -> float:
        """Bytes left free on the GPU beyond the plan and the reserve."""
        return (self.scale.gpu_mem_gib - self.scale.reserve_gib) * GIB - self.total

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def table(self) -> str:
        s, g = self.scale, lambda x: f"{x / GIB:8.2f}"
        rows = [("", "actor", "critic"),
                ("params (B)", f"{self.shape.actor_params / 1e9:8.2f}", f"{self.shape.critic_params / 1e9:8.2f}"),
                ("states (params, grads, Adam) GiB", g(self.actor.states), g(self.critic.states)),
                ("all-gathered units + a unit's grads GiB", g(self.actor.gathered), g(self.critic.gathered)),
                (f"activations GiB ({'with' if s.activation_checkpointing else 'without'} checkpointing)",
                 g(self.actor.activations), g(self.critic.activations)),
                ("logits of the update GiB", g(self.actor.logits), g(self.critic.logits)),
                ("total in the update GiB", g(self.actor.total), g(self.critic.total))]
        w = max(len(r[0]) for r in rows)
        out = [f"{r[0]:<{w}}  {r[1]:>8}  {r[2]:>8}" for r in rows]
        out += [f"reference policy GiB: {self.reference / GIB:.2f}; deferred gradients GiB: {self.deferred / GIB:.2f}",
                f"activations, actor + critic: {self.activations_no_ckpt / GIB:.2f} GiB without checkpointing, "
                f"{self.activations_ckpt / GIB:.2f} GiB with",
                "per pass, GiB per GPU (resident states included):"]
        out += [f"  {name:<{w - 2}}  {b / GIB:8.2f}" for name, b in self.by_pass.items()]
        left = self.margin_left
        out += [f"per GPU: {self.total / GIB:.2f} GiB of {s.gpu_mem_gib:g} GiB ({s.reserve_gib:g} GiB reserved), "
                f"{left / GIB:.2f} GiB left = {left / GIB / s.gpu_mem_gib:.1%} of the GPU (at least {s.margin:.0%}) -> "
                f"{'FITS' if self.fits else 'DOES NOT FIT'}",
                f"RPR step on {self.scale.tokens_per_step} tokens: {self.flops / 1e15:.1f} PFLOP, "
                f"~{self.step_seconds:.1f} s on {self.gpus} GPUs at {s.mfu:.0%} of {s.peak_tflops:g} TFLOP/s; "
                f"FSDP communication ~{self.comm_seconds:.1f} s at {s.net_gbps:g} Gb/s per GPU (overlapped with compute)"]
        return "\n".join(out + self.notes)


def _units(shape: ModelShape, critic: bool) -> tuple[int, int, bool]:
    """(P_root, P_head, tied): the root unit's parameters (embedding, final norm, a tied head)
    and the separate fp32 head's (0 when tied; the critic's value head: h + 1)."""
    if critic:
        return shape.embed_params + shape.hidden, shape.hidden + 1, False
    if shape.tied:
        return shape.embed_params + shape.hidden, 0, True
    return shape.embed_params + shape.hidden, shape.embed_params, False


def _model_memory(shape: ModelShape, critic: bool, gpus: int, tokens: int, ckpt: bool, frozen: bool,
                  reduce_bytes: int, logits: float) -> ModelMemory:
    params = shape.critic_params if critic else shape.actor_params
    states = (4 if frozen else 16) * params / gpus
    root, head, tied = _units(shape, critic)
    gathered = 2 * 2 * shape.layer_params + (4 * root if tied else 2 * root + 4 * head)
    if not frozen:  # the largest unit's unsharded gradient (in its compute dtype) and its reduce-scatter input
        gathered += max((2 + reduce_bytes) * shape.layer_params, (4 if tied else 2 + reduce_bytes) * root,
                        (4 + 4) * head)
    a = shape.act_elems()
    acts = 2 * tokens * (shape.layers * shape.hidden + a) if ckpt else 2 * tokens * shape.layers * a
    return ModelMemory(states, gathered, acts, logits)


def logit_bytes(shape: ModelShape, kind: str, rows: int, seq_len: int, chunk: int, entropy_grad: bool = False) -> float:
    """Bytes the actor's logits take in a pass of ``rows`` sequences of ``seq_len`` tokens
    (``LOGIT_BYTES``, module docstring)."""
    n, V, h = rows * seq_len, shape.vocab, shape.hidden
    if chunk:
        per = LOGIT_BYTES[(kind, True)] + (ENTROPY_GRAD_BYTES if kind == "update" and entropy_grad else 0)
        return per * rows * min(chunk, seq_len) * V + (4 if kind == "scoring" else 8) * n * h
    return LOGIT_BYTES[(kind, False)] * n * V


def forward_flops_per_token(shape: ModelShape, critic: bool, seq_len: int) -> float:
    """2 P_mm + 2 L q s (module docstring)."""
    p_mm = (shape.critic_params - shape.embed_params) if critic else (
        shape.actor_params - (0 if shape.tied else shape.embed_params))
    return 2 * p_mm + 2 * shape.layers * shape.q * seq_len


def plan(shape: ModelShape, scale: ScaleConfig, gpus: int | None = None, passes: Passes | None = None) -> Plan:
    """Memory per GPU of every pass and the time of one RPR step (module docstring); ``gpus``
    overrides scale.gpus, ``passes`` (default ``Passes()``) says how the passes are cut."""
    G = gpus or scale.gpus
    if G < 1:
        raise ValueError("plan: set scale.gpus (or run under torchrun, where it is the world size)")
    ps = passes or Passes()
    b, s = scale.micro_batch, scale.seq_len
    rows = min(ps.forward_chunk, -(-ps.episodes // G)) if ps.episodes else ps.forward_chunk  # a GPU's rows per pass
    n, n_s, ck = b * s, rows * s, scale.activation_checkpointing
    rb = 4 if scale.reduce_dtype == "float32" else 2
    upd = logit_bytes(shape, "update", b, s, ps.logit_chunk, ps.entropy_grad)
    actor = _model_memory(shape, False, G, n, ck, scale.lora, rb, upd)
    critic = _model_memory(shape, True, G, n, ck, False, rb, 0.0)
    reference = 4 * shape.actor_params / G if scale.kl_reference and not scale.lora else 0.0
    trainable_actor = 0 if scale.lora else shape.actor_params  # LoRA adapters: < 1%, not counted
    deferred_actor = 4 * trainable_actor if scale.defer_grad_sync else 0.0
    deferred_critic = 4 * shape.critic_params if scale.defer_grad_sync else 0.0
    nograd = lambda rows: 2 * rows * s * (shape.hidden + shape.act_elems())  # noqa: E731
    resident = actor.states + critic.states + reference
    sft = logit_bytes(shape, "sft", b, s, ps.sft_logit_chunk)
    by_pass = {
        "RPR update micro-batch": resident + deferred_actor + deferred_critic
                                  + max(actor.gathered + actor.activations + upd, critic.gathered + critic.activations),
        "RPR no-grad scoring pass": resident + max(
            actor.gathered + nograd(rows) + logit_bytes(shape, "scoring", rows, s, ps.logit_chunk),
            critic.gathered + nograd(rows)),
        "RSR SFT step": actor.states + actor.gathered + actor.activations + sft,
        "critic warm-up update": critic.states + critic.gathered + critic.activations + deferred_critic,
        "critic warm-up values": critic.states + critic.gathered + nograd(ps.warmup_rows),
    }
    both = lambda c: sum(_model_memory(shape, cr, G, n, c, False, rb, 0.0).activations for cr in (False, True))  # noqa: E731
    T = scale.tokens_per_step
    f_actor = forward_flops_per_token(shape, False, s)
    flops = T * (f_actor + forward_flops_per_token(shape, True, s)) * (1 + scale.ppo_epochs * (3 + int(ck)))
    if scale.kl_reference:
        flops += T * f_actor
    seconds = flops / (G * scale.peak_tflops * 1e12 * scale.mfu)
    comm = _comm_bytes(shape, scale, ps, G, n, n_s) * (G - 1) / G / (scale.net_gbps / 8 * 1e9)
    return Plan(shape, scale, ps, G, actor, critic, reference, deferred_actor + deferred_critic, by_pass,
                both(False), both(True), flops, seconds, comm, rows)


def _comm_bytes(shape: ModelShape, scale: ScaleConfig, ps: Passes, G: int, n: int, n_s: int) -> float:
    """Bytes one GPU's FSDP collectives move in one RPR step (module docstring)."""
    T = scale.tokens_per_step
    micro = math.ceil(T / (G * n)) if T else 0  # micro-batches per GPU per epoch
    per_minibatch = math.ceil(micro / ps.grad_accum)  # minibatches per epoch: a deferred sync reduces once each
    total = 0.0
    for params, trainable in ((shape.actor_params, not scale.lora), (shape.critic_params, True)):
        gather = 2 * 2 * params  # bf16, forward and again for backward
        reduce = (4 if scale.reduce_dtype == "float32" else 2) * params if trainable else 0
        reduces = per_minibatch if scale.defer_grad_sync else micro
        total += scale.ppo_epochs * (micro * gather + reduces * reduce)
        total += math.ceil(T / (G * n_s)) * 2 * params if T else 0  # the no-grad passes: one gather each
    return total


def fit_error(p: Plan) -> str:
    """The refusal message of a plan that does not fit, with the fixes in the order to try."""
    worst = max(p.by_pass, key=p.by_pass.get)
    return (f"the planner says this config does not fit: {p.total / GIB:.1f} GiB per GPU needed ({worst}), "
            f"{p.budget / GIB:.1f} GiB usable (the GPU less scale.reserve_gib and a margin of "
            f"{p.scale.margin:.0%}).\n{p.table()}\n"
            "Fix: set scale.activation_checkpointing=true, set rpr1/rpr2.logit_chunk (and rsr1/rsr2.logit_chunk) "
            "to 1024, lower rpr*.forward_chunk, lower scale.micro_batch (raise the RPR grad_accum), add GPUs "
            "(scale.gpus), or train LoRA adapters (scale.lora=true with lora.enabled=true); "
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
        elif f.type in ("str", str):
            p.add_argument(flag, default=None)
        else:
            p.add_argument(flag, default=None, type=float if f.type in ("float", float) else int)
    args = p.parse_args(argv)
    scale_dict: dict[str, Any] = {}
    model, episodes, passes = args.model, 1, Passes()
    if args.config:
        import yaml

        data = yaml.safe_load(Path(args.config).read_text()) or {}
        scale_dict = dict(data.get("scale") or {})
        model = model or (data.get("base") or {}).get("model")
        rpr = data.get("rpr1") or {}
        scale_dict.setdefault("ppo_epochs", rpr.get("ppo_epochs", 1))
        episodes = int(rpr.get("episodes_per_step", 1))
        passes = passes_of(data)
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
        result = plan(shape_of(model, args.model_config), scale, passes=passes)
    except (ValueError, TypeError, OSError) as e:
        print(f"minirsi {command}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": model, "scale": asdict(scale), "passes": asdict(passes), "fits": result.fits,
                          "per_gpu_gib": result.total / GIB, "margin_gib": result.margin_left / GIB,
                          "by_pass_gib": {k: v / GIB for k, v in result.by_pass.items()},
                          "actor_gib": result.actor.total / GIB, "critic_gib": result.critic.total / GIB,
                          "step_seconds": result.step_seconds, "comm_seconds": result.comm_seconds}, indent=2))
    else:
        print(f"{model} on {result.gpus} GPUs x {scale.gpu_mem_gib:g} GiB, micro-batch {scale.micro_batch} x "
              f"{scale.seq_len} tokens, no-grad passes of {result.scoring_rows} x {scale.seq_len} tokens, "
              f"logits {'in chunks of ' + str(passes.logit_chunk) if passes.logit_chunk else 'whole'}\n"
              f"{result.table()}")
    return 0 if result.fits else 1

"""The actor: a causal LM loaded by name or path, an offline tokenizer, and per-token log-probs.

docs/method.md section 3. The policy pi_theta is any Hugging Face causal LM; minirsi only ever
touches it through ``from_pretrained`` / ``save_pretrained`` and a forward pass, so the tiny
model trained on this CPU and a 27B checkpoint go through the same code:

    model, tok = load_actor("Qwen/Qwen3-8B")          # a hub name (when a hub is reachable)
    model, tok = load_actor("runs/toy/base")          # a directory written by save_actor
    model, tok = load_actor("runs/toy/base", lora=LoraSettings(r=8))

For this machine and for the tests there is a ``tiny`` preset: a Qwen3-architecture model of
about a million parameters (``tiny_config``) and a byte-level BPE tokenizer trained offline on
the pretraining corpus (``build_tokenizer``), with the ChatML special tokens and chat template
Qwen uses. Nothing here downloads anything.

The one piece of math is the per-token log-probability the trainer and the rollout tests need,

    logp[b, t] = log pi_theta(x_t | x_<t) = log_softmax(z[b, t-1] / tau)[x_t],   logp[b, 0] = 0,

where z are the logits and tau the sampling temperature (the sampler draws from
softmax(z / tau), so its log-probs and the trainer's must divide by the same tau).

Departures from the paper: the paper's actor is Qwen3-8B / 14B / 27B; here it is a model of
~1M parameters pretrained for a few minutes on synthetic shell sessions (``minirsi pretrain``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import torch
from tokenizers import Tokenizer, decoders, models as tk_models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from minirsi.core.actions import IM_END, IM_START
from minirsi.core.scoring import logprobs_from_logits

if TYPE_CHECKING:  # distributed imports nothing from here; a type hint only
    from minirsi.core.distributed import World

logger = logging.getLogger(__name__)

PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]  # ids 0, 1, 2 in a tokenizer built here

# ChatML, as Qwen writes it: every message is "<|im_start|>{role}\n{content}<|im_end|>\n",
# and the generation prompt is "<|im_start|>assistant\n". actions.render_* build exactly this
# text segment by segment, so the ids they produce decode to what this template prints.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer(corpus_texts: Sequence[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``corpus_texts`` (offline, a second or two).

    Byte level means every string is encodable (no unknown token): the 256 byte symbols are
    always in the vocabulary, and merges learned from the corpus shorten common shell words.
    ``<|endoftext|>`` (padding), ``<|im_start|>`` and ``<|im_end|>`` (end of a turn, the
    generation stop token) are special tokens: never split, never produced by merges.

    Args:
        corpus_texts: training text (rendered sessions); merges are learned from it.
        vocab_size: target vocabulary size, including the 256 bytes and the special tokens.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is below the 256 byte symbols + {len(SPECIAL_TOKENS)} "
            f"special tokens; use at least {256 + len(SPECIAL_TOKENS)}"
        )
    tok = Tokenizer(tk_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus_texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# tiny (~1.05M parameters): the smallest that still learns the toy families' command syntax in
# a few minutes of pretraining on 2 cores; small (~5.25M): for a longer budget only. A 2048
# vocabulary keeps the tied embedding at a quarter of the parameters while shell words stay 1-3
# tokens; GQA keeps the Qwen3 layout real models use; 4096 positions fit a prompt and 8 turns.
# `python -m minirsi.engine.models` prints sizes and timings (measured ones: docs/experiments.md,
# "Measurements behind the code's defaults").
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        max_position_embeddings=4096,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=768,
        max_position_embeddings=4096,
    ),
}


def tiny_config(tokenizer: PreTrainedTokenizerFast, preset: str = "tiny") -> Qwen3Config:
    """A Qwen3 config sized by ``preset`` ("tiny" or "small"), vocabulary from ``tokenizer``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset '{preset}'; use one of {sorted(PRESETS)}")
    return Qwen3Config(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        bos_token_id=None,
        use_cache=True,
        **PRESETS[preset],
    )


def build_tiny_actor(tokenizer: PreTrainedTokenizerFast, preset: str = "tiny", seed: int = 0) -> PreTrainedModel:
    """A freshly initialised Qwen3ForCausalLM of the given preset (deterministic in ``seed``)."""
    config = tiny_config(tokenizer, preset)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model


@dataclass
class LoraSettings:
    """A LoRA adapter on the actor (peft). W' = W + (alpha / r) * B A, only A and B train."""

    r: int = 8
    """Rank of the update B A."""
    alpha: int = 16
    """Scale numerator: the update is multiplied by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Linear layers that get an adapter (Qwen3 names)."""

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise ValueError(f"lora.r={self.r}: the rank must be a positive integer, e.g. 8")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout={self.dropout}: use a value in [0, 1)")
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty; name at least one linear layer, e.g. q_proj")


@dataclass
class LoraRecipe(LoraSettings):
    """LoRA as a recipe option (``lora.enabled=true``): every RSR and RPR stage trains adapters on
    a frozen actor, sharded like the full model; each stage's actor/ is still a full checkpoint."""

    enabled: bool = False
    """Train the actor through LoRA adapters (the critic stays fully trained)."""
    save_adapter: bool = False
    """Also write each stage's adapter alone to adapter/ (peft's format: small; what a LoRA
    hot-load into vLLM reads). actor/ always holds the merged weights, which the next stage
    starts from and any loader reads."""


def attach_lora(model: PreTrainedModel, lora: LoraSettings) -> PreTrainedModel:
    """Wrap ``model`` in a peft LoRA adapter; the base weights are frozen."""
    from peft import LoraConfig, get_peft_model  # imported here: only LoRA runs pay for it

    cfg = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, cfg)


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer of a hub name or a checkpoint directory, checked for what minirsi needs.

    Raises:
        ValueError: a local-looking path that does not exist, or a tokenizer with no chat
            template and no ``<|im_end|>`` token (minirsi's action format needs both).
    """
    p = Path(name_or_path)
    if (str(name_or_path).startswith((".", "/")) or p.exists()) and not (p / "config.json").exists():
        raise ValueError(
            f"load_actor: {name_or_path} has no config.json; pass a directory written by "
            f"`minirsi pretrain --out DIR` / save_actor, or a Hugging Face model name"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
    if tokenizer.convert_tokens_to_ids(IM_END) in (None, tokenizer.unk_token_id):
        raise ValueError(
            f"load_actor: the tokenizer of {name_or_path} has no {IM_END} token; minirsi's "
            f"ChatML action format needs it (Qwen-family tokenizers have it)"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = PAD_TOKEN if PAD_TOKEN in tokenizer.get_vocab() else tokenizer.eos_token
    return tokenizer


def load_actor(
    name_or_path: str | Path,
    lora: LoraSettings | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Load a causal LM and its tokenizer with ``from_pretrained`` (a hub name or a directory).

    Args:
        name_or_path: Hugging Face model name or a directory written by ``save_actor``.
        lora: when given, a fresh LoRA adapter is attached (base weights frozen).
        dtype: parameter dtype (fp32 on CPU; bf16 on GPUs).
        device: where the model lives.
    Raises:
        ValueError: see ``load_tokenizer``.
    """
    tokenizer = load_tokenizer(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(str(name_or_path), dtype=dtype)
    model.to(device)
    if lora is not None:
        model = attach_lora(model, lora)
    return model, tokenizer


def actor_skeleton(name_or_path: str | Path, lora: LoraSettings | None = None,
                   dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """``load_actor``'s model without its weights: the architecture from ``config.json`` alone.
    Under ``torch.device("meta")`` (as ``World.load_sharded`` calls it) it takes no memory."""
    config = AutoConfig.from_pretrained(str(name_or_path))
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return attach_lora(model, lora) if lora is not None else model


def load_actor_sharded(
    name_or_path: str | Path,
    world: "World",
    lora: LoraSettings | None = None,
    device: str | torch.device = "cpu",
    keep_unsharded: bool = True,
    frozen: bool = False,
) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """``load_actor`` sharded over ``world`` (``World.load_sharded``): rank 0 reads the
    checkpoint, every other rank builds ``actor_skeleton`` on the meta device and receives its
    shards. At world size 1, ``load_actor(name_or_path, lora, device=device)`` itself.

    Args:
        keep_unsharded: rank 0 keeps the loaded model as its plain copy for in-process sampling;
            False when servers sample (a full-weight push gathers to rank 0 for each push).
        frozen: eval mode, no gradients (a KL reference).
    """
    if world.size == 1:
        model, tokenizer = load_actor(name_or_path, lora=lora, device=device)
        return (model.eval().requires_grad_(False) if frozen else model), tokenizer
    tokenizer = load_tokenizer(name_or_path)  # every rank tokenises

    def freeze(model: torch.nn.Module) -> torch.nn.Module:
        return model.eval().requires_grad_(False) if frozen else model

    model = world.load_sharded(lambda: freeze(load_actor(name_or_path, lora=lora)[0]),
                               lambda: freeze(actor_skeleton(name_or_path, lora)), keep_unsharded=keep_unsharded)
    return model, tokenizer


def save_actor(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: str | Path, merge_lora: bool = True
) -> Path:
    """Write model and tokenizer with ``save_pretrained`` so ``load_actor(out_dir)`` reads them.

    A LoRA-wrapped model is merged into a copy of its base weights before saving (``merge_lora``,
    the default), so the directory is a plain checkpoint any loader (vLLM included) can read; the
    copy costs one model's memory, which is nothing for the tiny model and a choice at scale.
    With ``merge_lora=False`` only the adapter is written (peft's ``adapter_config.json``);
    loading that directory needs the base model it was trained on.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    to_save = model
    if hasattr(model, "merge_and_unload") and merge_lora:
        to_save = copy.deepcopy(model).merge_and_unload()  # deepcopy: keep the live adapter
    to_save.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain (Hugging Face) state dict of a peft LoRA model with its active adapters merged,
    ``W' = W + (alpha / r) B A`` for each adapted layer (peft's ``get_delta_weight``, the same
    sum ``merge_and_unload`` makes), every other tensor shared with the model, not copied: the
    merged copy of the whole model that ``merge_and_unload`` needs (one model's memory; 131 GB
    for a 32B actor in fp32) is never made. Names as ``merge_and_unload().state_dict()``'s."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    merged = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and not module.merged:
            w = module.get_base_layer().weight.detach()
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    w = w + module.get_delta_weight(adapter).detach()
            merged[f"{name}.base_layer.weight"] = w
    out = {}
    for key, value in base.state_dict(keep_vars=True).items():
        if "lora_" in key:
            continue
        out[key.replace(".base_layer.", ".")] = merged.get(key, value.detach())
    return out


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,  # (B, T)
    attention_mask: torch.Tensor | None = None,  # (B, T)
    temperature: float = 1.0,
    chunk_size: int | None = 1024,
) -> torch.Tensor:  # (B, T)
    """log pi(x_t | x_<t) / tau at every position t of ``model``'s forward pass
    (``core.scoring.logprobs_from_logits``). Gradients flow through unless the caller wraps it in
    ``torch.no_grad()``."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: log-probs need a positive temperature")
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T, V)
    return logprobs_from_logits(logits, input_ids, temperature, chunk_size)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` inside the block (0: left as it is), the
    caller's restored after it."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Number of (trainable) parameters; tied embeddings counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _measure(preset: str) -> None:
    """Print parameters, fwd+bwd time on 8x512 tokens and batch-1 generation speed."""
    import time

    tok = build_tokenizer(["ls -la /app\ncat file.txt | grep error\n"] * 50, vocab_size=2048)
    tok = _pad_vocab(tok, 2048)
    model = build_tiny_actor(tok, preset)
    ids = torch.randint(3, len(tok), (8, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    model.eval()
    prompt = torch.randint(3, len(tok), (1, 200))
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=128, min_new_tokens=128, do_sample=True)
    gen = (out.shape[1] - 200) / (time.perf_counter() - t0)
    prompt8 = torch.randint(3, len(tok), (8, 200))
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt8, max_new_tokens=128, min_new_tokens=128, do_sample=True)
    gen8 = 8 * (out.shape[1] - 200) / (time.perf_counter() - t0)
    print(
        f"{preset}: {count_parameters(model) / 1e6:.2f}M params, fwd+bwd+step 8x512: "
        f"{min(times[1:]):.3f} s, generate: {gen:.0f} tok/s (batch 1), {gen8:.0f} tok/s (batch 8)"
    )


def _pad_vocab(tok: PreTrainedTokenizerFast, n: int) -> PreTrainedTokenizerFast:
    """Measurement helper: a tiny training text learns few merges; the speed test wants n ids."""
    missing = n - len(tok)
    if missing > 0:
        tok.add_tokens([f"<unused{i}>" for i in range(missing)])
    return tok


if __name__ == "__main__":
    torch.set_num_threads(2)
    for name in PRESETS:
        _measure(name)

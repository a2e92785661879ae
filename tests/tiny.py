"""The random tiny Qwen3 the unit tests train (~60k parameters): small enough for a unit test,
a real transformers model all the same (the code under test never special-cases it)."""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB = 300


def tiny_qwen(vocab: int = VOCAB, seed: int = 0) -> Qwen3ForCausalLM:
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)

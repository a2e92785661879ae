"""Tests for minirsi/engine/models.py: offline tokenizer, tiny Qwen3 actor, save/load, LoRA, log-probs."""

from __future__ import annotations

import pytest
import torch

from minirsi.engine import models
from minirsi.engine.models import (
    IM_END,
    IM_START,
    PAD_TOKEN,
    LoraSettings,
    build_tiny_actor,
    build_tokenizer,
    load_actor,
    save_actor,
    token_logprobs,
)

TEXTS = [
    "<|im_start|>user\ncount the lines of data.csv<|im_end|>\n<|im_start|>assistant\n"
    "```bash\nwc -l data.csv\n```<|im_end|>",
    "```bash\nmkdir -p /app/out && cp notes.txt /app/out/\n```",
    "grep -c error log.txt\nsort -u names.txt > sorted.txt\n",
] * 20


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TEXTS, vocab_size=512)


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_actor(tok, "tiny", seed=0)


def test_tokenizer_special_tokens_and_roundtrip(tok):
    assert tok.pad_token == PAD_TOKEN and tok.eos_token == IM_END
    ids = [tok.convert_tokens_to_ids(t) for t in (PAD_TOKEN, IM_START, IM_END)]
    assert ids == [0, 1, 2]
    # a special token in text is one id, not split into bytes
    assert tok("<|im_start|>user", add_special_tokens=False)["input_ids"][0] == 1
    # byte level: any text, unicode included, decodes back exactly
    text = "ls -la /tmp | grep 'é€' && echo $HOME\n\ttab"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    # merges were learned from the corpus: a common word is shorter than its bytes
    assert len(tok("data.csv", add_special_tokens=False)["input_ids"]) < len("data.csv")


def test_chat_template_is_chatml(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


def test_vocab_size_too_small_is_rejected():
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(["x"], vocab_size=100)


def test_tiny_preset_size(tok):
    m = build_tiny_actor(tok, "tiny")
    n = models.count_parameters(m)
    assert 0.1e6 < n < 3e6, n
    assert m.config.max_position_embeddings >= 2048
    assert m.config.eos_token_id == tok.convert_tokens_to_ids(IM_END)
    with pytest.raises(ValueError, match="preset"):
        models.tiny_config(tok, "huge")


def test_build_is_seeded(tok):
    a, b, c = build_tiny_actor(tok, seed=1), build_tiny_actor(tok, seed=1), build_tiny_actor(tok, seed=2)
    pa, pb, pc = (next(iter(x.parameters())) for x in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_save_load_roundtrip_through_from_pretrained(tok, model, tmp_path):
    save_actor(model, tok, tmp_path / "m")
    loaded, tok2 = load_actor(tmp_path / "m")
    ids = torch.tensor([tok("```bash\nwc -l data.csv\n```", add_special_tokens=False)["input_ids"]])
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)
    assert tok2.chat_template == tok.chat_template
    assert tok2("wc -l x", add_special_tokens=False)["input_ids"] == tok("wc -l x", add_special_tokens=False)["input_ids"]
    assert tok2.pad_token_id == 0 and tok2.eos_token == IM_END


def test_load_actor_missing_dir_names_fix(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_actor(tmp_path / "nothing")


def test_lora_trains_only_adapter_and_merged_save_loads(tok, tmp_path):
    base = build_tiny_actor(tok, seed=3)
    save_actor(base, tok, tmp_path / "base")
    actor, _ = load_actor(tmp_path / "base", lora=LoraSettings(r=4, alpha=8))
    trainable = {n for n, p in actor.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in actor.named_parameters()}
    opt = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(3, len(tok), (2, 16))
    for _ in range(2):  # two steps: lora_B starts at 0, so lora_A first gets a gradient on step 2
        actor(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    for n, p in actor.named_parameters():
        changed = not torch.equal(before[n], p.detach())
        assert changed == (n in trainable), n
    # merged save: a plain checkpoint whose logits equal the adapted model's
    save_actor(actor, tok, tmp_path / "merged")
    merged, _ = load_actor(tmp_path / "merged")
    actor.eval()
    merged.eval()
    with torch.no_grad():
        torch.testing.assert_close(actor(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with pytest.raises(ValueError, match="rank"):
        LoraSettings(r=0)


@pytest.mark.parametrize("temperature,chunk", [(1.0, 1024), (0.7, 3)])
def test_token_logprobs_matches_manual_gather(model, tok, temperature, chunk):
    torch.manual_seed(0)
    ids = torch.randint(3, len(tok), (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    model.eval()
    with torch.no_grad():
        got = token_logprobs(model, ids, mask, temperature=temperature, chunk_size=chunk)  # (B, T)
        logits = model(input_ids=ids, attention_mask=mask).logits / temperature
    want = torch.zeros(3, 11)
    for b in range(3):
        for t in range(1, 11):
            want[b, t] = torch.log_softmax(logits[b, t - 1], -1)[ids[b, t]]
    assert got.shape == (3, 11)
    assert torch.all(got[:, 0] == 0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(model, ids, mask, temperature=0.0)

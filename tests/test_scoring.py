"""Chunked scoring (minirsi/core/scoring.py) against the one-piece path: the same log-probs,
entropies and gradients for every chunk size, the head back as it was, and no whole-sequence
logits in a chunked pass (its peak memory is bench/logits.py's measurement)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from minirsi.core.rpr import policy_forward
from minirsi.core.rsr import sft_loss
from minirsi.core.scoring import chunked_scores
from minirsi.engine.models import LoraSettings, attach_lora
from tiny import VOCAB, tiny_qwen


def _batch(seed: int, B: int = 3, T: int = 23):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, T - 7:] = 0  # a right-padded row
    return ids, mask


@settings(max_examples=12, deadline=None)
@given(chunk=st.integers(1, 30), temperature=st.sampled_from([0.7, 1.0, 1.3]), seed=st.integers(0, 5))
def test_chunked_equals_whole_values_and_gradients(chunk, temperature, seed):
    model = tiny_qwen(seed=seed)
    ids, mask = _batch(seed)
    grads = []
    outs = []
    for c in (0, chunk):
        model.zero_grad(set_to_none=True)
        lp, ent = policy_forward(model, ids, mask, temperature, with_entropy=True, entropy_grad=True, logit_chunk=c)
        (lp.sum() + 0.3 * ent.sum()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        outs.append((lp.detach(), ent.detach()))
    (lp0, e0), (lp1, e1) = outs
    assert lp1.shape == lp0.shape == ids.shape and torch.all(lp1[:, 0] == 0) and torch.all(e1[:, 0] == 0)
    assert torch.allclose(lp0, lp1, atol=2e-6) and torch.allclose(e0, e1, atol=2e-5)
    assert max(float((a - b).abs().max()) for a, b in zip(*grads)) <= 2e-5
    assert model.lm_head.forward.__func__ is torch.nn.Linear.forward  # the head's own forward is back


def test_no_grad_scoring_is_bitwise_equal_when_the_chunk_covers_the_sequence():
    model = tiny_qwen(seed=0)
    ids, mask = _batch(0)
    with torch.no_grad():
        whole, _ = policy_forward(model, ids, mask, 1.0)
        one_piece, _ = chunked_scores(model, ids, mask, 1.0, chunk=ids.shape[1])
    assert torch.equal(whole, one_piece)


def test_entropy_as_a_metric_has_no_graph_and_sft_loss_agrees():
    model = tiny_qwen(seed=1)
    ids, mask = _batch(1)
    lp, ent = chunked_scores(model, ids, mask, 1.0, chunk=5, with_entropy=True, entropy_grad=False)
    assert lp.requires_grad and not ent.requires_grad
    act = (torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) < 0.5).float() * mask
    whole = sft_loss(model, ids, mask, act)
    chunked = sft_loss(model, ids, mask, act, logit_chunk=4)
    assert torch.allclose(whole, chunked, atol=1e-6)


def test_a_lora_actor_scores_through_its_base_head():
    torch.manual_seed(0)
    model = attach_lora(tiny_qwen(seed=2), LoraSettings(r=4))
    ids, mask = _batch(3)
    with torch.no_grad():
        a, _ = policy_forward(model, ids, mask, 0.9)
        b, _ = policy_forward(model, ids, mask, 0.9, logit_chunk=6)
    assert torch.allclose(a, b, atol=2e-6)


def test_bad_chunk_is_refused():
    model = tiny_qwen()
    ids, mask = _batch(0)
    with pytest.raises(ValueError, match="chunk=0"):
        chunked_scores(model, ids, mask, 1.0, chunk=0)


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("kind", ["no grad", "update", "sft"])
def test_no_op_of_a_chunked_pass_makes_a_whole_sequence_of_logits(kind):
    """What the chunking is for: no (T, V) tensor exists in the forward or the backward pass,
    only (c, V) pieces (here the largest tensor left is the tied head's V x H weight and its
    gradient, a quarter of T x V). The peak memory itself is bench/logits.py's measurement
    (README, benchmarks); this is its deterministic guard."""
    V, T, c = 4096, 256, 16
    model = tiny_qwen(vocab=V, seed=3)
    ids = torch.randint(1, V, (1, T), generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(ids)
    largest = {}
    for chunk in (0, c):
        model.zero_grad(set_to_none=True)
        with _LargestTensor() as seen:
            if kind == "sft":
                sft_loss(model, ids, ones, ones.float(), logit_chunk=chunk).backward()
            elif kind == "update":
                lp, _ = policy_forward(model, ids, ones, 0.8, with_entropy=True, entropy_grad=False, logit_chunk=chunk)
                lp.sum().backward()
            else:
                with torch.no_grad():
                    policy_forward(model, ids, ones, 0.8, logit_chunk=chunk)
        largest[chunk] = seen.most
    assert largest[0] >= T * V, largest  # the whole pass does hold (T, V) logits
    assert largest[c] <= T * V // 4, largest

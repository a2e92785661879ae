"""Per-token log-probs and entropies of a causal LM without its (B, T, V) logits.

The trainer scores every token of every episode: ``logp[b, t] = log_softmax(z[b, t-1] / tau)[x_t]``
(``logprobs_from_logits``, below) and, for PPO's entropy term, ``H[b, t] = -sum_v p_v log p_v``
of the same distribution. Computed from the model's logits, that materialises ``(B, T, V)``
floats several times over: the head's output, its fp32 copy divided by tau, the log-softmax
(kept for backward), the entropy's ``exp`` and product, and in backward the gradient of each.
For Qwen3 (V = 151,936) one 8192-token sequence is 5 GB per fp32 copy; a no-grad pass over a
rank's 8 sequences at once was ~40 GB a tensor (issue 26).

``chunked_scores`` never builds them. During one forward pass of the model it replaces the
forward of the model's output head (``models``' ``lm_head``; ``output_head``) by one that
takes the hidden states ``h`` (B, T, H) and, ``chunk`` positions at a time, computes::

    z_c   = (h_c W^T + b) / tau              (B, c, V), in the head's dtype, then fp32
    lp_c  = log_softmax(z_c)[x_{t+1}]        (B, c)
    H_c   = -sum_v exp(log_softmax(z_c)) log_softmax(z_c)      (B, c), when asked

With gradients on, each chunk runs under ``torch.utils.checkpoint`` (non-reentrant): only its
(B, c, H) slice of ``h`` is kept, and backward recomputes the chunk's logits, so at any time at
most one chunk's ``(B, c, V)`` tensors exist, forward or backward. The head is still called
exactly once per forward (inside the model's own forward), so FSDP2's hooks on it (an fp32
unit of its own, ``distributed.fsdp2``) gather its weight once and reduce its gradient once.

What it returns equals ``rpr.policy_forward`` (same formulas, the same log-softmax per row);
``tests/test_scoring.py`` checks values and gradients, and ``bench/logits.py`` measures the
peak memory of both. At ``chunk = 0`` the recipe keeps the one-piece path (``rpr.policy_forward``,
``rsr.sft_loss``), the one the CPU presets' results were made with; the scale configs set a
chunk (``rpr1.logit_chunk``, ``rsr1.logit_chunk``) and the planner (``minirsi.run.memplan``) counts
either.

Call it::

    logprobs, entropy = chunked_scores(model, input_ids, attention_mask, temperature=1.0,
                                       chunk=1024, with_entropy=True)      # each (B, T), 0 at t = 0
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def output_head(model: nn.Module) -> nn.Module:
    """The module that turns hidden states into logits (``get_output_embeddings()``: Qwen3's
    ``lm_head``), through a peft wrapper."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"chunked_scores: {type(model).__name__} has no output head (get_output_embeddings); "
                         "use logit_chunk=0 for this model")
    return head


def _chunk_scores(head: nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float,
                  with_entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: h (B, c, H), targets (B, c) -> (lp (B, c), entropy (B, c), zeros without it).
    Reads ``head.weight`` when it runs, so a recomputation in backward sees the weight FSDP
    has gathered again."""
    w, b = head.weight, getattr(head, "bias", None)
    z = F.linear(h.to(w.dtype), w, b).float() / temperature  # (B, c, V)
    logp = torch.log_softmax(z, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, c)
    if not with_entropy:
        return lp, torch.zeros_like(lp)
    with nullcontext() if entropy_grad else torch.no_grad():
        ent = -(logp.exp() * logp).sum(-1)  # (B, c)
    return lp, ent


@contextmanager
def _scoring_head(head: nn.Module, input_ids: torch.Tensor, temperature: float, chunk: int,
                  with_entropy: bool, entropy_grad: bool) -> Iterator[None]:
    """While active, ``head(h)`` returns (B, T-1, 2): [..., 0] = log pi(x_{t+1} | x_<=t),
    [..., 1] = the entropy at t (0 without ``with_entropy``), instead of (B, T, V) logits.
    An instance attribute shadows the class's ``forward``; hooks (FSDP2's) still run around it."""
    targets = input_ids[:, 1:]  # (B, T-1): the token each position t < T-1 scores

    def forward(h: torch.Tensor) -> torch.Tensor:  # h: (B, T, H)
        x = h[:, :-1]
        pieces = []
        for s in range(0, x.shape[1], chunk):
            args = (head, x[:, s:s + chunk], targets[:, s:s + chunk], temperature, with_entropy, entropy_grad)
            if torch.is_grad_enabled():  # keep only the (B, c, H) input; recompute the logits in backward
                pieces.append(torch.stack(checkpoint(_chunk_scores, *args, use_reentrant=False), dim=-1))
            else:
                pieces.append(torch.stack(_chunk_scores(*args), dim=-1))
        return torch.cat(pieces, dim=1) if pieces else x.new_zeros(x.shape[0], 0, 2, dtype=torch.float32)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward  # back to the class's forward


def chunked_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   temperature: float, chunk: int, with_entropy: bool = False,
                   entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs (B, T), entropy (B, T) or None), both 0 at position 0, from one forward pass of
    ``model`` with the head applied ``chunk`` positions at a time (module docstring).
    Gradients flow to the model unless the caller disables them; ``entropy_grad=False`` makes
    the entropy a metric only (no graph)."""
    if chunk < 1:
        raise ValueError(f"chunked_scores: chunk={chunk}; use a positive number of positions, e.g. 1024")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: log-probs need a positive temperature")
    with _scoring_head(output_head(model), input_ids, temperature, chunk, with_entropy, entropy_grad):
        scores = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, T-1, 2)
    zero = scores.new_zeros(scores.shape[0], 1)
    logprobs = torch.cat([zero, scores[..., 0]], dim=1)  # (B, T)
    if not with_entropy:
        return logprobs, None
    entropy = torch.cat([zero, scores[..., 1]], dim=1)
    return logprobs, (entropy if entropy_grad else entropy.detach())  # a metric: no path back


def logprobs_from_logits(
    logits: torch.Tensor,  # (B, T, V)
    input_ids: torch.Tensor,  # (B, T)
    temperature: float = 1.0,
    chunk_size: int | None = 1024,
) -> torch.Tensor:  # (B, T)
    """log softmax(logits_{t-1} / tau)[x_t] at every position t: position t scores token t given
    the tokens before it; position 0 has no context and holds 0 (it is never an action: every
    sequence starts with the prompt).

    The log-softmax is taken ``chunk_size`` positions at a time (None: all at once), so only one
    chunk of fp32 (B, chunk, V) log-probabilities exists besides the logits (V is ~150k for Qwen3).
    """
    B, T = input_ids.shape
    chunk_size = chunk_size or max(T - 1, 1)
    targets = input_ids[:, 1:]  # (B, T-1): x_t for t >= 1
    pieces = []
    for s in range(0, T - 1, chunk_size):
        z = logits[:, s : min(s + chunk_size, T - 1)].float() / temperature  # (B, c, V)
        lp = torch.log_softmax(z, dim=-1)
        pieces.append(lp.gather(-1, targets[:, s : s + z.shape[1]].unsqueeze(-1)).squeeze(-1))  # (B, c)
    first = torch.zeros((B, 1), dtype=torch.float32, device=input_ids.device)
    return torch.cat([first] + pieces, dim=1)  # (B, T)

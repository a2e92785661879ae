"""The fine-tuning optimizer and its step, written once for RSR, the critic warm-up and RPR.

AdamW without weight decay over the parameters that train (a LoRA actor: its adapters only), and
one step: clip the gradient's global norm over those same parameters, then step. Pretraining
keeps its own AdamW (weight decay on matrices, betas 0.9/0.95: minirsi.run.pretrain).
"""

from __future__ import annotations

from typing import Iterable

import torch


def adamw(params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.AdamW:
    """AdamW at ``lr``, weight decay 0, over the parameters of ``params`` that require grad."""
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, weight_decay=0.0)


def clipped_step(optimizer: torch.optim.Optimizer, max_grad_norm: float) -> float:
    """Clip the gradient of the optimizer's parameters to ``max_grad_norm`` (global L2 norm),
    then take the step. Returns the norm before clipping (the logged ``grad_norm_*``)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    return float(norm)

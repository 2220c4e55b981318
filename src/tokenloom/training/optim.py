"""AdamW with weight decay on matrices only (no decay for biases, norms)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def param_groups(params: nn.Module | Iterable[nn.Parameter], weight_decay: float) -> list[dict]:
    """Two groups: parameters with >= 2 dims (weights, embeddings) decay; the rest (biases, norm
    gains) do not. Tied parameters appear once."""
    decay, no_decay = [], []
    for p in params.parameters() if isinstance(params, nn.Module) else params:  # a shared tensor once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def create_optimizer(model: nn.Module | Iterable[nn.Parameter], *, lr: float, weight_decay: float,
                     betas: tuple[float, float], eps: float = 1e-8) -> torch.optim.AdamW:
    groups = param_groups(model, weight_decay)
    fused = all(p.device.type in ("cpu", "cuda") for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)

"""Losses shared by the tasks."""

from __future__ import annotations

from torch import Tensor
from torch.nn import functional as F


def cross_entropy(logits: Tensor, targets: Tensor, *, label_smoothing: float = 0.0,
                  ignore_index: int = -100) -> Tensor:
    """Mean token cross-entropy. logits (..., V), targets (...).

    With label smoothing eps the target distribution is (1 - eps) on the gold token plus eps spread
    uniformly over all V tokens, so the loss is ``(1 - eps) * nll + eps * mean_v(-log p_v)``
    (Szegedy et al. 2016; the original Transformer uses eps = 0.1). Positions whose target is
    ``ignore_index`` (padding) are left out of the mean.
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           label_smoothing=label_smoothing, ignore_index=ignore_index)


def z_loss(logits: Tensor) -> Tensor:
    """PaLM's auxiliary z-loss: ``mean(logsumexp(logits)^2)`` over all positions, logits (..., V); it keeps the
    softmax normaliser log Z near 0 (Chowdhery et al. 2022, weighted 1e-4 there)."""
    return logits.float().logsumexp(dim=-1).pow(2).mean()


def soft_cross_entropy(logits: Tensor, targets: Tensor, *, label_smoothing: float = 0.0) -> Tensor:
    """Mean cross-entropy against target distributions (mixup / cutmix). logits (B, K), targets (B, K)
    summing to 1 per row; label smoothing mixes each target with the uniform distribution:
    ``(1 - eps) * targets + eps / K``."""
    return F.cross_entropy(logits.float(), targets.float(), label_smoothing=label_smoothing)

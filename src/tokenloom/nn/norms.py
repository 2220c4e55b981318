"""Normalisation layers, by name: ``layernorm`` and ``rmsnorm``.

Each layer's ``inference_function()`` returns a plain function computing the same as ``forward``
without the ``nn.Module`` call overhead (used by decode loops; it captures the current parameters).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from ..registry import Registry

NORMS: Registry[type[nn.Module]] = Registry("norm")


@NORMS.register("layernorm")
class LayerNorm(nn.LayerNorm):
    """torch LayerNorm (mean and variance over the last dim), with an optional bias."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__(dim, eps=eps, bias=bias)

    def inference_function(self) -> Callable[[Tensor], Tensor]:
        return partial(torch.layer_norm, normalized_shape=self.normalized_shape, weight=self.weight,
                       bias=self.bias, eps=self.eps)


@NORMS.register("rmsnorm")
class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019); no mean subtraction and no bias."""

    def __init__(self, dim: int, eps: float = 1e-6, bias: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def inference_function(self) -> Callable[[Tensor], Tensor]:
        return partial(torch.rms_norm, normalized_shape=(self.weight.shape[0],), weight=self.weight, eps=self.eps)


def create_norm(name: str, dim: int, bias: bool = True, eps: float | None = None) -> nn.Module:
    cls = NORMS.get(name)
    return cls(dim, bias=bias) if eps is None else cls(dim, eps=eps, bias=bias)

"""Linear layers fused with what follows them, for eval-mode inference on CPU (oneDNN).

``linear_act(x, weight, bias, act)`` = ``act(F.linear(x, weight, bias))`` and ``linear_add(x, weight, bias,
residual)`` = ``residual + F.linear(x, weight, bias)`` as one oneDNN primitive each
(``torch.ops.mkldnn._linear_pointwise``, the kernels ``torch.compile`` emits for CPU inference): the bias, the
activation and the residual are applied while the output tile is still in cache, instead of three more passes
over memory. In float32 the results equal the unfused ops (GELU, ReLU, residual add: bit for bit; SiLU to float
rounding).

They run only where they can and pay: :func:`fusable` is False with autograd recording (the fused primitive has
no backward), under autocast, off CPU, for dtypes other than float32 / bfloat16, when oneDNN is switched off or
the op is missing from the torch build, and for inputs of fewer than ``FUSED_MIN_ROWS`` rows: each call costs
oneDNN ~35 us more than a plain matrix product, so for a batch-1 decoder pass (15-45 rows x 256 -> 1024) the fused
op is 30-60% slower than linear + add, and it only draws level from ~1,000 rows (measured here, fp32, 2 threads).
Callers fall back to the plain ops.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

_OPS = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
FUSED_MIN_ROWS = 2048  # rows (tokens) below which the plain ops are faster (see the module docstring)

# activation name (the MLP registry's) -> (oneDNN post-op, its algorithm)
ACTIVATIONS: dict[str, tuple[str, str]] = {
    "gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", ""), "silu": ("swish", ""),
}
_PLAIN = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}


def fusable(x: Tensor, weight: Tensor) -> bool:
    """Whether the fused kernels apply to input ``x`` and ``weight`` now (see the module docstring)."""
    return (_OPS is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and weight.dtype == x.dtype and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
            and torch._C._get_mkldnn_enabled() and x.numel() >= FUSED_MIN_ROWS * x.shape[-1])


def linear_act(x: Tensor, weight: Tensor, bias: Tensor | None, act: str) -> Tensor:
    """``act(F.linear(x, weight, bias))`` for ``act`` in :data:`ACTIVATIONS`, fused where :func:`fusable`."""
    if fusable(x, weight):
        op, algorithm = ACTIVATIONS[act]
        return _OPS(x, weight, bias, op, [], algorithm)
    return _PLAIN[act](F.linear(x, weight, bias))


def linear_add(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
    """``residual + F.linear(x, weight, bias)`` (a new tensor), fused where :func:`fusable`."""
    if fusable(x, weight) and residual.dtype == x.dtype:
        return _OPS.binary(x, residual, weight, bias, "add")
    return residual + F.linear(x, weight, bias)

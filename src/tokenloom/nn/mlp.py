"""Position-wise feed-forward networks, by name: ``gelu``, ``gelu_tanh``, ``relu``, ``relu2``, ``silu``,
``swiglu``.

Shapes: x (B, T, C) -> (B, T, C); the hidden width is ``hidden_dim``. Each MLP's
``inference_function(rows)`` returns a plain function equal to ``forward`` in eval mode (no dropout), without
the ``nn.Module`` call overhead, for decode loops of ``rows`` rows per call, its linear layers through
:func:`tokenloom.nn.fused.bind_linear` (a float layer's pre-packed weights, a quantised layer's kernel); it captures
the current parameters. ``add_to(residual, x)`` is ``residual + forward(x)``, in eval-mode inference on CPU with the
activation fused into the first linear layer and the residual into the second (:mod:`tokenloom.nn.fused`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..registry import Registry
from .dropout import Dropout
from .fused import bind_linear, linear_act_of, linear_add_of

MLPS: Registry[type[nn.Module]] = Registry("mlp")


class _TwoLayerMLP(nn.Module):
    """Linear -> activation -> Linear -> dropout (the original Transformer's FFN)."""

    act_name = ""  # the activation's name in nn.fused.ACTIVATIONS

    def __init__(self, embed_dim: int, hidden_dim: int, bias: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc_in = nn.Linear(embed_dim, hidden_dim, bias=bias)
        self.fc_out = nn.Linear(hidden_dim, embed_dim, bias=bias)
        self.dropout = Dropout(dropout)

    def act(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.fc_out(self.act(self.fc_in(x))))

    def add_to(self, residual: Tensor, x: Tensor) -> Tensor:
        """``residual + self(x)``; in eval mode with the linear layers fused where :mod:`.fused` can."""
        if self.training or not self.act_name:
            return residual + self(x)
        return linear_add_of(self.fc_out, linear_act_of(self.fc_in, x, self.act_name), residual)

    def inference_function(self, rows: int | None = None, residual: bool = False) -> Callable[..., Tensor]:
        fc_in, fc_out = bind_linear(self.fc_in, rows), bind_linear(self.fc_out, rows)
        act = self.inference_act()
        if residual:
            def mlp_add(x: Tensor, residual: Tensor) -> Tensor:
                return residual + fc_out(act(fc_in(x)))

            return mlp_add

        def mlp(x: Tensor) -> Tensor:
            return fc_out(act(fc_in(x)))

        return mlp

    def inference_act(self) -> Callable[[Tensor], Tensor]:
        """The activation :meth:`inference_function` applies: :meth:`act`, or an equal faster form."""
        return self.act


def gelu_native(x: Tensor) -> Tensor:
    """Exact GELU by ATen's own kernel. On CPU, float32 ``F.gelu`` runs a oneDNN primitive whose fixed
    cost (~10 us a call) dominates at decode sizes (one token); ATen's kernel agrees to float rounding.
    (It switches oneDNN off process-wide for the duration of the call.)"""
    if not (x.is_cpu and torch._C._get_mkldnn_enabled()):  # = torch.backends.mkldnn.enabled, without overhead
        return F.gelu(x)
    torch._C._set_mkldnn_enabled(False)
    try:
        return F.gelu(x)
    finally:
        torch._C._set_mkldnn_enabled(True)


@MLPS.register("gelu")
class GeluMLP(_TwoLayerMLP):
    act_name = "gelu"

    def act(self, x: Tensor) -> Tensor:
        return F.gelu(x)

    def inference_act(self) -> Callable[[Tensor], Tensor]:
        return gelu_native


@MLPS.register("gelu_tanh")
class GeluTanhMLP(_TwoLayerMLP):
    """GELU with the tanh approximation (GPT-2's ``gelu_new``)."""

    act_name = "gelu_tanh"

    def act(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate="tanh")


@MLPS.register("relu")
class ReluMLP(_TwoLayerMLP):
    act_name = "relu"

    def act(self, x: Tensor) -> Tensor:
        return F.relu(x)


def relu_squared(x: Tensor) -> Tensor:
    """relu(x)^2 (Primer, So et al. 2021; the modded-nanogpt speedrun's MLP activation)."""
    return F.relu(x).square()


@MLPS.register("relu2")
class Relu2MLP(_TwoLayerMLP):
    """ReLU squared between two linear layers; no fused kernel (``act_name`` empty), the plain two-layer body."""

    def act(self, x: Tensor) -> Tensor:
        return relu_squared(x)


@MLPS.register("silu")
class SiluMLP(_TwoLayerMLP):
    """SiLU (swish) between two linear layers, without a gate (Marian's default)."""

    act_name = "silu"

    def act(self, x: Tensor) -> Tensor:
        return F.silu(x)


@MLPS.register("swiglu")
class SwiGLU(nn.Module):
    """silu(x W_gate) * (x W_up) W_down (Shazeer 2020); ``hidden_dim`` is the gate/up width. Use
    :func:`swiglu_hidden_dim` for the width whose parameter count matches a two-layer MLP's."""

    def __init__(self, embed_dim: int, hidden_dim: int, bias: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        hidden = hidden_dim
        self.fc_gate = nn.Linear(embed_dim, hidden, bias=bias)
        self.fc_up = nn.Linear(embed_dim, hidden, bias=bias)
        self.fc_out = nn.Linear(hidden, embed_dim, bias=bias)
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.fc_out(F.silu(self.fc_gate(x)) * self.fc_up(x)))

    def add_to(self, residual: Tensor, x: Tensor) -> Tensor:
        """``residual + self(x)``; in eval mode with the gate's SiLU and the residual fused where :mod:`.fused`
        can."""
        if self.training:
            return residual + self(x)
        return linear_add_of(self.fc_out, linear_act_of(self.fc_gate, x, "silu") * self.fc_up(x), residual)

    def inference_function(self, rows: int | None = None, residual: bool = False) -> Callable[..., Tensor]:
        gate, up, fc_out = (bind_linear(layer, rows) for layer in (self.fc_gate, self.fc_up, self.fc_out))
        if residual:
            def mlp_add(x: Tensor, residual: Tensor) -> Tensor:
                return residual + fc_out(F.silu(gate(x)) * up(x))

            return mlp_add

        def mlp(x: Tensor) -> Tensor:
            return fc_out(F.silu(gate(x)) * up(x))

        return mlp


def swiglu_hidden_dim(two_layer_hidden: int) -> int:
    """2/3 of a two-layer MLP's hidden width, rounded up to a multiple of 8: three matrices of this
    width hold as many parameters as the two-layer MLP's two."""
    return (2 * two_layer_hidden // 3 + 7) // 8 * 8


def create_mlp(name: str, embed_dim: int, hidden_dim: int, bias: bool = True, dropout: float = 0.0) -> nn.Module:
    return MLPS.get(name)(embed_dim, hidden_dim, bias=bias, dropout=dropout)

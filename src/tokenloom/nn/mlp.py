"""Position-wise feed-forward networks, by name: ``gelu``, ``gelu_tanh``, ``relu``, ``swiglu``.

Shapes: x (B, T, C) -> (B, T, C); the hidden width is ``hidden_dim``.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn import functional as F

from ..registry import Registry

MLPS: Registry[type[nn.Module]] = Registry("mlp")


class _TwoLayerMLP(nn.Module):
    """Linear -> activation -> Linear -> dropout (the original Transformer's FFN)."""

    def __init__(self, embed_dim: int, hidden_dim: int, bias: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc_in = nn.Linear(embed_dim, hidden_dim, bias=bias)
        self.fc_out = nn.Linear(hidden_dim, embed_dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def act(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.fc_out(self.act(self.fc_in(x))))


@MLPS.register("gelu")
class GeluMLP(_TwoLayerMLP):
    def act(self, x: Tensor) -> Tensor:
        return F.gelu(x)


@MLPS.register("gelu_tanh")
class GeluTanhMLP(_TwoLayerMLP):
    """GELU with the tanh approximation (GPT-2's ``gelu_new``)."""

    def act(self, x: Tensor) -> Tensor:
        return F.gelu(x, approximate="tanh")


@MLPS.register("relu")
class ReluMLP(_TwoLayerMLP):
    def act(self, x: Tensor) -> Tensor:
        return F.relu(x)


@MLPS.register("swiglu")
class SwiGLU(nn.Module):
    """silu(x W_gate) * (x W_up) W_down (Shazeer 2020). The hidden width is 2/3 of ``hidden_dim``
    (rounded up to a multiple of 8) so the parameter count matches a two-layer MLP."""

    def __init__(self, embed_dim: int, hidden_dim: int, bias: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        hidden = (2 * hidden_dim // 3 + 7) // 8 * 8
        self.fc_gate = nn.Linear(embed_dim, hidden, bias=bias)
        self.fc_up = nn.Linear(embed_dim, hidden, bias=bias)
        self.fc_out = nn.Linear(hidden, embed_dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.fc_out(F.silu(self.fc_gate(x)) * self.fc_up(x)))


def create_mlp(name: str, embed_dim: int, hidden_dim: int, bias: bool = True, dropout: float = 0.0) -> nn.Module:
    return MLPS.get(name)(embed_dim, hidden_dim, bias=bias, dropout=dropout)

"""Position information, by name: ``sinusoidal``, ``learned``, ``rope``, ``alibi``, ``t5``, ``none``.

Two kinds of scheme:

* added to the token embeddings: ``sinusoidal`` (Vaswani et al. 2017) and ``learned`` (GPT-2) implement
  :meth:`Position.embed`;
* applied inside attention: ``rope`` rotates queries and keys (:meth:`Position.rotary`), ``alibi`` and
  ``t5`` add a bias to the attention scores (:meth:`Position.bias`).

A model calls all three hooks once per forward and hands the results to every layer; a scheme returns
None from the hooks it does not use. Shapes: B batch, T positions, C embed_dim, H heads, D head_dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..registry import Registry

POSITIONS: Registry[type[Position]] = Registry("position")


class Position(nn.Module):
    """Base class: every hook returns None."""

    def __init__(self, *, embed_dim: int, num_heads: int, head_dim: int, max_seq_len: int, **kwargs) -> None:
        super().__init__()

    def embed(self, positions: Tensor) -> Tensor | None:
        """(B, T) position ids -> (B, T, C) to add to the token embeddings, or None."""
        return None

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor] | None:
        """(B, T) position ids -> (cos, sin), each (B, 1, T, D), for :func:`apply_rotary`, or None."""
        return None

    def bias(self, q_index: Tensor, k_index: Tensor) -> Tensor | None:
        """(Tq,) query and (Tk,) key indices -> (1, H, Tq, Tk) additive score bias, or None."""
        return None


@POSITIONS.register("none")
class NoPosition(Position):
    """No position information (a causal decoder can still infer order)."""


def sinusoid_table(num_positions: int, dim: int) -> Tensor:
    """(num_positions, dim): sin on even, cos on odd features, wavelengths 2pi .. 10000*2pi."""
    pos = torch.arange(num_positions, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(num_positions, dim)
    table[:, 0::2] = torch.sin(pos * inv)
    table[:, 1::2] = torch.cos(pos * inv)[:, : dim // 2]
    return table


@POSITIONS.register("sinusoidal")
class SinusoidalPosition(Position):
    def __init__(self, *, embed_dim: int, max_seq_len: int, **kwargs) -> None:
        super().__init__(embed_dim=embed_dim, max_seq_len=max_seq_len, **kwargs)
        self.register_buffer("table", sinusoid_table(max_seq_len, embed_dim), persistent=False)

    def embed(self, positions: Tensor) -> Tensor:
        return self.table[positions]


@POSITIONS.register("learned")
class LearnedPosition(Position):
    def __init__(self, *, embed_dim: int, max_seq_len: int, **kwargs) -> None:
        super().__init__(embed_dim=embed_dim, max_seq_len=max_seq_len, **kwargs)
        self.weight = nn.Embedding(max_seq_len, embed_dim)

    def embed(self, positions: Tensor) -> Tensor:
        return self.weight(positions)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, H, T, D) ``x`` by the angles in cos/sin (B, 1, T, D), half-split layout (GPT-NeoX/Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@POSITIONS.register("rope")
class RotaryPosition(Position):
    """Rotary position embedding (Su et al. 2021): q·k depends on positions only through their offset."""

    def __init__(self, *, head_dim: int, max_seq_len: int, base: float = 10000.0, **kwargs) -> None:
        super().__init__(head_dim=head_dim, max_seq_len=max_seq_len, **kwargs)
        if head_dim % 2:
            raise ValueError(f"rope needs an even head_dim, got {head_dim}")
        inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * inv  # (T, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (T, D)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.cos[positions][:, None], self.sin[positions][:, None]  # (B, 1, T, D)


def alibi_slopes(num_heads: int) -> Tensor:
    """Press et al. 2022: a geometric sequence starting at 2^(-8/n); non-powers of two interleave."""

    def pow2(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        return torch.tensor(pow2(num_heads))
    closest = 2 ** math.floor(math.log2(num_heads))
    extra = pow2(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(pow2(closest) + extra)


@POSITIONS.register("alibi")
class AlibiPosition(Position):
    """Attention with linear biases: score(i, j) -= slope_h * (i - j)."""

    def __init__(self, *, num_heads: int, **kwargs) -> None:
        super().__init__(num_heads=num_heads, **kwargs)
        self.register_buffer("slopes", alibi_slopes(num_heads)[:, None, None], persistent=False)

    def bias(self, q_index: Tensor, k_index: Tensor) -> Tensor:
        distance = (q_index[:, None] - k_index[None, :]).clamp(min=0).float()  # (Tq, Tk)
        return (-self.slopes * distance)[None]  # (1, H, Tq, Tk)


def t5_bucket(relative: Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """T5's relative position buckets (exact for small offsets, logarithmic up to ``max_distance``).
    ``relative`` = key index - query index."""
    bucket = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        bucket += (relative > 0).long() * num_buckets
        n = relative.abs()
    else:
        n = (-relative).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (
        torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).long()
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(is_small, n, large)


@POSITIONS.register("t5")
class T5Position(Position):
    """T5 relative position bias: a learned scalar per (bucket, head), shared by all layers."""

    def __init__(self, *, num_heads: int, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = False, **kwargs) -> None:
        super().__init__(num_heads=num_heads, **kwargs)
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.weight = nn.Embedding(num_buckets, num_heads)

    def bias(self, q_index: Tensor, k_index: Tensor) -> Tensor:
        relative = k_index[None, :] - q_index[:, None]  # (Tq, Tk)
        buckets = t5_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        return self.weight(buckets).permute(2, 0, 1)[None]  # (1, H, Tq, Tk)


def create_position(name: str, **kwargs) -> Position:
    return POSITIONS.get(name)(**kwargs)

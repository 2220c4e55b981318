"""Attention masks.

Masks are boolean with ``True`` meaning "may attend"; :func:`to_additive` turns one into the float
form (0 / -inf) that can be summed with a position bias. Shapes: B batch, H heads, Tq queries,
Tk keys.
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None) -> Tensor:
    """(Tq, Tk) bool: query i (the last ``q_len`` of ``k_len`` positions) sees keys ``<= k_len - q_len + i``."""
    offset = k_len - q_len
    q = torch.arange(q_len, device=device)[:, None] + offset
    k = torch.arange(k_len, device=device)[None, :]
    return k <= q


def padding_mask(attention_mask: Tensor) -> Tensor:
    """(B, Tk) with 1/True for real tokens -> (B, 1, 1, Tk) bool, broadcastable over heads and queries."""
    return attention_mask.bool()[:, None, None, :]


def combine(*masks: Tensor | None) -> Tensor | None:
    """Logical AND of the masks that are not None (broadcasting), or None when all are None."""
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else out & m
    return out


def to_additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """Bool mask -> float mask with 0 where allowed and the dtype's lowest value where not."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """(B, T) 0/1 mask with left padding -> (B, T) position ids counting real tokens from 0 (pads get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True = may attend) as an additive float mask: 0 where allowed, the dtype's minimum
    elsewhere (finite, so a fully masked row gives a uniform softmax rather than NaN)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def padding_additive_mask(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, S) 1 = token, 0 = padding -> (B, 1, 1, S) additive mask (0 / the dtype's minimum): the keys' padding
    for any query, as the encoder-decoder and NAT models use it."""
    return additive_mask(padding_mask(attention_mask), dtype)

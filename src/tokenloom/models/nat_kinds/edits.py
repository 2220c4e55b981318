"""Edits of right-padded token rows that the edit-based kinds share: deleting positions (Levenshtein) and inserting
into the slots between adjacent tokens (Levenshtein's placeholders, the Insertion Transformer's tokens).

Shapes: tokens (B, T) right-padded with ``pad_id``; slot i lies between positions i and i + 1.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F


def delete_tokens(tokens: Tensor, deleted: Tensor, pad_id: int) -> Tensor:
    """tokens (B, T) with the positions ``deleted`` (B, T) bool removed, the rest shifted left, right-padded;
    the width shrinks to the longest row."""
    kept = (tokens != pad_id) & ~deleted
    order = (~kept).long().argsort(dim=1, stable=True)  # kept positions first, in order
    out = tokens.gather(1, order).masked_fill(~kept.gather(1, order), pad_id)
    return out[:, :max(int(kept.sum(1).max()), 1)]


def insert_placeholders(tokens: Tensor, counts: Tensor, placeholder_id: int, pad_id: int) -> Tensor:
    """tokens (B, T) (right-padded) with ``counts`` (B, T - 1) placeholders inserted between positions i and i + 1
    (counts at padded pairs must be 0) -> (B, T') right-padded, T' = the longest new row."""
    B, T = tokens.shape
    real = tokens != pad_id
    shift = F.pad(counts.cumsum(1), (1, 0))  # (B, T): placeholders before each position
    position = torch.arange(T, device=tokens.device)[None] + shift  # new position of each old token
    lengths = real.sum(1) + counts.sum(1)
    width = int(lengths.max())
    out = torch.full((B, width), placeholder_id, dtype=tokens.dtype, device=tokens.device)
    out.masked_fill_(torch.arange(width, device=tokens.device)[None] >= lengths[:, None], pad_id)
    rows = torch.arange(B, device=tokens.device)[:, None].expand(B, T)
    out[rows[real], position[real]] = tokens[real]
    return out

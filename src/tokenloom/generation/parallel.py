"""What every parallel (non-autoregressive) decoding shares: the ``NAT_DECODINGS`` registry that a model's kind
names (``NATKind.decoding``), banning ids from the logits, and recording the decoder rounds each sentence used.

The decodings themselves: :mod:`.nat` (argmax, Mask-Predict, CTC), :mod:`.levenshtein`, :mod:`.insertion`; each
registers itself here, and :mod:`.nat` imports the others so that all are registered once it is imported.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..registry import Registry

# (model, source, source_mask, memory, *, iterations, length_beam, rescorer, rounds) -> token ids per sentence
NATDecoding = Callable[..., list[list[int]]]
NAT_DECODINGS: Registry[NATDecoding] = Registry("nat decoding")


def ban(logits: Tensor, ids: list[int]) -> Tensor:
    """``logits`` (..., V) with the columns ``ids`` set to -inf (in place)."""
    if ids:
        logits.index_fill_(-1, torch.tensor(ids, device=logits.device), float("-inf"))
    return logits


def record_rounds(rounds: list[int] | None, count: int, used: int | list[int]) -> None:
    """Append to ``rounds`` (when given) the decoder rounds each of ``count`` sentences used: ``used`` for all, or
    one number per sentence."""
    if rounds is not None:
        rounds.extend([used] * count if isinstance(used, int) else used)

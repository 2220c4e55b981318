"""What generate, stream and beam search check of a request before decoding, in one place."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from ..errors import GenerationError


class Tokenizer(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def check_attention_mask(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor | None:
    """The (B, T) 0/1 mask as long, or None when there is no padding; rejects right padding."""
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise GenerationError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                              f"{tuple(input_ids.shape)}")
    mask = attention_mask.long()
    if ((mask != 0) & (mask != 1)).any():
        raise GenerationError("attention_mask must hold only 0 (padding) and 1 (token)")
    if mask.all():
        return None
    if (mask[:, 1:] < mask[:, :-1]).any():
        raise GenerationError("attention_mask must be left-padded (padding first, then the prompt); "
                              "a row has padding after a token")
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise GenerationError(f"empty prompt: row(s) {empty} of attention_mask are all padding")
    return mask

"""Kind ``cmlm`` (Mask-Predict, Ghazvininejad et al. 2019): the decoder reads the target with some tokens replaced
by ``<mask>`` (``mask_id``); trained on a uniformly random number (1..L) of masked tokens per sentence, the loss
over the masked positions only (plus the length loss); decoded by iterative re-masking of the least confident
tokens over the top length candidates (``iterations``, ``length_beam``; :func:`tokenloom.generation.nat.mask_predict`).

Shapes: tokens (B, T) (targets with ``<mask>`` ids, right-padded) -> inputs (B, T, C), mask (B, T).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ...config import check
from .base import NAT_KINDS, ReadsTokens


def random_mask(real: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """CMLM's training mask: in each row of ``real`` (B, L) (True = a target token) a uniformly random number
    n in 1..L_i of the tokens, chosen uniformly -> (B, L) bool."""
    B, L = real.shape
    lengths = real.sum(1)
    counts = (torch.rand(B, generator=generator, device=real.device) * lengths).long().clamp(max=lengths - 1) + 1
    scores = torch.rand(B, L, generator=generator, device=real.device).masked_fill(~real, 2.0)
    rank = torch.empty_like(scores, dtype=torch.long).scatter_(
        1, scores.argsort(dim=1), torch.arange(L, device=real.device).expand(B, L))
    return (rank < counts[:, None]) & real


class CMLM(ReadsTokens):
    reads: ClassVar[str] = "target tokens (with <mask> ids)"
    name: ClassVar[str] = "CMLM"
    paper_gap: ClassVar[str] = "~1 BLEU at 10 iterations (Ghazvininejad et al. 2019)"
    decoding: ClassVar[str] = "mask_predict"
    options: ClassVar[dict[str, int]] = {"iterations": 10, "length_beam": 3}

    def check(self, config: Any) -> None:
        check(0 <= config.mask_id < config.vocab_size,
              f"mask_id={config.mask_id} is outside the vocabulary [0, {config.vocab_size}) (kind cmlm needs one)")

    def training_inputs(self, model: Any, source: Tensor, source_mask: Tensor, tokens: Tensor, lengths: Tensor,
                        generator: torch.Generator | None = None,
                        memory: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        c = model.config
        masked = random_mask(tokens != c.pad_id, generator)
        inputs, decoder_mask = model.decoder_inputs(source, source_mask, tokens=tokens.masked_fill(masked, c.mask_id))
        return inputs, decoder_mask, tokens.masked_fill(~masked, c.pad_id)

    def bench_variants(self, can_rescore: bool) -> list[dict[str, Any]]:
        return [dict(iterations=1, length_beam=1), dict(iterations=1, length_beam=3),
                dict(iterations=4, length_beam=3), dict(iterations=10, length_beam=3)]


NAT_KINDS.register("cmlm")(CMLM())

"""Kind ``ctc`` (Libovický & Helcl 2018): no length predictor; the decoder reads the source embeddings, each
repeated ``ctc_upsample`` times (T = k * S); trained with CTC over a ``<blank>`` token (``blank_id``; no label
smoothing), skipping (and counting) a pair whose target cannot fit the decoder (L + adjacent repeats > k x the
source length); decoded by one argmax pass, repeats merged and blanks dropped (:func:`ctc_collapse`).

Shapes: source (B, S), source_mask (B, S) -> inputs (B, k * S, C), mask (B, k * S).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.nn import functional as F

from ...config import check
from .base import NAT_KINDS, NATKind
from .glancing import choose_positions, ctc_best_alignment, glance, glance_counts


def ctc_collapse(ids: list[int], blank_id: int) -> list[int]:
    """CTC's output: merge runs of the same id, then drop blanks (``a a _ a b b`` -> ``a a b``)."""
    out, previous = [], None
    for i in ids:
        if i != previous and i != blank_id:
            out.append(i)
        previous = i
    return out


def ctc_loss(logits: Tensor, decoder_mask: Tensor, targets: Tensor, target_lengths: Tensor, blank_id: int) -> Tensor:
    """Summed CTC negative log-likelihood of ``targets`` (B, L) (padded; ``target_lengths`` (B,)) under
    ``logits`` (B, T, V) whose first ``decoder_mask.sum(1)`` positions are real; float32 log-softmax."""
    log_probs = F.log_softmax(logits.float(), dim=-1).transpose(0, 1)  # (T, B, V)
    return F.ctc_loss(log_probs, targets, decoder_mask.sum(1), target_lengths, blank=blank_id, reduction="sum",
                      zero_infinity=True)


class CTC(NATKind):
    name: ClassVar[str] = "CTC"
    paper_gap: ClassVar[str] = "1-3 BLEU with glancing (Gu & Kong 2021)"
    glancing_gap: ClassVar[str] = "1-3 BLEU (GLAT-CTC, Gu & Kong 2021)"
    has_length_head: ClassVar[bool] = False
    length_rule: ClassVar[str] = "its length is ctc_upsample x the source"
    decoding: ClassVar[str] = "ctc"
    options: ClassVar[dict[str, int]] = {}
    skips_pairs: ClassVar[bool] = True
    glances: ClassVar[bool] = True

    def check(self, config: Any) -> None:
        check(0 <= config.blank_id < config.vocab_size,
              f"blank_id={config.blank_id} is outside the vocabulary [0, {config.vocab_size}) (kind ctc needs one)")
        check(config.max_target_len >= config.ctc_upsample * config.max_source_len,
              f"max_target_len={config.max_target_len} must hold ctc_upsample * max_source_len = "
              f"{config.ctc_upsample * config.max_source_len} decoder positions")

    def kept_id(self, config: Any) -> int:
        return config.blank_id  # the decoding drops the blanks itself

    def decoder_positions(self, section: dict[str, Any]) -> int:
        return section.get("ctc_upsample", 3) * section["max_source_len"]

    def decoder_inputs(self, model: Any, source: Tensor, source_mask: Tensor, target_lengths: Tensor | None = None,
                       tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        k = model.config.ctc_upsample
        source_embeds = model.scale_embeddings(model.src_embed(source))  # (B, S, C)
        return source_embeds.repeat_interleave(k, dim=1), source_mask.repeat_interleave(k, dim=1)  # (B, k * S, ...)

    def loss(self, model: Any, source: Tensor, source_mask: Tensor, tokens: Tensor, lengths: Tensor,
             label_smoothing: float, generator: torch.Generator | None = None) -> tuple[Tensor, int, int]:
        c = model.config
        real = tokens != c.pad_id
        repeats = ((tokens[:, 1:] == tokens[:, :-1]) & real[:, 1:]).sum(1)
        fits = lengths + repeats <= c.ctc_upsample * source_mask.sum(1)
        skipped = int((~fits).sum())
        if skipped:
            if skipped == len(fits):
                zero = sum(p.sum() * 0.0 for p in model.parameters())
                return zero, 0, skipped
            width = int(source_mask[fits].sum(1).max())
            source, source_mask = source[fits, :width], source_mask[fits, :width]
            tokens, lengths = tokens[fits], lengths[fits]
        memory = model.encode(source, source_mask)
        inputs, decoder_mask = self.decoder_inputs(model, source, source_mask)
        if c.glancing_ratio and model.training:
            inputs = self.glanced_inputs(model, inputs, decoder_mask, memory, source_mask, tokens, lengths, generator)
        logits = model.decode_parallel(inputs, decoder_mask, memory, source_mask)
        count = int(lengths.sum())
        return ctc_loss(logits, decoder_mask, tokens, lengths, c.blank_id) / max(count, 1), count, skipped

    @staticmethod
    def glanced_inputs(model: Any, inputs: Tensor, decoder_mask: Tensor, memory: Tensor, source_mask: Tensor,
                       tokens: Tensor, lengths: Tensor, generator: torch.Generator | None) -> Tensor:
        """Glancing CTC (Gu & Kong 2021): the reference is the targets' most probable alignment under a first
        pass without gradients; floor(ratio * d) positions take its labels (a token or the blank) as
        inputs, d the positions where the first pass's argmax differs from it."""
        c = model.config
        real = decoder_mask.bool()
        with torch.no_grad():
            logits = model.decode_parallel(inputs, decoder_mask, memory, source_mask).float()
            aligned = ctc_best_alignment(F.log_softmax(logits, dim=-1), decoder_mask.sum(1), tokens, lengths,
                                         c.blank_id)  # (B, T)
        chosen = choose_positions(real, glance_counts(logits.argmax(-1), aligned, real, c.glancing_ratio), generator)
        return glance(model, inputs, aligned, chosen)


NAT_KINDS.register("ctc")(CTC())

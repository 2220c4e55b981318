"""Kind ``nat`` (Gu et al. 2018): a length predictor over the encoder output; the decoder reads, for each
predicted length, a uniform copy of the source embeddings (``decoder_input: copy``: target position j of a
length-L_i sentence reads source position floor(j * S_i / L_i)) or position queries alone (``position``); one
parallel pass. Trained with cross-entropy over every target position (plus the length loss); decoded by one
argmax pass per length candidate (``length_beam``, optionally rescored by an autoregressive model).

Shapes: source (B, S), source_mask (B, S), target_lengths (B,) -> inputs (B, T, C), mask (B, T); T = the longest
length.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ...errors import GenerationError
from .base import NAT_KINDS, NATKind
from .glancing import choose_positions, glance, glance_counts


def length_inputs(model: Any, source: Tensor, source_mask: Tensor, target_lengths: Tensor | None,
                  copy: bool = True) -> tuple[Tensor, Tensor]:
    """For ``target_lengths`` (B,): the uniform copy of the source embeddings (``copy``) or zeros (B, T, C), and
    the mask (B, T) of the first ``target_lengths`` positions."""
    c = model.config
    if target_lengths is None:
        raise GenerationError(f"a {c.kind} decoder needs the target lengths")
    source_embeds = model.scale_embeddings(model.src_embed(source))  # (B, S, C)
    source_lengths = source_mask.sum(1)
    T = int(target_lengths.max())
    positions = torch.arange(T, device=source.device)
    mask = (positions[None] < target_lengths[:, None]).long()  # (B, T)
    if not copy:
        return source_embeds.new_zeros(source.shape[0], T, c.embed_dim), mask
    # uniform copy: target position j of a length-L_i sentence reads source position floor(j * S_i / L_i)
    index = (positions[None] * source_lengths[:, None]) // target_lengths.clamp(min=1)[:, None]  # (B, T)
    index = index.clamp(max=source.shape[1] - 1)
    return source_embeds.gather(1, index[..., None].expand(-1, -1, c.embed_dim)), mask


class NAT(NATKind):
    name: ClassVar[str] = "NAT"
    glances: ClassVar[bool] = True

    def decoder_inputs(self, model: Any, source: Tensor, source_mask: Tensor, target_lengths: Tensor | None = None,
                       tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return length_inputs(model, source, source_mask, target_lengths,
                             copy=model.config.decoder_input == "copy")

    def training_inputs(self, model: Any, source: Tensor, source_mask: Tensor, tokens: Tensor, lengths: Tensor,
                        generator: torch.Generator | None = None,
                        memory: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Inputs for the gold lengths; when training with ``glancing_ratio`` > 0, some positions glance at their
        target token (their inputs its embedding) and leave the loss (:mod:`.glancing`)."""
        inputs, decoder_mask = model.decoder_inputs(source, source_mask, lengths)
        ratio = model.config.glancing_ratio
        if not (ratio and model.training):
            return inputs, decoder_mask, tokens
        if memory is None:
            memory = model.encode(source, source_mask)
        real = decoder_mask.bool()
        with torch.no_grad():
            predicted = model.decode_parallel(inputs, decoder_mask, memory, source_mask).argmax(-1)  # (B, T)
        chosen = choose_positions(real, glance_counts(predicted, tokens, real, ratio), generator)
        return glance(model, inputs, tokens, chosen), decoder_mask, tokens.masked_fill(chosen, model.config.pad_id)

    def bench_variants(self, can_rescore: bool) -> list[dict[str, Any]]:
        return [dict(length_beam=1), dict(length_beam=3)] + ([dict(length_beam=3, rescore=True)] if can_rescore
                                                              else [])


NAT_KINDS.register("nat")(NAT())

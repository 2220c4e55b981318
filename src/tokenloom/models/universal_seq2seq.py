"""The Universal Transformer encoder-decoder (Dehghani et al. 2019): a recurrent-in-depth encoder with Adaptive
Computation Time per source position (Graves 2016), and the standard decoder stack.

Shape legend: B batch, S source length, T target positions, C embed_dim, V vocab_size, M encoder_max_steps.

The encoder is one shared transition (``encoder_layers`` blocks, 1 by default: the Universal Transformer's single
shared block) applied up to M times. Before step m every source position's state gets the coordinate signal again
(:func:`~tokenloom.models.universal.with_coordinates`: its position's embedding, where the position scheme adds one,
and the sinusoidal timestep embedding of m), exactly as the Universal Transformer LM
(:mod:`tokenloom.models.universal`) does. With ``act`` a halting unit reads each position's state after every step
(:func:`tokenloom.nn.act.act_step`); the memory is the halting-weighted sum of the states; a position that halted
keeps its state (it still serves as keys and values to the positions that run on). Padding positions take no part:
they are masked as keys, count in no ponder (their ponder is 0) and never keep the loop running, so a padded batch
encodes each sentence as it is encoded alone. The loop stops once every real position halted.

The decoder, embeddings, caches, decoding protocol and parameter names are the encoder-decoder's
(:class:`~tokenloom.models.seq2seq.EncoderDecoder`): decoding (greedy, beam search, ``translate``) works unchanged.
The model is declared to ponder (:func:`~tokenloom.models.registry.declare_ponder`; the encoder-decoder form of the
protocol: ``forward_ponder(source, target_in, source_mask) -> (logits, ponder (B, S))``), so the translation task
adds ``ponder_cost`` times the mean ponder count N + R of the real source positions to its loss and reports
``val_ponder``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..config import check
from ..errors import GenerationError
from ..nn.act import HaltingUnit, act_step
from ..nn.attention import Context, capturing
from ..nn.block import plain_eval
from ..nn.masks import sequence_span
from ..nn.sliding import plan_attention
from .registry import MODELS, declare_ponder
from .seq2seq import EncoderDecoder, Seq2SeqConfig
from .universal import PonderOutput, timing_signal_table, with_coordinates


@dataclass
class UniversalSeq2SeqConfig(Seq2SeqConfig):
    """The encoder-decoder with a Universal Transformer encoder (``model:`` with ``family: universal_seq2seq``): the
    encoder-decoder's settings, ``encoder_layers`` read as the blocks of the shared transition, plus the encoder's
    recurrence and ACT halting. The decoder is the standard stack of ``decoder_layers`` blocks."""

    encoder_layers: int = 1  # blocks of the encoder's shared transition, applied up to encoder_max_steps times
    #   (1: the Universal Transformer's one shared block)
    encoder_max_steps: int = 6  # most applications of the encoder's shared transition (M)
    act: bool = True  # adaptive computation time in the encoder: each source position halts on its own (False:
    #   exactly encoder_max_steps steps)
    act_eps: float = 0.01  # ACT's epsilon: a position halts once its halting probabilities sum to 1 - act_eps
    ponder_cost: float = 0.01  # tau: the training loss adds tau * the mean ponder count N + R of the real source
    #   positions
    halting_bias: float = 1.0  # initial bias of the halting unit (higher: higher first probabilities, fewer steps)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(isinstance(self.encoder_max_steps, int) and self.encoder_max_steps >= 1,
              f"encoder_max_steps must be >= 1, got {self.encoder_max_steps}")
        check(self.ponder_cost >= 0, f"ponder_cost (tau) must be >= 0, got {self.ponder_cost}")
        check(0 < self.act_eps < 1, f"act_eps must be in (0, 1), got {self.act_eps}")


class EncoderPonder(NamedTuple):
    """:meth:`UniversalEncoderDecoder.encode_ponder`'s result."""

    memory: Tensor  # (B, S, C) the encoder's output (the ACT-weighted sum of the steps' states, normed)
    ponder: Tensor  # (B, S) float32: each real source position's ponder count N + R (encoder_max_steps everywhere
    #   without ACT); 0 at padding


@declare_ponder
class UniversalEncoderDecoder(EncoderDecoder):
    """Source embedding -> the shared transition, up to ``encoder_max_steps`` times (ACT) -> memory; the decoder as
    in :class:`~tokenloom.models.seq2seq.EncoderDecoder`."""

    config: UniversalSeq2SeqConfig

    def __init__(self, config: UniversalSeq2SeqConfig) -> None:
        super().__init__(config)  # self.encoder: the encoder_layers blocks of the shared transition
        c = config
        self.halting = HaltingUnit(c.embed_dim, c.halting_bias) if c.act else None  # (its own initialisation)
        self.register_buffer("timestep", timing_signal_table(c.encoder_max_steps, c.embed_dim),
                             persistent=False)  # (M, C)

    @property
    def ponder_cost(self) -> float:
        """tau, the weight of the mean ponder count in the training loss (0 without ACT: nothing to learn)."""
        return self.config.ponder_cost if self.config.act else 0.0

    def encode(self, source: Tensor, source_mask: Tensor | None = None) -> Tensor:
        """(B, S) source ids (right-padded; ``source_mask`` 1 = token, 0 = padding) -> (B, S, C) memory."""
        return self.encode_ponder(source, source_mask).memory

    def forward_ponder(self, source: Tensor, target_in: Tensor, source_mask: Tensor | None = None) -> PonderOutput:
        """Teacher forcing: (B, S) sources and (B, T) decoder inputs -> (B, T, V) logits and the (B, S) ponder counts
        of the source positions (0 at padding)."""
        memory, ponder = self.encode_ponder(source, source_mask)
        return PonderOutput(self.decode(target_in, memory, source_mask), ponder)

    def encode_ponder(self, source: Tensor, source_mask: Tensor | None = None) -> EncoderPonder:
        """(B, S) source ids -> (B, S, C) memory and (B, S) ponder counts (0 at padding): the recurrence over the
        steps with ACT halting per real source position (see the module docstring)."""
        c = self.config
        B, S = source.shape
        if S > c.max_source_len:
            raise GenerationError(f"source of {S} tokens exceeds the model's limit of {c.max_source_len}")
        positions = torch.arange(S, device=source.device)[None].expand(B, S)
        x = self.src_embed(source) * self.embed_scale if self.embed_scale != 1.0 else self.src_embed(source)
        x = self.embed_dropout(x)  # (B, S, C); a no-op in eval mode
        signal = self.src_position.embed(positions)  # (B, S, C) or None: added before every step
        valid = None if source_mask is None or bool(source_mask.all()) else source_mask
        mask, _, band = plan_attention(sequence_span(S, valid), S, causal=False, window=self.encoder_window,
                                       position=self.src_position, dtype=self._mask_dtype(x), device=source.device,
                                       banded=not capturing())
        ctx = Context(mask, False, self.src_position.rotary(positions), band=band)
        transition = self._transition()
        real = torch.ones(B, S, dtype=torch.bool, device=source.device) if valid is None else valid.bool()
        acc = None
        for m in range(c.encoder_max_steps):
            y = transition(with_coordinates(x, signal, self.timestep, m), ctx)
            if self.halting is None:
                x = y
                continue
            p = self.halting(y).float()  # (B, S): ACT's sums in float32 (also under autocast)
            acc = act_step(acc, p, y, c.act_eps, last=m == c.encoder_max_steps - 1)
            x = torch.where(acc.ran.unsqueeze(-1), y, x)  # a halted position keeps its state
            if not bool((acc.running & real).any()):
                break  # every real position halted: later steps change no output at a real position
        if acc is None:
            memory, ponder = x, torch.full((B, S), float(c.encoder_max_steps), device=x.device)
        else:
            memory, ponder = acc.output.to(y.dtype), acc.ponder  # (ACT sums in float32; back to the states' dtype)
        return EncoderPonder(self.encoder_norm(memory), ponder.masked_fill(~real, 0.0))

    def _transition(self) -> Callable[[Tensor, Context], Tensor]:
        """One application of the shared transition, ``(x (B, S, C), ctx) -> (B, S, C)``: the encoder blocks bound as
        plain functions in eval mode (as the encoder-decoder's encoder runs them), else the modules (with
        gradient checkpointing where the config asks for it)."""
        blocks = list(self.encoder)
        if plain_eval(self.encoder):
            bound = [block.bind() for block in blocks]

            def plain(x: Tensor, ctx: Context) -> Tensor:
                for block in bound:
                    x = block(x, ctx)
                return x

            return plain
        recompute = self.config.gradient_checkpointing and self.training and torch.is_grad_enabled()

        def modules(x: Tensor, ctx: Context) -> Tensor:
            for block in blocks:
                x, _ = checkpoint(block, x, ctx, use_reentrant=False) if recompute else block(x, ctx)
            return x

        return modules


MODELS.register("universal_seq2seq")((UniversalSeq2SeqConfig, UniversalEncoderDecoder))

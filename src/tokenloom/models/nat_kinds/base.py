"""What one kind of non-autoregressive model does differently (:class:`NATKind`), and the ``NAT_KINDS`` registry.

Shape legend: B batch, S source length, T decoder length, C embed_dim, V vocab_size, L target length (tokens
only: no BOS, no EOS).

A kind decides the decoder's inputs, whether a length predictor sets the decoder's length, the special ids it
needs, the training loss, which parallel decoding it uses (a name in
:data:`tokenloom.generation.nat.NAT_DECODINGS`) with which options, and its rows in ``bench translate``. The
model, the task, the decoding and the command line ask the kind (``NAT_KINDS.get(config.kind)``), never compare
its name. The defaults here are those of a kind with a length predictor trained on every target position (the
``nat`` loss) and decoded by one argmax pass per length candidate; a kind overrides what it does differently.

This module imports nothing of the model's (:mod:`tokenloom.models.nat` imports it), so ``model`` and ``config``
below are a :class:`~tokenloom.models.nat.NonAutoregressiveTransformer` and its
:class:`~tokenloom.models.nat.NATConfig`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ...errors import ConfigError, GenerationError
from ...registry import Registry

DECODING_OPTIONS = ("iterations", "length_beam")  # the options a kind may take (translate's keyword arguments)


class NATKind:
    """A kind of non-autoregressive model (``NATConfig.kind``); registered as an instance in ``NAT_KINDS``."""

    name: ClassVar[str] = ""  # display name (bench translate's tables): "NAT", "CMLM", "CTC"
    # the gap to the autoregressive teacher its paper reports (WMT14, distilled), beside the measured one in bench
    # translate's table; glancing_gap: the same kind trained with glancing (GLAT)
    paper_gap: ClassVar[str] = ""
    glancing_gap: ClassVar[str] = "0.25-0.9 BLEU (GLAT, Qian et al. 2021)"
    has_length_head: ClassVar[bool] = True  # a length predictor over the encoder output sets the decoder's length
    length_rule: ClassVar[str] = ""  # without one: how the decoder's length follows from the source (for errors)
    decoding: ClassVar[str] = "argmax"  # its parallel decoding: a name in tokenloom.generation.nat.NAT_DECODINGS
    # the decoding options it takes (of DECODING_OPTIONS), with their defaults; length_beam means length candidates,
    # among which an autoregressive rescorer may pick
    options: ClassVar[dict[str, int]] = {"length_beam": 3}
    skips_pairs: ClassVar[bool] = False  # its loss skips pairs that cannot fit (reported as skipped_pairs)
    glances: ClassVar[bool] = False  # takes glancing training (NATConfig.glancing_ratio; nat_kinds/glancing.py)

    # ---- the model ----------------------------------------------------------------------------------

    def check(self, config: Any) -> None:
        """One-line :class:`ConfigError` for what this kind needs beyond a valid config (special ids, room)."""

    def heads(self, config: Any) -> dict[str, nn.Module]:
        """Modules a model of this kind adds beside the shared decoder and output layer (a Levenshtein model's
        deletion and placeholder classifiers, say), registered as ``model.kind_heads[name]``; default none."""
        return {}

    def kept_id(self, config: Any) -> int:
        """An id past the tokenizer's that decoding may still produce (and removes itself); -1 for none."""
        return -1

    def decoder_positions(self, section: dict[str, Any]) -> int:
        """Decoder positions a model of this kind needs for the ``model:`` section ``section`` (the task raises
        ``max_target_len`` to it); 0 for no more than the targets."""
        return 0

    def decoder_inputs(self, model: Any, source: Tensor, source_mask: Tensor, target_lengths: Tensor | None = None,
                       tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The decoder's input embeddings (B, T, C) and its mask (B, T) (1 = a position) for source (B, S) and
        source_mask (B, S), given the target lengths (B,) or the decoder's input tokens (B, T), as the kind
        reads them."""
        raise NotImplementedError

    # ---- training -----------------------------------------------------------------------------------

    def training_inputs(self, model: Any, source: Tensor, source_mask: Tensor, tokens: Tensor, lengths: Tensor,
                        generator: torch.Generator | None = None,
                        memory: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """For the target tokens (B, L) (right-padded) of ``lengths`` (B,): the decoder's inputs (B, T, C), its mask
        (B, T) and the targets (B, T) (padding where nothing is predicted). Default: inputs for the gold lengths,
        every token a target. ``memory`` (B, S, C): the encoder output, for kinds whose inputs need a first pass."""
        inputs, decoder_mask = model.decoder_inputs(source, source_mask, lengths)
        return inputs, decoder_mask, tokens

    def loss(self, model: Any, source: Tensor, source_mask: Tensor, tokens: Tensor, lengths: Tensor,
             label_smoothing: float, generator: torch.Generator | None = None) -> tuple[Tensor, int, int]:
        """(mean loss per predicted token, predicted tokens, skipped pairs) for target tokens (B, L) of ``lengths``
        (B,). Default: label-smoothed cross-entropy over :meth:`training_inputs`' targets plus
        ``length_loss_weight`` x the length predictor's cross-entropy. ``generator`` draws any randomness."""
        c = model.config
        pad = c.pad_id
        memory = model.encode(source, source_mask)
        length_loss = F.cross_entropy(model.length_logits(memory, source_mask).float(),
                                      model.length_classes(source_mask.sum(1), lengths))
        inputs, decoder_mask, targets = self.training_inputs(model, source, source_mask, tokens, lengths, generator,
                                                             memory)
        logits = model.decode_parallel(inputs, decoder_mask, memory, source_mask)
        token_loss = token_cross_entropy(logits, targets, label_smoothing, pad)
        return token_loss + c.length_loss_weight * length_loss, int((targets != pad).sum()), 0

    # ---- the command line ---------------------------------------------------------------------------

    def bench_variants(self, can_rescore: bool) -> list[dict[str, Any]]:
        """The decodings ``bench translate`` measures (translate's keyword arguments; ``rescore=True``: with the
        autoregressive teacher as rescorer, offered when ``can_rescore``). Default: the default options."""
        return [dict(self.options)]


class ReadsTokens(NATKind):
    """A kind whose decoder reads tokens (cmlm: the target with ``<mask>`` ids; levenshtein, insertion: the current
    hypothesis between BOS and EOS), embedded at the decoder inputs' scale, padding masked."""

    reads: ClassVar[str] = "target tokens"  # what the tokens are (for the error when none are given)

    def decoder_inputs(self, model: Any, source: Tensor, source_mask: Tensor, target_lengths: Tensor | None = None,
                       tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if tokens is None:
            kind = model.config.kind
            raise GenerationError(f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} decoder reads {self.reads}")
        return model.scale_embeddings(model.tgt_embed(tokens)), (tokens != model.config.pad_id).long()


NAT_KINDS: Registry[NATKind] = Registry("nat kind")


def token_cross_entropy(logits: Tensor, targets: Tensor, label_smoothing: float, pad_id: int) -> Tensor:
    """Mean label-smoothed cross-entropy of logits (..., V) against targets (...), padding left out (the formula of
    :func:`tokenloom.tasks.losses.cross_entropy`, which models/ does not import)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           label_smoothing=label_smoothing, ignore_index=pad_id)


def decoding_options(kind: str, *, beam: int = 1, iterations: int | None = None, length_beam: int | None = None,
                     rescorer: object | None = None) -> dict[str, int]:
    """One-line :class:`ConfigError` for decoding options that kind ``kind`` does not take; else its options
    (:attr:`NATKind.options`) with the defaults filled in."""
    strategy = NAT_KINDS.get(kind)
    if beam != 1:
        raise ConfigError(f"beam is an option of autoregressive models; this {kind} model decodes in parallel "
                          "(use length beam)")
    if iterations is not None and "iterations" not in strategy.options:
        takers = [name for name in NAT_KINDS if "iterations" in NAT_KINDS.get(name).options]
        raise ConfigError(f"iterations is an option of {', '.join(takers)} models; this model is {kind}")
    if "length_beam" not in strategy.options and (length_beam is not None or rescorer is not None):
        raise ConfigError(f"a {kind} model has no length candidates: length beam and rescoring do not apply")
    given = {"iterations": iterations, "length_beam": length_beam}
    for name, value in given.items():
        if value is not None and value < 1:
            raise ConfigError(f"{name.replace('_', ' ')} must be >= 1, got {value}")
    return {name: given.get(name) or default for name, default in strategy.options.items()}

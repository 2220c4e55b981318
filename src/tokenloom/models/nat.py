"""Non-autoregressive translation: every target token predicted at once, by one model class in several kinds.

Shape legend: B batch, S source length, T decoder length, C embed_dim, V vocab_size, K length classes,
L target length (tokens only: no BOS, no EOS).

``kind`` names a strategy in :data:`tokenloom.models.nat_kinds.NAT_KINDS` (one file per kind in
:mod:`tokenloom.models.nat_kinds`), which decides the decoder's inputs, whether there is a length predictor,
the special ids needed, the training loss and the parallel decoding; this class asks it, never compares the name:

* ``nat`` (Gu et al. 2018): a length predictor over the encoder output; the decoder's inputs are a uniform copy
  of the source embeddings (``decoder_input: copy``: target position j reads source position
  floor(j * S_i / T_i)) or position queries alone (``position``); one pass, no causal mask.
* ``cmlm`` (Mask-Predict, Ghazvininejad et al. 2019): the decoder reads the target with some tokens replaced by
  ``<mask>``; trained on a uniformly random number of masked tokens per sentence; decoded by iterative
  re-masking of the least confident tokens (:mod:`tokenloom.generation.nat`).
* ``ctc`` (Libovický & Helcl 2018): the decoder reads the source embeddings, each repeated ``ctc_upsample``
  times (T = k * S); trained with CTC over a ``<blank>`` token; decoding collapses repeats and drops blanks.
* ``levenshtein`` (Gu et al. 2019): edit-based; from ``[BOS, EOS]``, rounds of deletion, placeholder insertion
  and fill, with a deletion and a placeholder classifier beside the shared decoder (``kind_heads``); trained by
  imitation of the optimal insertion/deletion edits.
* ``insertion`` (Stern et al. 2019): from ``[BOS, EOS]``, every slot between adjacent tokens inserts a token or
  says end-of-slot (the ``<blank>`` id), in parallel rounds (~log2 n); trained with the balanced-binary-tree loss.

``nat`` and ``ctc`` also train with glancing (GLAT, ``glancing_ratio``; :mod:`.nat_kinds.glancing`).

A new kind is one file in :mod:`tokenloom.models.nat_kinds` that registers itself.

The encoder, the decoder blocks (self-attention without the causal mask, cross-attention, MLP), the embeddings
and the output projection are :class:`~tokenloom.models.seq2seq.EncoderDecoder`'s. The length predictor
(of kinds that have one: ``nat``, ``cmlm``) classifies the masked mean of the encoder output into the target length
(``length_prediction: classify``, 0..max_target_len) or its offset from the source length (``offset``,
-max_length_offset..+max_length_offset).

``<mask>`` and ``<blank>`` are ids past the tokenizer's vocabulary (``mask_id``, ``blank_id``, set by the
``nat_translation`` task); decoding never emits them, nor padding, BOS or EOS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..config import check, check_choice
from ..errors import GenerationError
from ..nn.attention import Context
from ..nn.block import plain_eval
from ..nn.kv_cache import MemoryLayer
from ..nn.masks import attention_mask as attention_mask_for
from ..nn.masks import sequence_span
from .nat_kinds import NAT_KINDS
from .nat_kinds.ctc import ctc_collapse, ctc_loss  # noqa: F401 (kind ctc's helpers, importable from here too)
from .registry import MODELS, declare_decoding
from .seq2seq import EncoderDecoder, Seq2SeqConfig
from .transfer import VOCABULARY_TENSORS, WeightMap, declare_start

DECODER_INPUTS = ("copy", "position")
LENGTH_PREDICTIONS = ("offset", "classify")
NAT_POSITIONS = ("sinusoidal", "sinusoidal_halves", "learned", "rope", "none")


@dataclass
class NATConfig(Seq2SeqConfig):
    """A non-autoregressive encoder-decoder (``model:`` with ``family: nat``): the encoder-decoder's settings plus
    the kind (``nat`` with length prediction, ``cmlm`` Mask-Predict, ``ctc``) and its options."""

    kind: str = "cmlm"  # a name in NAT_KINDS (tokenloom.models.nat_kinds): nat | cmlm | ctc | levenshtein | insertion
    decoder_input: str = "copy"  # nat: copy (uniform copy of the source embeddings) | position (queries only)
    length_prediction: str = "offset"  # offset (target - source length) | classify (the target length)
    max_length_offset: int = 32  # offsets predicted in [-m, m] (longer gaps are clamped)
    length_loss_weight: float = 0.1  # weight of the length predictor's cross-entropy in the loss
    ctc_upsample: int = 3  # ctc: decoder positions per source position
    # (GLAT, Qian et al. 2021): the decoder inputs glance floor(lambda * d) reference tokens, d the first pass's
    # distance to the reference (nat_kinds/glancing.py)
    glancing_ratio: float = 0.0  # lambda of glancing training (kinds nat, ctc); 0 = off
    mask_id: int = -1  # cmlm: the <mask> id (the task sets it past the tokenizer's vocabulary)
    blank_id: int = -1  # ctc: the <blank> id (likewise)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("kind", self.kind, NAT_KINDS)
        check(self.decoder_input in DECODER_INPUTS,
              f"decoder_input must be one of {', '.join(DECODER_INPUTS)}, got {self.decoder_input!r}")
        check(self.length_prediction in LENGTH_PREDICTIONS,
              f"length_prediction must be one of {', '.join(LENGTH_PREDICTIONS)}, got {self.length_prediction!r}")
        check(self.position in NAT_POSITIONS, f"position {self.position!r} is causal-only here; a "
              f"non-autoregressive decoder takes one of {', '.join(NAT_POSITIONS)}")
        check(self.max_length_offset >= 1, f"max_length_offset must be >= 1, got {self.max_length_offset}")
        check(self.length_loss_weight >= 0, f"length_loss_weight must be >= 0, got {self.length_loss_weight}")
        check(isinstance(self.ctc_upsample, int) and self.ctc_upsample >= 1,
              f"ctc_upsample must be a positive integer, got {self.ctc_upsample!r}")
        check(0.0 <= self.glancing_ratio <= 1.0, f"glancing_ratio must be in [0, 1], got {self.glancing_ratio}")
        if self.glancing_ratio and not NAT_KINDS.get(self.kind).glances:
            takers = ", ".join(name for name in NAT_KINDS if NAT_KINDS.get(name).glances)
            check(False, f"glancing_ratio={self.glancing_ratio} applies to kinds {takers} (single-pass decoders); "
                  f"this model is {self.kind}")
        for name in ("mask_id", "blank_id"):  # -1: not set yet (the nat_translation task sets them)
            value = getattr(self, name)
            check(value == -1 or 0 <= value < self.vocab_size,
                  f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")

    def check_special_ids(self) -> None:
        """What a model needs beyond a valid config, as its kind says (``NATKind.check``): kind cmlm a ``<mask>``
        id; kind ctc a ``<blank>`` id and room for the upsampled source in ``max_target_len``."""
        NAT_KINDS.get(self.kind).check(self)

    @property
    def num_length_classes(self) -> int:
        return 2 * self.max_length_offset + 1 if self.length_prediction == "offset" else self.max_target_len + 1

    @property
    def banned_ids(self) -> list[int]:
        """Ids a decoded sentence never contains: padding, BOS, EOS and every id from the first one added past
        the tokenizer's (``<mask>``, ``<blank>``, padding of the vocabulary) on, except the one its kind keeps
        (``NATKind.kept_id``: a ctc model's ``<blank>``, which its decoding removes itself)."""
        added = [i for i in (self.mask_id, self.blank_id) if i >= 0]
        extra = range(min(added), self.vocab_size) if added else range(0)
        keep = NAT_KINDS.get(self.kind).kept_id(self)
        return sorted({self.pad_id, self.bos_id, self.eos_id, *extra} - {keep})


@declare_decoding("parallel")
class NonAutoregressiveTransformer(EncoderDecoder):
    """The encoder-decoder with a bidirectional decoder, a length predictor (if its kind has one) and the decoder
    inputs of its kind (``config.kind``: NAT / CMLM / CTC / ...)."""

    def __init__(self, config: NATConfig) -> None:
        config.check_special_ids()
        super().__init__(config)
        kind = NAT_KINDS.get(config.kind)
        has_head = kind.has_length_head
        self.kind_heads = nn.ModuleDict(kind.heads(config))  # what the kind adds (NATKind.heads); often none
        self.length_head = nn.Linear(config.embed_dim, config.num_length_classes) if has_head else None
        if self.length_head is not None:
            nn.init.normal_(self.length_head.weight, std=0.02)
            nn.init.zeros_(self.length_head.bias)

    # ---- lengths ----------------------------------------------------------------------------------

    def length_logits(self, memory: Tensor, source_mask: Tensor) -> Tensor:
        """(B, S, C) encoder output -> (B, K) length-class logits from its masked mean."""
        if self.length_head is None:
            rule = NAT_KINDS.get(self.config.kind).length_rule
            raise GenerationError(f"a {self.config.kind} model has no length predictor" + (f": {rule}" if rule else ""))
        weights = source_mask.to(memory.dtype).unsqueeze(-1)  # (B, S, 1)
        pooled = (memory * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return self.length_head(pooled)

    def length_classes(self, source_lengths: Tensor, target_lengths: Tensor) -> Tensor:
        """The class of each target length (clamped into the predictor's range)."""
        c = self.config
        if c.length_prediction == "offset":
            offset = (target_lengths - source_lengths).clamp(-c.max_length_offset, c.max_length_offset)
            return offset + c.max_length_offset
        return target_lengths.clamp(0, c.max_target_len)

    def lengths_of(self, classes: Tensor, source_lengths: Tensor) -> Tensor:
        """Target lengths (>= 1, < max_target_len: room for the EOS an autoregressive rescorer adds) of length
        classes (B, l) for sources of (B,) lengths."""
        c = self.config
        lengths = classes - c.max_length_offset + source_lengths[:, None] if c.length_prediction == "offset" \
            else classes
        return lengths.clamp(1, max(c.max_target_len - 1, 1))

    # ---- decoder inputs ---------------------------------------------------------------------------

    def decoder_inputs(self, source: Tensor, source_mask: Tensor, target_lengths: Tensor | None = None,
                       tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The decoder's input embeddings (B, T, C) and its mask (B, T) (1 = a position), as the model's kind
        builds them (``NATKind.decoder_inputs``):

        * cmlm: ``tokens`` (B, T) (targets with ``<mask>`` ids, padded) embedded;
        * nat: for ``target_lengths`` (B,), a uniform copy of the source embeddings (``copy``) or zeros
          (``position``); T = the longest length;
        * ctc: the source embeddings, each position repeated ``ctc_upsample`` times; T = k * S.

        Positions are added by the decoder (:meth:`decode_parallel`)."""
        return NAT_KINDS.get(self.config.kind).decoder_inputs(self, source, source_mask, target_lengths, tokens)

    def scale_embeddings(self, x: Tensor) -> Tensor:
        """Token embeddings (B, T, C) times the model's ``embed_scale`` (the decoder inputs' scale)."""
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    # ---- the parallel decoder ---------------------------------------------------------------------

    def memory_kv(self, memory: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Every decoder layer's cross-attention keys and values of ``memory`` (B, S, C), for decoding passes
        that reuse them (Mask-Predict's iterations)."""
        return [block.cross_attn.memory_kv(memory) for block in self.decoder]

    def decode_parallel(self, inputs: Tensor, target_mask: Tensor, memory: Tensor, source_mask: Tensor,
                        memory_kv: list[tuple[Tensor, Tensor]] | None = None) -> Tensor:
        """inputs (B, T, C), target_mask (B, T), memory (B, S, C), source_mask (B, S) -> (B, T, V) logits;
        every position attends to every non-padding position (no causal mask). ``memory_kv`` (from
        :meth:`memory_kv`) saves recomputing the cross-attention keys and values."""
        return self.lm_head(self.decode_hidden(inputs, target_mask, memory, source_mask, memory_kv))

    def decode_hidden(self, inputs: Tensor, target_mask: Tensor, memory: Tensor, source_mask: Tensor,
                      memory_kv: list[tuple[Tensor, Tensor]] | None = None) -> Tensor:
        """:meth:`decode_parallel` before the output layer: the final-normed states (B, T, C), for callers
        that need logits at a few positions only (Mask-Predict's later iterations)."""
        B, T, _ = inputs.shape
        if T > self.config.max_target_len:
            raise GenerationError(f"decoder length {T} exceeds the model's limit of {self.config.max_target_len}")
        positions = torch.arange(T, device=inputs.device)[None].expand(B, T)
        x = inputs
        added = self.tgt_position.embed(positions)
        if added is not None:
            x = x + added
        x = self.embed_dropout(x)
        dtype = self._mask_dtype(x)
        valid = None if bool(target_mask.all()) else target_mask
        self_mask, _ = attention_mask_for(sequence_span(T, valid), T, causal=False, dtype=dtype, device=x.device)
        ctx = Context(self_mask, False, self.tgt_position.rotary(positions),
                      memory_mask=self.memory_mask(source_mask, dtype))
        memories = [MemoryLayer(*kv) for kv in memory_kv] if memory_kv is not None else None
        if plain_eval(self.decoder):
            for i, block in enumerate(self.decoder):
                kv = memories[i] if memories is not None else MemoryLayer(*block.cross_attn.memory_kv(memory))
                x = block.bind()(x, ctx._replace(memory=kv))
            return self.decoder_norm(x)
        for i, block in enumerate(self.decoder):
            if memories is not None:
                x, _ = block(x, ctx._replace(memory=memories[i]))
            else:
                x, _ = block(x, ctx, memory=memory)
        return self.decoder_norm(x)

    def forward(self, source: Tensor, source_mask: Tensor, target_lengths: Tensor | None = None,
                tokens: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Encode, build the decoder inputs (see :meth:`decoder_inputs`) and decode in parallel:
        -> (logits (B, T, V), decoder mask (B, T), memory (B, S, C))."""
        memory = self.encode(source, source_mask)
        inputs, mask = self.decoder_inputs(source, source_mask, target_lengths, tokens)
        return self.decode_parallel(inputs, mask, memory, source_mask), mask, memory


MODELS.register("nat")((NATConfig, NonAutoregressiveTransformer))
# train.init_from an autoregressive teacher (family seq2seq): encoder, decoder blocks and norms copied; the
# embeddings and output projection get the teacher's rows (<mask> and <blank> start fresh); the length predictor and
# the kind's heads start fresh
declare_start("nat", WeightMap("seq2seq", vocab_rows=VOCABULARY_TENSORS, fresh=("length_head.", "kind_heads.")))

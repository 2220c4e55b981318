"""The encoder-decoder Transformer (Vaswani et al. 2017) for translation.

Shape legend: B batch, S source length, T target positions in this call, C embed_dim, V vocab_size.

* ``encode(source (B, S), source_mask) -> memory (B, S, C)``: bidirectional self-attention + FFN; with an
  ``encoder_attention_window``, within each position's sliding window (Longformer; block-wise for long sources,
  :mod:`tokenloom.nn.sliding`). ``encode_chunked`` takes sources longer than ``max_source_len`` in overlapping
  chunks (:mod:`tokenloom.nn.chunking`).
* ``decode(target (B, T), memory, source_mask) -> logits (B, T, V)``: causal self-attention,
  cross-attention to the memory, FFN.
* ``forward(source, target_in, source_mask)``: both, for teacher forcing.

Defaults follow the paper: post-norm, sinusoidal positions, one embedding matrix shared by source,
target and the output projection over a joint vocabulary, embeddings scaled by sqrt(C). Every nn option
of the spine (pre-norm, RoPE, RMSNorm, SwiGLU, grouped-query attention) works here too.

Decoding goes through :meth:`EncoderDecoder.decoder_for`, which encodes the sources once and returns a
:class:`Seq2SeqDecoder`: an object with the decoder-only model protocol (``__call__(ids, positions=,
attention_mask=, cache=)``, ``create_cache``, ``config.vocab_size``, ``config.max_seq_len``), so greedy,
sampling and beam search from :mod:`tokenloom.generation` work unchanged. Its cache
(:class:`Seq2SeqCache`) holds the decoder's self-attention keys and values and every layer's
cross-attention keys and values, computed once per source sentence and shared by that sentence's beams.

A one-token decode step with a cache in eval mode runs the decoder blocks bound as plain functions, as GPT
does (:func:`tokenloom.nn.block.step_functions`: self-attention over the cache, cross-attention over the
precomputed memory keys and values — a :class:`~tokenloom.nn.kv_cache.MemoryLayer` per layer — and the MLP,
without ``nn.Module`` call overhead), built once per cache; forward hooks on a submodule switch it off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..config import check
from ..errors import GenerationError
from ..nn import POSITIONS, KVCache, create_block, create_norm
from ..nn.attention import Context, capturing
from ..nn.block import plain_eval, step_functions
from ..nn.chunking import encode_in_chunks
from ..nn.dropout import Dropout
from ..nn.kv_cache import MemoryLayer
from ..nn.masks import attention_mask as attention_mask_for
from ..nn.masks import sequence_span
from ..nn.positions import Position
from ..nn.sliding import Window, plan_attention
from .options import attention_options, check_block_options, check_window_options
from .registry import MODELS, declare_decoding
from .sentence_groups import check_reorder, kept_sentences


@dataclass
class Seq2SeqConfig:
    """The encoder-decoder Transformer (``model:`` with ``family: seq2seq``); the defaults are the original
    Transformer-base's (Post-Norm, ReLU MLP, sinusoidal positions, shared embeddings)."""

    vocab_size: int = 8000  # joint source/target vocabulary
    encoder_layers: int = 6  # encoder blocks
    decoder_layers: int = 6  # decoder blocks (self-attention, cross-attention, MLP)
    num_heads: int = 8  # query heads per attention layer
    num_kv_heads: int | None = None  # grouped-query attention; None = num_heads
    embed_dim: int = 512  # width of the residual stream (d_model)
    max_source_len: int = 256  # longest source (tokens, EOS included) the encoder accepts
    max_target_len: int = 256  # longest target (BOS + tokens + EOS) the decoder produces
    position: str = "sinusoidal"  # sinusoidal | sinusoidal_halves | learned | rope | alibi | t5 | none
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_placement: str = "post"  # post (the original Transformer) | pre
    norm_eps: float = 1e-5  # epsilon of every norm layer
    mlp: str = "relu"  # relu (the paper) | gelu | gelu_tanh | silu | swiglu
    mlp_ratio: float = 4.0  # MLP hidden width = mlp_ratio * embed_dim (d_ff = 2048 at 512)
    mlp_hidden_dim: int | None = None  # exact MLP hidden width; None = from mlp_ratio
    attention: str = "sdpa"  # sdpa | math | performer (linformer: non-autoregressive models only)
    attention_options: dict | None = None  # the backend's own options: performer {features, redraw}, linformer {k}
    encoder_attention_window: int | None = None  # the encoder's sliding window (Longformer): each source position
    #   sees the W // 2 before and after it; None = the whole source. The decoder attends fully
    encoder_attention_global: int = 0  # with a window: the first k source positions see and are seen by every one
    dropout: float = 0.1  # on embeddings and residual branches (and attention, unless attention_dropout)
    attention_dropout: float | None = None  # None = dropout
    bias: bool = True  # biases in linear and norm layers
    share_embeddings: bool = True  # source and target embeddings are one matrix (joint vocabulary)
    tie_embeddings: bool = True  # the output projection is the target embedding matrix
    scale_embeddings: bool = True  # multiply embeddings by sqrt(embed_dim)
    output_bias: bool = False  # a bias on the vocabulary logits (Marian's final_logits_bias)
    rope_base: float = 10000.0  # RoPE frequency base (position: rope)
    rope_scaling: dict | None = None  # RoPE frequency scaling, e.g. {type: linear, factor: 2.0}
    pad_id: int = 0  # the padding token's id (the tokenizer's, filled in by training)
    bos_id: int = 1  # the id the decoder starts from
    eos_id: int = 2  # the id that ends a sentence
    gradient_checkpointing: bool = False  # recompute block activations in backward to save memory
    head_dim: int = field(init=False, default=0)  # derived
    mlp_hidden: int = field(init=False, default=0)  # derived

    def __post_init__(self) -> None:
        for name in ("vocab_size", "encoder_layers", "decoder_layers", "num_heads", "embed_dim", "max_source_len",
                     "max_target_len"):
            value = getattr(self, name)
            check(value >= 1, f"{name} must be a positive integer, got {value}")
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            check(0 <= value < self.vocab_size, f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")
        check_block_options(self, causal=getattr(self, "kind", None) is None)  # NAT decoders are not causal
        check_window_options(self, "encoder_attention_window", "encoder_attention_global")
        check(self.position != "xl", "position 'xl' (Transformer-XL's relative positions) is for decoder-only models "
              "(family: gpt); use t5, alibi or rope for relative positions here")

    @property
    def max_seq_len(self) -> int:
        """The decoder's context (the decode protocol's name for it)."""
        return self.max_target_len


@declare_decoding("encoder_decoder")
class EncoderDecoder(nn.Module):
    """Source embedding -> encoder blocks -> memory; target embedding -> decoder blocks (self-attention,
    cross-attention, MLP) -> vocabulary logits."""

    decoder_group: int = 1  # the decoder's self-attention is causal over groups of this many positions (semi_ar)

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.config = c = config
        self.tgt_embed = nn.Embedding(c.vocab_size, c.embed_dim, padding_idx=c.pad_id)
        self.src_embed = self.tgt_embed if c.share_embeddings else \
            nn.Embedding(c.vocab_size, c.embed_dim, padding_idx=c.pad_id)
        rope = {"base": c.rope_base, "scaling": c.rope_scaling} if c.position == "rope" else {}
        both_ways = {"bidirectional": True} if c.position in ("alibi", "t5") else {}  # the encoder sees both sides
        self.src_position = POSITIONS.get(c.position)(embed_dim=c.embed_dim, num_heads=c.num_heads,
                                                      head_dim=c.head_dim, max_seq_len=c.max_source_len,
                                                      **rope, **both_ways)
        self.tgt_position = POSITIONS.get(c.position)(embed_dim=c.embed_dim, num_heads=c.num_heads,
                                                      head_dim=c.head_dim, max_seq_len=c.max_target_len, **rope)
        self.embed_scale = math.sqrt(c.embed_dim) if c.scale_embeddings else 1.0
        self.embed_dropout = Dropout(c.dropout)
        common = dict(hidden_dim=c.mlp_hidden, mlp=c.mlp, norm=c.norm, attention=c.attention, dropout=c.dropout,
                      bias=c.bias, norm_eps=c.norm_eps, attention_dropout=c.attention_dropout,
                      attention_options=attention_options(c, max(c.max_source_len, c.max_target_len)))
        self.encoder = nn.ModuleList(create_block(c.norm_placement, c.embed_dim, c.num_heads, c.num_kv_heads,
                                                  **common) for _ in range(c.encoder_layers))
        self.decoder = nn.ModuleList(create_block(c.norm_placement, c.embed_dim, c.num_heads, c.num_kv_heads,
                                                  cross_attention=True, **common) for _ in range(c.decoder_layers))
        pre = c.norm_placement == "pre"  # post-norm blocks end in a norm already
        self.encoder_norm = create_norm(c.norm, c.embed_dim, bias=c.bias, eps=c.norm_eps) if pre else nn.Identity()
        self.decoder_norm = create_norm(c.norm, c.embed_dim, bias=c.bias, eps=c.norm_eps) if pre else nn.Identity()
        self.lm_head = nn.Linear(c.embed_dim, c.vocab_size, bias=c.output_bias)
        self._init_weights()
        if c.tie_embeddings:
            self.lm_head.weight = self.tgt_embed.weight
        self.encoder_window = Window(c.encoder_attention_window, False, c.encoder_attention_global) \
            if c.encoder_attention_window else None

    def _init_weights(self) -> None:
        """fairseq's Transformer: Xavier-uniform linear layers, embeddings N(0, C^-1/2) (unit scale after
        the sqrt(C) factor), a zero padding row."""
        c = self.config
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        std = c.embed_dim ** -0.5 if c.scale_embeddings else 0.02
        for embed in {id(m): m for m in (self.src_embed, self.tgt_embed)}.values():
            nn.init.normal_(embed.weight, mean=0.0, std=std)
            with torch.no_grad():
                embed.weight[c.pad_id].zero_()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- encoder ----------------------------------------------------------------------------------

    def _embed(self, ids: Tensor, embed: nn.Embedding, position: Position, positions: Tensor) -> Tensor:
        x = embed(ids) * self.embed_scale if self.embed_scale != 1.0 else embed(ids)
        added = position.embed(positions)
        if added is not None:
            x = x + added
        return self.embed_dropout(x)  # a no-op in eval mode

    def _mask_dtype(self, x: Tensor) -> torch.dtype:
        return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") and x.device.type == "cpu" \
            else x.dtype

    def encode(self, source: Tensor, source_mask: Tensor | None = None) -> Tensor:
        """(B, S) source ids (right-padded; ``source_mask`` 1 = token, 0 = padding) -> (B, S, C) memory. With an
        ``encoder_attention_window`` each position attends within its window (block-wise for long sources)."""
        B, S = source.shape
        if S > self.config.max_source_len:
            raise GenerationError(f"source of {S} tokens exceeds the model's limit of {self.config.max_source_len}")
        positions = torch.arange(S, device=source.device)[None].expand(B, S)
        x = self._embed(source, self.src_embed, self.src_position, positions)
        valid = None if source_mask is None or bool(source_mask.all()) else source_mask
        mask, _, band = plan_attention(sequence_span(S, valid), S, causal=False, window=self.encoder_window,
                                       position=self.src_position, dtype=self._mask_dtype(x), device=source.device,
                                       banded=not capturing())
        ctx = Context(mask, False, self.src_position.rotary(positions), band=band)
        if plain_eval(self.encoder):
            for block in self.encoder:
                x = block.bind()(x, ctx)
            return self.encoder_norm(x)
        for block in self.encoder:
            if self.config.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x, _ = checkpoint(block, x, ctx, use_reentrant=False)
            else:
                x, _ = block(x, ctx)
        return self.encoder_norm(x)

    def encode_chunked(self, source: Tensor, source_mask: Tensor | None = None, *, overlap: int,
                       fusion: str = "mean", max_batch: int | None = None) -> Tensor:
        """:meth:`encode` for sources of any length: (B, S) -> (B, S, C) memory, a source longer than
        ``max_source_len`` encoded in overlapping chunks of ``max_source_len`` positions advancing by
        ``max_source_len - overlap`` and fused (:func:`tokenloom.nn.chunking.encode_in_chunks`; ``fusion`` mean
        or max_context, at most ``max_batch`` chunks per encoder call). No position attends across chunks, and
        each chunk's positions start at 0; a source that fits is encoded as :meth:`encode` does."""
        return encode_in_chunks(self.encode, source, source_mask, chunk=self.config.max_source_len,
                                overlap=overlap, fusion=fusion, max_batch=max_batch)

    def memory_mask(self, source_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
        """The cross-attention mask of the memory's padding, (B, 1, 1, S) additive, or None without padding."""
        if source_mask is None or bool(source_mask.all()):
            return None
        return attention_mask_for(sequence_span(source_mask.shape[1], source_mask), 1, causal=False, dtype=dtype,
                                  device=source_mask.device)[0]

    # ---- decoder ----------------------------------------------------------------------------------

    def decode(self, target: Tensor, memory: Tensor | None = None, source_mask: Tensor | None = None, *,
               positions: Tensor | None = None, cache: Seq2SeqCache | None = None) -> Tensor:
        """(B, T) target ids -> (B, T, V) logits, attending to ``memory`` (B, S, C) — or, with a ``cache``
        from :meth:`Seq2SeqDecoder.create_cache`, to its precomputed cross-attention keys and values."""
        B, T = target.shape
        span = cache.span(T, None) if cache is not None else sequence_span(T)
        if span.keys > self.config.max_target_len:
            raise GenerationError(f"target of {span.keys} positions exceeds the model's limit of "
                                  f"{self.config.max_target_len}")
        if positions is None:
            positions = torch.arange(span.past, span.keys, device=target.device)[None].expand(B, T)
        steps = None
        if T == self.decoder_group and cache is not None and not self.training:  # one step: 1 token (K: a group)
            steps = step_functions(self, cache, lambda: (self.decoder, self.decoder_norm, self.lm_head), T)
        if steps is None or T > 1:
            x = self._embed(target, self.tgt_embed, self.tgt_position, positions)
        else:  # one position per row, (B, C)
            x = torch.embedding(self.tgt_embed.weight, target.view(B))
            if self.embed_scale != 1.0:
                x = x * self.embed_scale
            added = self.tgt_position.embed(positions)  # (B, 1, C) | None
            if added is not None:
                x = x + added.view(B, -1)
        dtype = self._mask_dtype(x)
        mask, is_causal = attention_mask_for(span, T, causal=True, position=self.tgt_position, dtype=dtype,
                                             device=target.device, group=self.decoder_group)
        memory_mask = cache.memory_mask if cache is not None else self.memory_mask(source_mask, dtype)
        ctx = Context(mask, is_causal, self.tgt_position.rotary(positions), memory_mask=memory_mask)
        if steps is not None:
            mask, rope = ctx.mask, ctx.rope
            for block, layer, kv in zip(steps.blocks, cache.layers, cache.memory, strict=True):
                x = block(x, Context(mask, False, rope, layer, kv, memory_mask))
            cache.advance(T)
            return steps.head(steps.final_norm(x)).view(B, T, -1)
        if cache is None and plain_eval(self.decoder):  # teacher forcing in eval mode (validation, rescoring)
            for block in self.decoder:
                x = block.bind()(x, ctx._replace(memory=MemoryLayer(*block.cross_attn.memory_kv(memory))))
            return self.lm_head(self.decoder_norm(x))
        for i, block in enumerate(self.decoder):
            if cache is not None:
                layer_ctx, layer_memory = ctx._replace(cache=cache.layers[i], memory=cache.memory[i]), None
            else:
                layer_ctx, layer_memory = ctx, memory
            if self.config.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x, _ = checkpoint(block, x, layer_ctx, use_reentrant=False, memory=layer_memory)
            else:
                x, _ = block(x, layer_ctx, memory=layer_memory)
        if cache is not None:
            cache.advance(T)
        return self.lm_head(self.decoder_norm(x))

    def block_stacks(self) -> tuple[nn.ModuleList, ...]:
        """The encoder's blocks, then the decoder's (:class:`~tokenloom.models.protocol.BlockStacks`)."""
        return self.encoder, self.decoder

    def forward(self, source: Tensor, target_in: Tensor, source_mask: Tensor | None = None) -> Tensor:
        """Teacher forcing: (B, S) sources and (B, T) decoder inputs (BOS + target) -> (B, T, V) logits."""
        return self.decode(target_in, self.encode(source, source_mask), source_mask)

    # ---- decoding protocol ------------------------------------------------------------------------

    def decoder_for(self, source: Tensor, source_mask: Tensor | None = None, *,
                    chunk_overlap: int | None = None) -> Seq2SeqDecoder:
        """Encode ``source`` once and return the decoder as a decoder-only model for generation; with
        ``chunk_overlap`` a source longer than ``max_source_len`` is encoded in chunks overlapping by that many
        positions (:meth:`encode_chunked`)."""
        with torch.inference_mode():
            memory = self.encode(source, source_mask) if chunk_overlap is None else \
                self.encode_chunked(source, source_mask, overlap=chunk_overlap)
        return Seq2SeqDecoder(self, memory, source_mask)


class Seq2SeqCache(KVCache):
    """The decoder's self-attention cache plus every layer's cross-attention (k, v), each (Bm, Hkv, S, D),
    for ``Bm`` source sentences; the cache's ``B = Bm * group`` rows are that many hypotheses per sentence.

    :meth:`reorder` (beam search) may only permute rows within a sentence's group: the memory is shared.
    """

    def __init__(self, *args: Any, memory_kv: list[tuple[Tensor, Tensor]], memory_mask: Tensor | None,
                 group: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.memory = [MemoryLayer(k, v) for k, v in memory_kv]  # each layer's cross-attention strategy
        self.memory_mask, self.group = memory_mask, group

    @property
    def memory_kv(self) -> list[tuple[Tensor, Tensor]]:
        """Every layer's cross-attention (k, v), each (Bm, Hkv, S, D)."""
        return [(m.k, m.v) for m in self.memory]

    def reorder(self, index: Tensor) -> None:
        check_reorder(index, self.group, self.batch_size, "Seq2SeqCache")
        super().reorder(index)

    def select(self, index: Tensor) -> None:
        """Keep the rows ``index`` of whole sentences (each sentence's ``group`` rows, reordered within the
        group as in :meth:`reorder`) and those sentences' memory keys, values and mask."""
        sentences = kept_sentences(index, self.group, "Seq2SeqCache")
        super().select(index)
        self.memory = [MemoryLayer(m.k.index_select(0, sentences), m.v.index_select(0, sentences))
                       for m in self.memory]
        if self.memory_mask is not None:
            self.memory_mask = self.memory_mask.index_select(0, sentences)


class _DecoderConfig:
    """The parts of a config the decoding code reads."""

    def __init__(self, config: Seq2SeqConfig) -> None:
        self.vocab_size = config.vocab_size
        self.max_seq_len = config.max_target_len
        self.bos_id, self.eos_id, self.pad_id = config.bos_id, config.eos_id, config.pad_id
        # the decoder's cache shape (what the memory budget of beam search counts, tokenloom.models.sizes)
        self.num_layers, self.num_kv_heads = config.decoder_layers, config.num_kv_heads or config.num_heads
        self.head_dim = config.head_dim


class Seq2SeqDecoder:
    """An encoder-decoder's decoder bound to encoded sources, with the decoder-only model protocol."""

    def __init__(self, model: EncoderDecoder, memory: Tensor, source_mask: Tensor | None) -> None:
        self.model, self.memory, self.source_mask = model, memory, source_mask
        self.config = _DecoderConfig(model.config)

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True) -> Seq2SeqDecoder:
        self.model.train(mode)
        return self

    def eval(self) -> Seq2SeqDecoder:
        return self.train(False)

    def parameters(self):
        return self.model.parameters()

    def modules(self):
        return self.model.modules()

    def create_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> Seq2SeqCache:
        """A cache for ``batch_size`` rows: a multiple of the number of sources (beams per sentence)."""
        c, memory = self.model.config, self.memory
        Bm = memory.shape[0]
        if batch_size % Bm:
            raise GenerationError(f"batch of {batch_size} rows is not a multiple of the {Bm} encoded sources")
        with torch.inference_mode():
            memory_kv = [block.cross_attn.memory_kv(memory) for block in self.model.decoder]
            mask = self.model.memory_mask(self.source_mask, memory.dtype)
        return Seq2SeqCache(c.decoder_layers, batch_size, c.num_kv_heads or c.num_heads, max_len or c.max_target_len,
                            c.head_dim, dtype=dtype or memory.dtype, device=device or memory.device,
                            memory_kv=memory_kv, memory_mask=mask, group=batch_size // Bm)

    def __call__(self, input_ids: Tensor, *, positions: Tensor | None = None, attention_mask: Tensor | None = None,
                 cache: Seq2SeqCache | None = None) -> Tensor:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise GenerationError("decoder prompts cannot be padded (they all start with BOS)")
        if cache is None:
            B = input_ids.shape[0]
            memory, mask = self.memory, self.source_mask
            if B != memory.shape[0]:
                g = B // memory.shape[0]
                memory = memory.repeat_interleave(g, dim=0)
                mask = None if mask is None else mask.repeat_interleave(g, dim=0)
            return self.model.decode(input_ids, memory, mask, positions=positions)
        return self.model.decode(input_ids, positions=positions, cache=cache)


MODELS.register("seq2seq")((Seq2SeqConfig, EncoderDecoder))

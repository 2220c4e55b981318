"""Decoder-only Transformer language model (GPT).

Shape legend: B batch, T new positions in this call, S = cached + new positions, C embed_dim,
H num_heads, D head_dim, V vocab_size, L num_layers.

The model follows the small protocol that decoding uses (DESIGN.md)::

    logits = model(input_ids, positions=None, attention_mask=None, cache=None)   # (B, T, V)
    cache = model.create_cache(batch_size, max_len)

``cache`` is any strategy of :mod:`tokenloom.nn.kv_cache` (dense, static, ragged). A one-token step with a
cache in eval mode (the decode loop) runs each block bound as a plain function (``block.bind(rows)``): the
same body as the modules' ``forward`` without ``nn.Module`` call overhead, which dominates at one token on a
CPU. The step functions are built once per cache (:func:`tokenloom.nn.block.step_functions`); forward hooks
on any submodule switch them off (the modules are then called as usual).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..config import check
from ..errors import GenerationError
from ..nn import POSITIONS, KVCache, create_block, create_norm
from ..nn.attention import Context, MultiHeadAttention, capturing
from ..nn.block import StepFunctions, step_functions
from ..nn.dropout import Dropout
from ..nn.kv_cache import DecodeCache, RaggedView, RollingKVCache, SegmentMemory
from ..nn.masks import KeySpan, document_positions, positions_from_mask, sequence_span
from ..nn.paged import PagedView
from ..nn.quantized import embedding_rows, reference_tensor
from ..nn.sliding import Window, plan_attention
from ..nn.speedrun import UNetSkips, ValueEmbeddings
from .counting import CountsParameters
from .options import (
    attention_options,
    check_block_options,
    check_memory_options,
    check_speedrun_options,
    check_window_options,
    from_preset,
)
from .registry import MODELS, declare_decoding, declare_documents


@dataclass
class GPTConfig:
    """A decoder-only GPT: sizes, positions, norms, MLP and attention backend (``model:`` with ``family: gpt``).
    ``GPTConfig.from_name("gpt2")`` gives the GPT-2 shapes."""

    vocab_size: int = 65  # number of token ids
    num_layers: int = 6  # Transformer blocks
    num_heads: int = 6  # query heads per attention layer
    num_kv_heads: int | None = None  # key/value heads (grouped-query attention); None = num_heads
    embed_dim: int = 384  # width of the residual stream, C
    max_seq_len: int = 256  # longest context the model accepts
    position: str = "learned"  # sinusoidal | learned | rope | alibi | t5 | xl (Transformer-XL) | none
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_placement: str = "pre"  # pre (GPT-2) | post (original Transformer)
    norm_eps: float = 1e-5  # epsilon of every norm layer
    mlp: str = "gelu"  # gelu | gelu_tanh | relu | relu2 (ReLU squared, the modded-nanogpt speedrun's) | silu | swiglu
    mlp_ratio: float = 4.0  # MLP hidden width = mlp_ratio * embed_dim (swiglu: 2/3 of it, a multiple of 8)
    mlp_hidden_dim: int | None = None  # exact MLP hidden width (swiglu: gate/up width); None = from mlp_ratio
    attention: str = "sdpa"  # attention backend: sdpa (fused) | math (explicit, can return weights) | performer
    attention_options: dict | None = None  # the backend's own options: performer {features, redraw}, linformer {k}
    attention_window: int | None = None  # sliding window: each position sees itself and the W - 1 before it
    #   (Mistral's sliding_window); None = the whole context. Decoding keeps a rolling cache of W positions, and
    #   with a position scheme that extrapolates (rope, alibi, t5, none) runs past max_seq_len
    attention_global: int = 0  # with a window: the first k positions stay visible to every query (attention sinks)
    memory_len: int = 0  # Transformer-XL: each layer also attends to the keys and values of the previous
    #   memory_len positions (earlier segments, detached), carried by a SegmentMemory cache; needs a relative
    #   position (xl, alibi, t5) or none, and data.order: stream in training
    dropout: float = 0.0  # dropout on embeddings, attention probabilities and residual branches
    attention_dropout: float | None = None  # dropout on attention probabilities; None = dropout (on CPU the
    #   random masks over (B, H, T, T) probabilities can cost a third of a training step)
    bias: bool = True  # biases in linear and norm layers
    tie_embeddings: bool = True  # output projection shares the token embedding matrix
    gradient_checkpointing: bool = False  # recompute block activations in backward to save memory
    rope_base: float = 10000.0  # RoPE frequency base
    rope_scaling: dict | None = None  # RoPE frequency scaling, e.g. {type: linear, factor: 2.0}; also llama3, yarn
    qk_norm: bool = False  # normalise each head's queries and keys (the model's norm over head_dim, before RoPE
    #   and attention; OLMo-2, the speedrun): steadier attention logits at high learning rates
    logit_softcap: float | None = None  # soft-cap the output logits, cap * tanh(logits / cap) (Gemma 2, the
    #   speedrun: 30 or 15); None = uncapped. Generation and the loss both see the capped logits
    value_embeddings: int = 0  # the speedrun's value embeddings: k tables (vocab_size, Hkv * head_dim); table i
    #   feeds layers i and L - k + i, whose attention values become v + lambda_l * table[ids] (lambda_l learned,
    #   0.5 at init) before caching; 0 = none, at most num_layers
    unet_skips: bool = False  # the speedrun's U-net skips: layer L//2 + j runs on x + w_j * (the output of layer
    #   L//2 - 1 - j), j < L//2 (w_j learned, 1.0 at init)
    head_dim: int = field(init=False, default=0)  # derived: embed_dim // num_heads
    mlp_hidden: int = field(init=False, default=0)  # derived: the MLP hidden width the model builds
    max_positions: int | None = field(init=False, default=None)  # derived: the most positions a sequence may
    #   reach, max_seq_len, or None where a window lets a position scheme that extrapolates run past it

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "num_heads", "embed_dim", "max_seq_len"):
            value = getattr(self, name)
            check(value >= 1, f"{name} must be a positive integer, got {value}")
        check_block_options(self)
        check_window_options(self)
        check_memory_options(self)
        check_speedrun_options(self)
        check(self.logit_softcap is None or self.logit_softcap > 0,
              f"logit_softcap must be a positive number or null, got {self.logit_softcap}")
        extrapolates = POSITIONS.get(self.position).extrapolates
        unbounded = self.attention_window is not None or self.memory_len > 0
        self.max_positions = None if unbounded and extrapolates else self.max_seq_len

    @classmethod
    def from_name(cls, name: str, **overrides) -> GPTConfig:
        """A preset by name (see ``GPT_PRESETS``) with fields overridden."""
        return from_preset(cls, GPT_PRESETS, "GPT", name, overrides)


GPT_PRESETS: dict[str, dict] = {
    "tiny": dict(num_layers=4, num_heads=4, embed_dim=128, max_seq_len=64),
    "shakespeare-char": dict(vocab_size=65, num_layers=6, num_heads=6, embed_dim=384, max_seq_len=256),
    "gpt2": dict(vocab_size=50257, num_layers=12, num_heads=12, embed_dim=768, max_seq_len=1024,
                 mlp="gelu_tanh"),
    "gpt2-medium": dict(vocab_size=50257, num_layers=24, num_heads=16, embed_dim=1024, max_seq_len=1024,
                        mlp="gelu_tanh"),
    "llama-tiny": dict(num_layers=4, num_heads=8, num_kv_heads=2, embed_dim=256, max_seq_len=256,
                       position="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False),
    # the modded-nanogpt speedrun's model options at tiny size: ReLU^2 MLP, per-head q/k norm, soft-capped logits
    "speedrun-tiny": dict(num_layers=4, num_heads=4, embed_dim=128, max_seq_len=64, position="rope", norm="rmsnorm",
                          mlp="relu2", qk_norm=True, logit_softcap=15.0, bias=False, tie_embeddings=False),
}


def init_gpt_weights(model: nn.Module, depth: int) -> None:
    """GPT-2's initialisation: linear and embedding weights from N(0, 0.02), zero biases, and the residual
    projections (attention output, MLP output) from N(0, 0.02 / sqrt(2 * depth)), ``depth`` the blocks applied."""

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    model.apply(init)
    for name, p in model.named_parameters():
        if name.endswith(("out_proj.weight", "fc_out.weight")):
            nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * depth))


def causal_span(input_ids: Tensor, positions: Tensor | None, attention_mask: Tensor | None,
                cache: DecodeCache | None, position: nn.Module, max_positions: int | None,
                max_seq_len: int, documents: Tensor | None = None) -> tuple[KeySpan, Tensor]:
    """The key span of a causal LM's call over ``cache`` (None: the whole sequence) and the (B, T) positions of its
    queries (given, or counted from the cache and the (B, S) ``attention_mask``). Refuses a sequence past the
    context (``max_positions``, the cache's capacity) and grows ``position``'s tables past ``max_seq_len`` where the
    scheme extrapolates. ``documents`` (B, T): packed rows' example ids (0 = padding; whole sequences only):
    attention stays inside an example and positions restart at 0 with each one unless given. Shared by the causal
    LMs (GPT, the Universal Transformer)."""
    B, T = input_ids.shape
    if documents is not None:
        if cache is not None:
            raise ValueError("documents (packed examples) apply to whole-sequence forwards, not to calls with a cache")
        if positions is None:
            positions = document_positions(documents)
    span = cache.span(T, attention_mask) if cache is not None else sequence_span(T, attention_mask, documents)
    if span.extent is not None:
        capacity = cache.max_len if cache is not None else None
        limits = [n for n in (max_positions, capacity) if n is not None]
        if limits and span.extent > min(limits):
            raise GenerationError(f"sequence of {span.extent} positions exceeds the model's context of "
                                  f"{min(limits)}")
        if span.extent > max_seq_len:
            position.reserve(span.extent)
    if positions is None:
        if span.past is None:
            positions = span.queries.expand(B, T)
        elif attention_mask is not None:
            positions = positions_from_mask(attention_mask)[:, span.past:]
        else:
            positions = torch.arange(span.past, span.keys, device=input_ids.device)[None].expand(B, T)
    return span, positions


def mask_dtype(x: Tensor) -> torch.dtype:
    """The dtype of the attention masks for hidden states ``x``: the CPU autocast dtype inside autocast."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") and x.device.type == "cpu" \
        else x.dtype


def causal_context(span: KeySpan, positions: Tensor, T: int, position: nn.Module, window: Window | None,
                   dtype: torch.dtype, need_weights: bool = False) -> Context:
    """The attention :class:`~tokenloom.nn.attention.Context` of a causal call (mask, rotary angles of the (B, T)
    ``positions``), built once and shared by every layer (:func:`~tokenloom.nn.sliding.plan_attention`)."""
    mask, is_causal, band = plan_attention(span, T, causal=True, window=window, position=position, dtype=dtype,
                                           device=positions.device, banded=not need_weights and not capturing())
    return Context(mask, is_causal, position.rotary(positions), ragged=span.ragged, band=band)


STEP_POSITIONS = 16  # the most positions per row a cached eval call runs through the plain step functions (more:
#   the modules); a verification pass of 2-9 positions on the 6 x 384 Shakespeare model ran ~20% faster so


def attention_builder(c: GPTConfig) -> Callable[..., nn.Module]:
    """The blocks' attention builder: :class:`MultiHeadAttention`, given per-head query/key norms (the model's
    ``norm`` over head_dim) when ``qk_norm``."""
    if not c.qk_norm:
        return MultiHeadAttention
    return partial(MultiHeadAttention, qk_norm=partial(create_norm, c.norm, bias=False, eps=c.norm_eps))


@declare_documents
@declare_decoding("causal_lm")
class GPT(CountsParameters, nn.Module):
    """Token embedding (+ positions) -> L blocks -> final norm -> vocabulary logits."""

    quantizable_embedding = "tok_embed"  # read only through nn.quantized.embedding_rows: it may be an int8 one

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.tok_embed = nn.Embedding(c.vocab_size, c.embed_dim)
        self.position = POSITIONS.get(c.position)(
            embed_dim=c.embed_dim, num_heads=c.num_heads, head_dim=c.head_dim, max_seq_len=c.max_seq_len,
            num_layers=c.num_layers, memory_len=c.memory_len,
            **({"base": c.rope_base, "scaling": c.rope_scaling} if c.position == "rope" else {}))
        self.embed_dropout = Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            create_block(c.norm_placement, c.embed_dim, c.num_heads, c.num_kv_heads,
                         hidden_dim=c.mlp_hidden, mlp=c.mlp, norm=c.norm, attention=c.attention,
                         dropout=c.dropout, bias=c.bias, norm_eps=c.norm_eps, attention_dropout=c.attention_dropout,
                         attention_options=attention_options(c, c.max_seq_len),
                         make_attention=attention_builder(c))
            for _ in range(c.num_layers))
        # post-norm blocks end in a norm already; pre-norm needs one before the head
        self.final_norm = create_norm(c.norm, c.embed_dim, bias=c.bias, eps=c.norm_eps) \
            if c.norm_placement == "pre" else nn.Identity()
        self.lm_head = nn.Linear(c.embed_dim, c.vocab_size, bias=False)
        # the speedrun's options (tokenloom.nn.speedrun): outside the blocks, so Muon leaves them to AdamW
        kv_dim = (c.num_kv_heads or c.num_heads) * c.head_dim
        self.value_embeds = ValueEmbeddings(c.vocab_size, kv_dim, c.num_layers, c.value_embeddings) \
            if c.value_embeddings else None
        self.skips = UNetSkips(c.num_layers) if c.unet_skips else None
        init_gpt_weights(self, c.num_layers)  # the value-embedding tables too: N(0, 0.02)
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_embed.weight
        self.window = Window(c.attention_window, True, c.attention_global) if c.attention_window else None

    def embedding_tables(self) -> list[nn.Parameter]:
        """The token embedding matrix and the value-embedding tables (``value_embeddings``)."""
        values = [] if self.value_embeds is None else [table.weight for table in self.value_embeds.tables]
        return [self.tok_embed.weight, *values]

    def create_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None,
                     rolling: bool | None = None) -> KVCache | RollingKVCache | SegmentMemory:
        """A preallocated cache for ``batch_size`` sequences of up to ``max_len`` (default: max_seq_len). A model
        with an ``attention_window`` gets a :class:`~tokenloom.nn.kv_cache.RollingKVCache` of the window's
        positions where ``max_len`` is longer than that (``rolling=False``: always the dense one, e.g. for a
        server's ragged rows; ``rolling=True``: always the rolling one). A model with a ``memory_len`` gets a
        :class:`~tokenloom.nn.kv_cache.SegmentMemory` (Transformer-XL; training, evaluation and decoding alike)."""
        c = self.config
        if c.memory_len:
            return SegmentMemory(c.num_layers, batch_size, c.memory_len)
        ref = reference_tensor(self.tok_embed)
        dtype, device = dtype or ref.dtype, device or ref.device
        max_len = max_len or c.max_seq_len
        window = self.window
        if window is not None and (rolling or (rolling is None and max_len > window.size + window.globals)):
            return RollingKVCache(c.num_layers, batch_size, c.num_kv_heads or c.num_heads, window.size,
                                  window.globals, c.head_dim, dtype=dtype, device=device, limit=c.max_positions)
        return KVCache(c.num_layers, batch_size, c.num_kv_heads or c.num_heads, max_len, c.head_dim, dtype=dtype,
                       device=device)

    def forward_features(self, input_ids: Tensor, *, positions: Tensor | None = None,
                         attention_mask: Tensor | None = None, cache: DecodeCache | None = None,
                         need_weights: bool = False, documents: Tensor | None = None
                         ) -> tuple[Tensor, list[Tensor | None]]:
        """(B, T) ids -> (B, T, C) final hidden states, and per-layer attention probabilities
        (B, H, T, S) when ``need_weights`` and the backend returns them (``math``).

        ``attention_mask`` (B, S) marks real tokens (1) and padding (0) over cached + new positions. ``cache`` is
        any cache strategy (:mod:`tokenloom.nn.kv_cache`): dense, static (a compiled step) or ragged (a server's
        rows at different lengths; ``positions`` then given). A one-token step in eval mode runs the blocks as
        plain functions (:func:`~tokenloom.nn.block.step_functions`), the same bodies as the modules.
        ``documents`` (B, T): packed examples' ids (0 = padding) of a whole-sequence pass; attention does not cross
        examples and positions restart with each (:func:`causal_span`).
        """
        return self._features(input_ids, positions, attention_mask, cache, need_weights,
                              self.decode_steps(cache, input_ids.shape[1], need_weights), documents)

    def layer_inputs(self, input_ids: Tensor, positions: Tensor | None, attention_mask: Tensor | None,
                     cache: DecodeCache | None, need_weights: bool = False,
                     steps: StepFunctions | None = None, documents: Tensor | None = None
                     ) -> tuple[Tensor, list[Context]]:
        """What the blocks run on: the embedded (B, T) ids, (B, T, C) ((B, C) for the plain one-token ``steps``),
        and each layer's attention :class:`~tokenloom.nn.attention.Context` (mask, rotary angles, its cache
        layer; with ``value_embeddings`` its rows lambda_l * table[ids], (B, T, Hkv * D), or None). The caller runs
        the layers and then advances ``cache`` by T (:meth:`_features`; early exit,
        :mod:`tokenloom.generation.early_exit`)."""
        B, T = input_ids.shape
        position = self.position
        span, positions = causal_span(input_ids, positions, attention_mask, cache, position,
                                      self.config.max_positions, self.config.max_seq_len, documents)
        device = input_ids.device
        x = self.tok_embed(input_ids) if steps is None else embedding_rows(self.tok_embed, input_ids)
        added = position.embed(positions)
        if added is not None:
            x = x + added
        if self.training:
            x = self.embed_dropout(x)
        ctx = causal_context(span, positions, T, position, self.window, mask_dtype(x), need_weights)
        layers = cache.layers if cache is not None else [None] * len(self.blocks)
        relatives = [None] * len(self.blocks)
        if position.has_relative:  # Transformer-XL's query-dependent term, for the queries at these key indices
            q_index = span.queries if span.queries is not None else \
                torch.arange(span.past, span.keys, device=device)[None]
            relatives = [position.relative(i, q_index) for i in range(len(self.blocks))]
        values = self.value_embeds(input_ids) if self.value_embeds is not None else [None] * len(self.blocks)
        parts = zip(layers, relatives, values, strict=True)
        if steps is not None and T == 1:  # (B, C): the step functions take one position per row
            mask, rope = ctx.mask, ctx.rope
            return x.view(B, -1), [Context(mask, False, rope, layer, ragged=span.ragged, band=ctx.band,
                                           relative=relative, value_embed=value)
                                   for layer, relative, value in parts]
        return x, [ctx._replace(cache=layer, relative=relative, value_embed=value) for layer, relative, value in parts]

    def _features(self, input_ids: Tensor, positions: Tensor | None, attention_mask: Tensor | None,
                  cache: DecodeCache | None, need_weights: bool,
                  steps: StepFunctions | None, documents: Tensor | None = None) -> tuple[Tensor, list[Tensor | None]]:
        """:meth:`forward_features` with the step functions looked up (None: the modules run): the one block loop,
        with the U-net skips (``unet_skips``) around each layer, x = skips.enter(i, x, kept) before it and the
        first half's outputs kept after it (:class:`~tokenloom.nn.speedrun.UNetSkips`)."""
        B, T = input_ids.shape
        x, contexts = self.layer_inputs(input_ids, positions, attention_mask, cache, need_weights, steps, documents)
        skips, kept = self.skips, []  # U-net skips (unet_skips): the first half's outputs, kept for the second
        if steps is not None:
            for i, (block, layer_ctx) in enumerate(zip(steps.blocks, contexts, strict=True)):
                if skips is not None:
                    x = skips.enter(i, x, kept)
                x = block(x, layer_ctx)
                if skips is not None:
                    skips.leave(i, x, kept)
            cache.advance(T)
            return steps.final_norm(x).view(B, T, -1), [None] * len(steps.blocks)
        weights = []
        for i, (block, layer_ctx) in enumerate(zip(self.blocks, contexts, strict=True)):
            if skips is not None:
                x = skips.enter(i, x, kept)
            if self.config.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x, w = checkpoint(block, x, layer_ctx, use_reentrant=False, need_weights=need_weights)
            else:
                x, w = block(x, layer_ctx, need_weights=need_weights)
            if skips is not None:
                skips.leave(i, x, kept)
            weights.append(w)
        if cache is not None:
            cache.advance(T)
        return self.final_norm(x), weights

    def decode_steps(self, cache: DecodeCache | None, T: int, need_weights: bool = False) -> StepFunctions | None:
        """The plain step functions for ``cache`` and T positions per row, or None where the modules run (training,
        more than :data:`STEP_POSITIONS` positions, weights asked for, a cache strategy that wants the modules, forward
        hooks). T > 1 is a call of a few positions after cached ones in a dense cache, or a server's ragged or paged
        rows (speculative verifications of k drafts, short prompt chunks): the same functions over B * T rows, with
        the call's causal context; a dense prefill (nothing cached yet) runs the modules, as whole sequences do."""
        if not 1 <= T <= STEP_POSITIONS or cache is None or not cache.plain or need_weights or self.training:
            return None
        if T > 1 and not (isinstance(cache, KVCache) and cache.length) and \
                not isinstance(cache, (RaggedView, PagedView)):
            return None
        return step_functions(self, cache, self._decoder_parts, T,
                              logits=None if self.config.logit_softcap is None else self.cap_logits)

    def _decoder_parts(self) -> tuple[nn.ModuleList, nn.Module, nn.Linear]:
        return self.blocks, self.final_norm, self.lm_head

    def forward_head(self, hidden: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, V) logits (soft-capped with ``logit_softcap``)."""
        return self.cap_logits(self.lm_head(hidden))

    def cap_logits(self, logits: Tensor) -> Tensor:
        """``cap * tanh(logits / cap)`` with ``config.logit_softcap``, else ``logits``: the one cap both the module
        head (:meth:`forward_head`) and the plain step head (:meth:`decode_steps`) apply."""
        cap = self.config.logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def forward(self, input_ids: Tensor, *, positions: Tensor | None = None, attention_mask: Tensor | None = None,
                cache: DecodeCache | None = None, documents: Tensor | None = None) -> Tensor:
        """(B, T) token ids -> (B, T, V) logits. With a Transformer-XL memory, T longer than ``max_seq_len`` (a long
        prompt) runs as consecutive segments of ``max_seq_len``, the memory carried from one to the next.
        ``documents`` (B, T): packed examples' ids (see :meth:`forward_features`)."""
        segment = self.config.max_seq_len
        if isinstance(cache, SegmentMemory) and input_ids.shape[1] > segment:
            return torch.cat([self(part, cache=cache) for part in input_ids.split(segment, dim=1)], dim=1)
        steps = self.decode_steps(cache, input_ids.shape[1])
        hidden, _ = self._features(input_ids, positions, attention_mask, cache, False, steps, documents)
        if steps is None:
            return self.forward_head(hidden)
        return steps.head(hidden[:, 0])[:, None] if hidden.shape[1] == 1 else steps.head(hidden)


MODELS.register("gpt")((GPTConfig, GPT))

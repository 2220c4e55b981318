"""Decoder-only Transformer language model (GPT).

Shape legend: B batch, T new positions in this call, S = cached + new positions, C embed_dim,
H num_heads, D head_dim, V vocab_size, L num_layers.

The model follows the small protocol that decoding uses (DESIGN.md)::

    logits = model(input_ids, positions=None, attention_mask=None, cache=None)   # (B, T, V)
    cache = model.create_cache(batch_size, max_len)

A one-token step with a cache in eval mode (the decode loop) runs each block's ``inference_step``: the
same computation as the modules' ``forward`` without ``nn.Module`` call overhead, which dominates at
one token on a CPU. The step functions are built once per cache and kept on ``cache.plan``; forward
hooks on any submodule switch this off (the modules are then called as usual).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..config import check
from ..errors import GenerationError
from ..nn import POSITIONS, KVCache, create_block, create_norm
from ..nn.block import DecodePlan, has_forward_hooks, inference_function
from ..nn.dropout import Dropout
from ..nn.fused import decode_linear
from ..nn.masks import additive_mask, causal_mask, padding_mask, positions_from_mask
from ..nn.positions import Position
from .options import attention_options, check_block_options, from_preset
from .registry import MODELS, declare_decoding


@dataclass
class GPTConfig:
    vocab_size: int = 65  # number of token ids
    num_layers: int = 6  # Transformer blocks
    num_heads: int = 6  # query heads per attention layer
    num_kv_heads: int | None = None  # key/value heads (grouped-query attention); None = num_heads
    embed_dim: int = 384  # width of the residual stream, C
    max_seq_len: int = 256  # longest context the model accepts
    position: str = "learned"  # sinusoidal | learned | rope | alibi | t5 | none
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_placement: str = "pre"  # pre (GPT-2) | post (original Transformer)
    norm_eps: float = 1e-5  # epsilon of every norm layer
    mlp: str = "gelu"  # gelu | gelu_tanh | relu | swiglu
    mlp_ratio: float = 4.0  # MLP hidden width = mlp_ratio * embed_dim (swiglu: 2/3 of it, a multiple of 8)
    mlp_hidden_dim: int | None = None  # exact MLP hidden width (swiglu: gate/up width); None = from mlp_ratio
    attention: str = "sdpa"  # attention backend: sdpa (fused) | math (explicit, can return weights) | performer
    performer_features: int = 0  # attention performer: random features per head; 0 = round(head_dim * ln head_dim)
    performer_redraw: int = 0  # attention performer: draw new features every N training calls; 0 = never
    linformer_k: int = 64  # attention linformer: positions the keys and values are projected to
    dropout: float = 0.0  # dropout on embeddings, attention probabilities and residual branches
    attention_dropout: float | None = None  # dropout on attention probabilities; None = dropout (on CPU the
    #   random masks over (B, H, T, T) probabilities can cost a third of a training step)
    bias: bool = True  # biases in linear and norm layers
    tie_embeddings: bool = True  # output projection shares the token embedding matrix
    gradient_checkpointing: bool = False  # recompute block activations in backward to save memory
    rope_base: float = 10000.0  # RoPE frequency base
    rope_scaling: dict | None = None  # RoPE frequency scaling, e.g. {type: linear, factor: 2.0}; also llama3, yarn
    head_dim: int = field(init=False, default=0)  # derived: embed_dim // num_heads
    mlp_hidden: int = field(init=False, default=0)  # derived: the MLP hidden width the model builds

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "num_heads", "embed_dim", "max_seq_len"):
            value = getattr(self, name)
            check(value >= 1, f"{name} must be a positive integer, got {value}")
        check_block_options(self)

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
}


@declare_decoding("causal_lm")
class GPT(nn.Module):
    """Token embedding (+ positions) -> L blocks -> final norm -> vocabulary logits."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.tok_embed = nn.Embedding(c.vocab_size, c.embed_dim)
        self.position = POSITIONS.get(c.position)(
            embed_dim=c.embed_dim, num_heads=c.num_heads, head_dim=c.head_dim, max_seq_len=c.max_seq_len,
            **({"base": c.rope_base, "scaling": c.rope_scaling} if c.position == "rope" else {}))
        self.embed_dropout = Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            create_block(c.norm_placement, c.embed_dim, c.num_heads, c.num_kv_heads,
                         hidden_dim=c.mlp_hidden, mlp=c.mlp, norm=c.norm, attention=c.attention,
                         dropout=c.dropout, bias=c.bias, norm_eps=c.norm_eps, attention_dropout=c.attention_dropout,
                         attention_options=attention_options(c, c.max_seq_len))
            for _ in range(c.num_layers))
        # post-norm blocks end in a norm already; pre-norm needs one before the head
        self.final_norm = create_norm(c.norm, c.embed_dim, bias=c.bias, eps=c.norm_eps) \
            if c.norm_placement == "pre" else nn.Identity()
        self.lm_head = nn.Linear(c.embed_dim, c.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by 1/sqrt(2L)
            if name.endswith(("out_proj.weight", "fc_out.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.num_layers))
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_embed.weight
        self._position_bias = type(self.position).bias is not Position.bias  # alibi, t5: a score bias

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.tok_embed.weight.numel()
        return n

    def create_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None) -> KVCache:
        """A preallocated cache for ``batch_size`` sequences of up to ``max_len`` (default: max_seq_len)."""
        c = self.config
        ref = self.tok_embed.weight
        return KVCache(c.num_layers, batch_size, c.num_kv_heads or c.num_heads, max_len or c.max_seq_len,
                       c.head_dim, dtype=dtype or ref.dtype, device=device or ref.device)

    def _attention_inputs(self, T: int, past: int, attention_mask: Tensor | None, device: torch.device,
                          dtype: torch.dtype) -> tuple[Tensor | None, bool]:
        """The mask every layer uses, built once per forward: (attn_mask, is_causal)."""
        S = past + T
        bias = None
        if self._position_bias:
            index = torch.arange(S, device=device)
            bias = self.position.bias(index[past:], index)  # (1, H, T, S) or None
        if bias is None and attention_mask is None:
            if T == 1:
                return None, False
            if past == 0:
                return None, True  # the fused kernels' own causal path
            return causal_mask(T, S, device), False
        allowed = causal_mask(T, S, device)[None, None] if T > 1 else None
        if attention_mask is not None:
            pad = padding_mask(attention_mask)
            allowed = pad if allowed is None else allowed & pad
        mask = None
        if allowed is not None:
            mask = additive_mask(allowed, dtype)
        if bias is not None:
            mask = bias.to(dtype) if mask is None else mask + bias.to(dtype)
        return mask, False

    def forward_features(self, input_ids: Tensor, *, positions: Tensor | None = None,
                         attention_mask: Tensor | None = None, cache: KVCache | None = None,
                         need_weights: bool = False) -> tuple[Tensor, list[Tensor | None]]:
        """(B, T) ids -> (B, T, C) final hidden states, and per-layer attention probabilities
        (B, H, T, S) when ``need_weights`` and the backend returns them (``math``).

        ``attention_mask`` (B, S) marks real tokens (1) and padding (0) over cached + new positions.
        """
        B, T = input_ids.shape
        past = cache.length if cache is not None else 0
        S = past + T
        if S > self.config.max_seq_len or (cache is not None and S > cache.max_len):
            limit = min(self.config.max_seq_len, cache.max_len if cache is not None else self.config.max_seq_len)
            raise GenerationError(f"sequence of {S} positions exceeds the model's context of {limit}")
        device = input_ids.device
        if positions is None:
            if attention_mask is not None:
                positions = positions_from_mask(attention_mask)[:, past:]
            else:
                positions = torch.arange(past, S, device=device)[None].expand(B, T)
        plan = None
        if T == 1 and cache is not None and not need_weights and not self.training:
            plan = (cache.plan if cache.plan is not None else self._decode_plan(cache)) or None
        x = self.tok_embed(input_ids) if plan is None else plan.embed(input_ids)  # (B, T, C)
        added = self.position.embed(positions)
        if added is not None:
            x = x + added
        if self.training:
            x = self.embed_dropout(x)
        rope = self.position.rotary(positions)
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") and device.type == "cpu" \
            else x.dtype
        attn_mask, is_causal = self._attention_inputs(T, past, attention_mask, device, dtype)
        if plan is not None:
            x = x.view(B, -1)  # (B, C): the step functions take one position per row
            for step in plan.steps:
                x = step(x, past, attn_mask, rope)
            cache.advance(1)
            return plan.final_norm(x).view(B, 1, -1), [None] * len(plan.steps)
        weights = []
        for i, block in enumerate(self.blocks):
            kwargs = dict(attn_mask=attn_mask, is_causal=is_causal, rope=rope,
                          kv_cache=cache.layer(i) if cache is not None else None, cache_pos=past,
                          need_weights=need_weights)
            if self.config.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x, w = checkpoint(block, x, use_reentrant=False, **kwargs)
            else:
                x, w = block(x, **kwargs)
            weights.append(w)
        if cache is not None:
            cache.advance(T)
        return self.final_norm(x), weights

    def static_step(self, input_ids: Tensor, positions: Tensor, pos: Tensor, key_mask: Tensor | None,
                    layers: list[tuple[Tensor, Tensor]]) -> Tensor:
        """One eval-mode decode position per row with static shapes, for ``torch.compile`` (the same function
        of its inputs at every step, so it compiles once): (B, 1) ids at (B, 1) ``positions`` -> (B, V) logits.

        ``layers`` holds each layer's cached keys and values, (B, Hkv, M, D) each, separate tensors (a compiled
        step writes them in place; views of one storage would be copied whole); the new keys and values are
        written at position ``pos`` ((1,) long tensor) and attention runs over all M positions with a mask that
        allows those ``<= pos`` and, per row, ``key_mask`` (B, M) (False = padding) where given. The caller
        advances the cache. :func:`tokenloom.generation.generate` runs it with ``compile=True``
        (:mod:`tokenloom.generation.compiled`).
        """
        x = self.tok_embed(input_ids)  # (B, 1, C)
        added = self.position.embed(positions)
        if added is not None:
            x = x + added
        rope = self.position.rotary(positions)
        index = torch.arange(layers[0][0].shape[-2], device=input_ids.device)  # (M,)
        allowed = (index <= pos)[None]  # (1, M)
        if key_mask is not None:
            allowed = allowed & key_mask  # (B, M)
        mask = additive_mask(allowed[:, None, None, :], x.dtype)  # (B|1, 1, 1, M)
        if self._position_bias:
            bias = self.position.bias(pos, index)  # (1, H, 1, M) | None
            if bias is not None:
                mask = mask + bias.to(x.dtype)
        for i, block in enumerate(self.blocks):
            x, _ = block(x, attn_mask=mask, rope=rope, kv_cache=layers[i], cache_pos=pos)
        return self.lm_head(self.final_norm(x))[:, 0]

    def ragged_plan(self, kv: Tensor) -> DecodePlan | None:
        """The plain step functions of :meth:`ragged_step` over ``kv`` (L, 2, B, Hkv, M, D) (e.g. the first B
        rows of a server's cache); None when forward hooks watch the modules (call the modules then)."""
        if has_forward_hooks(self):
            return None
        steps = [block.inference_step(kv[i]) for i, block in enumerate(self.blocks)]
        if None in steps:
            return None
        head = self.lm_head
        return DecodePlan(steps=steps, final_norm=inference_function(self.final_norm),
                          embed=partial(torch.embedding, self.tok_embed.weight),
                          head=decode_linear(head.weight, head.bias, rows=kv.shape[2]))

    def ragged_step(self, input_ids: Tensor, lengths: Tensor, kv: Tensor, plan: DecodePlan | None = None) -> Tensor:
        """One eval-mode decode position for rows at different lengths (continuous batching): (B, 1) ids of
        rows whose cached lengths are ``lengths`` (B,) -> (B, V) logits. ``kv`` (L, 2, B, Hkv, M, D) holds the
        rows' cached keys and values (row b's sequence at positions [0, lengths[b])); row b's new key and value
        are written at ``lengths[b]``, which is also its position. The caller advances the lengths. ``plan``
        (:meth:`ragged_plan` over the same ``kv``) runs the steps as plain functions; without it the modules
        are called. Positions added to the embeddings or rotating q/k work; a score bias (alibi, t5) is added
        per row."""
        B = input_ids.shape[0]
        positions = lengths.view(B, 1)
        S = int(lengths.max()) + 1
        index = torch.arange(S, device=input_ids.device)
        dtype = self.tok_embed.weight.dtype
        mask = additive_mask((index[None] <= positions)[:, None, None, :], dtype)  # (B, 1, 1, S)
        if self._position_bias:
            bias = self.position.bias(index, index)  # (1, H, S, S): row b's query sits at lengths[b]
            if bias is not None:
                mask = mask + bias[0, :, lengths].transpose(0, 1)[:, :, None, :].to(dtype)  # (B, H, 1, S)
        rope = self.position.rotary(positions)
        added = self.position.embed(positions)
        if plan is not None:
            x = plan.embed(input_ids[:, 0])  # (B, C)
            if added is not None:
                x = x + added[:, 0]
            for step in plan.steps:
                x = step(x, positions, mask, rope)
            return plan.head(plan.final_norm(x))
        x = self.tok_embed(input_ids)  # (B, 1, C)
        if added is not None:
            x = x + added
        for i, block in enumerate(self.blocks):
            x, _ = block(x, attn_mask=mask, rope=rope, kv_cache=(kv[i, 0], kv[i, 1]), cache_pos=positions)
        return self.lm_head(self.final_norm(x))[:, 0]

    def _decode_plan(self, cache: KVCache) -> DecodePlan | bool:
        """Build the :class:`DecodePlan` bound to ``cache`` and keep it on ``cache.plan``; False (call the
        modules) when a submodule has forward hooks or a block has no ``inference_step``."""
        hooked = has_forward_hooks(self)
        steps = [] if hooked else [getattr(b, "inference_step", lambda kv: None)(cache.layer_kv(i))
                                   for i, b in enumerate(self.blocks)]
        cache.plan = False
        if not hooked and None not in steps:
            head = self.lm_head
            cache.plan = DecodePlan(steps=steps, final_norm=inference_function(self.final_norm),
                                    embed=partial(torch.embedding, self.tok_embed.weight),
                                    head=decode_linear(head.weight, head.bias, rows=cache.batch_size))
        return cache.plan

    def forward_head(self, hidden: Tensor) -> Tensor:
        """(B, T, C) -> (B, T, V) logits."""
        return self.lm_head(hidden)

    def forward(self, input_ids: Tensor, *, positions: Tensor | None = None, attention_mask: Tensor | None = None,
                cache: KVCache | None = None) -> Tensor:
        """(B, T) token ids -> (B, T, V) logits."""
        hidden, _ = self.forward_features(input_ids, positions=positions, attention_mask=attention_mask,
                                          cache=cache)
        plan = cache.plan if cache is not None and hidden.shape[1] == 1 else None
        return plan.head(hidden[:, 0])[:, None] if plan else self.forward_head(hidden)  # the plan's on (B, C)


MODELS.register("gpt")((GPTConfig, GPT))

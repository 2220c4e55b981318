"""Transformer blocks: attention and MLP sublayers with residuals, norm placement by name.

* ``pre`` (GPT-2, most modern models): ``x = x + attn(norm1(x)); x = x + mlp(norm2(x))``.
* ``post`` (the original Transformer): ``x = norm1(x + attn(x)); x = norm2(x + mlp(x))``.

A decoder block of an encoder-decoder model adds a cross-attention sublayer between the two.
Shapes: x (B, T, C); memory (B, S, C).

``inference_step(kv, memory_kv, memory_mask)`` returns a plain function for one eval-mode decode step of
a block over its self-attention cache ``kv`` (and, for a decoder block with cross-attention, the memory's
precomputed keys and values and its additive mask), on x (B, C) (one position per row), computed without
``nn.Module`` call overhead; see :meth:`MultiHeadAttention.inference_step` and
:meth:`MultiHeadAttention.cross_inference_step`. A cross-attention block given no ``memory_kv`` returns None.

``sequence_eval(x, attn_mask, is_causal, rope, memory_kv, memory_mask)`` is ``forward(x, ...)[0]`` for
eval-mode passes over whole sequences (an encoder, a non-autoregressive decoder, teacher forcing) as plain
method calls, without the ``nn.Module`` call overhead; :func:`plain_eval` tells when callers may use it.

``forward(x, queries=n)`` lets only the first ``n`` positions query (a class token's last layer): (B, n, C).
In eval mode the residual adds are fused into the sublayers' last linear layers where :mod:`.fused` can.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor, nn

from ..registry import Registry
from .attention import MultiHeadAttention
from .dropout import Dropout
from .mlp import create_mlp
from .norms import create_norm

BLOCKS: Registry[type[nn.Module]] = Registry("norm placement")


Rope = tuple[Tensor, Tensor] | None
StepFunction = Callable[[Tensor, int, Tensor | None, Rope], Tensor]


class DecodePlan(NamedTuple):
    """Plain functions for one-token eval steps of a decoder, bound to one cache (kept on ``cache.plan``)."""

    steps: list[StepFunction]  # per block: (x (B, C), pos, attn_mask, rope) -> (B, C)
    final_norm: Callable[[Tensor], Tensor]
    embed: Callable[[Tensor], Tensor]  # ids (any shape) -> embeddings (..., C)
    head: Callable[[Tensor], Tensor]  # (..., C) -> (..., V)


def has_forward_hooks(module: nn.Module) -> bool:
    """True when a submodule of ``module`` (not itself) or the global registry has forward (pre-)hooks: a
    decode plan or a plain eval pass would bypass them, so the modules must be called as usual."""
    return _global_hooks() or _below(module, training=False)


def plain_eval(module: nn.Module) -> bool:
    """Whether the blocks of ``module`` may run as plain method calls (:meth:`PreNormBlock.sequence_eval`): it
    and every submodule in eval mode, and no forward hooks that the plain calls would bypass."""
    return not module.training and not _global_hooks() and not _below(module, training=True)


def _global_hooks() -> bool:
    return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


def _below(module: nn.Module, training: bool) -> bool:
    """Whether a submodule has forward (pre-)hooks, or (``training``) is in training mode: a walk over the
    ``_modules`` dicts, 4x cheaper than ``module.modules()`` (no memo set, no names)."""
    for child in module._modules.values():
        if child is not None and ((training and child.training) or child._forward_hooks
                                  or child._forward_pre_hooks or _below(child, training)):
            return True
    return False


def inference_function(module: nn.Module, **kwargs) -> Callable[[Tensor], Tensor]:
    """``module.inference_function(**kwargs)`` where the module offers one (a plain eval-mode function), else
    the module itself."""
    make = getattr(module, "inference_function", None)
    return make(**kwargs) if make is not None else module


class _Block(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, *, hidden_dim: int,
                 mlp: str = "gelu", norm: str = "layernorm", attention: str = "sdpa", dropout: float = 0.0,
                 bias: bool = True, cross_attention: bool = False, norm_eps: float | None = None,
                 attention_dropout: float | None = None, attention_options: dict | None = None) -> None:
        super().__init__()
        attention_dropout = dropout if attention_dropout is None else attention_dropout
        self.attn = MultiHeadAttention(embed_dim, num_heads, num_kv_heads, bias=bias, dropout=attention_dropout,
                                       backend=attention, attention_options=attention_options)
        self.norm1 = create_norm(norm, embed_dim, bias=bias, eps=norm_eps)
        if cross_attention:
            self.cross_attn = MultiHeadAttention(embed_dim, num_heads, num_kv_heads, bias=bias,
                                                 dropout=attention_dropout, backend=attention, cross=True,
                                                 attention_options=attention_options)
            self.norm_cross = create_norm(norm, embed_dim, bias=bias, eps=norm_eps)
        else:
            self.cross_attn = None
        self.mlp = create_mlp(mlp, embed_dim, hidden_dim, bias=bias, dropout=dropout)
        self.norm2 = create_norm(norm, embed_dim, bias=bias, eps=norm_eps)
        self.resid_dropout = Dropout(dropout)

    def residual_form(self) -> bool:
        """In eval mode (dropout off) each residual add is handed to the sublayer (``residual=``, ``add_to``) so
        it can be fused into the sublayer's last linear layer (:mod:`.fused`); not when hooks watch the
        submodules (the fused kernels would bypass them)."""
        return not self.training and not has_forward_hooks(self)

    def mlp_add(self, residual: Tensor, x: Tensor) -> Tensor:
        """``residual + mlp(x)`` through the MLP's ``add_to`` where it has one."""
        add_to = getattr(self.mlp, "add_to", None)
        return add_to(residual, x) if add_to is not None else residual + self.mlp(x)

    def _inference_parts(self, kv: Tensor, memory_kv: tuple[Tensor, Tensor] | None,
                         memory_mask: Tensor | None) -> tuple[Callable, ...] | None:
        """(attention step over ``kv``, norm1, cross-attention step | None, its norm | None, norm2, mlp) as
        plain functions for a decode step; None when the block has cross-attention but no ``memory_kv``."""
        cross = cross_norm = None
        if self.cross_attn is not None:
            if memory_kv is None:
                return None
            cross = self.cross_attn.cross_inference_step(memory_kv, memory_mask)
            cross_norm = inference_function(self.norm_cross)
        return (self.attn.inference_step(kv), inference_function(self.norm1), cross, cross_norm,
                inference_function(self.norm2), inference_function(self.mlp, rows=kv.shape[1]))


@BLOCKS.register("pre")
class PreNormBlock(_Block):
    def forward(self, x: Tensor, *, memory: Tensor | None = None, memory_mask: Tensor | None = None,
                memory_kv: tuple[Tensor, Tensor] | None = None, need_weights: bool = False,
                queries: int | None = None, **attn_kwargs) -> tuple[Tensor, Tensor | None]:
        keep = x if queries is None else x[:, :queries]
        if self.residual_form():
            x, weights = self.attn(self.norm1(x), need_weights=need_weights, residual=keep, queries=queries,
                                   **attn_kwargs)
            if self.cross_attn is not None:
                x, _ = self.cross_attn(self.norm_cross(x), memory=memory, memory_kv=memory_kv,
                                       attn_mask=memory_mask, residual=x)
            return self.mlp_add(x, self.norm2(x)), weights
        h, weights = self.attn(self.norm1(x), need_weights=need_weights, queries=queries, **attn_kwargs)
        x = keep + self.resid_dropout(h)
        if self.cross_attn is not None:
            h, _ = self.cross_attn(self.norm_cross(x), memory=memory, memory_kv=memory_kv, attn_mask=memory_mask)
            x = x + self.resid_dropout(h)
        return x + self.mlp(self.norm2(x)), weights

    def sequence_eval(self, x: Tensor, attn_mask: Tensor | None, is_causal: bool, rope: Rope,
                      memory_kv: tuple[Tensor, Tensor] | None = None, memory_mask: Tensor | None = None) -> Tensor:
        """``forward(x, ...)[0]`` in eval mode as plain method calls (see :func:`plain_eval`); a block with
        cross-attention reads ``memory_kv`` (its :meth:`MultiHeadAttention.memory_kv`)."""
        x = self.attn.sequence_eval(self.norm1.forward(x), attn_mask, is_causal, rope, x)
        if self.cross_attn is not None:
            x = self.cross_attn.sequence_eval(self.norm_cross.forward(x), memory_mask, False, None, x, memory_kv)
        return self.mlp_add(x, self.norm2.forward(x))

    def inference_step(self, kv: Tensor, memory_kv: tuple[Tensor, Tensor] | None = None,
                       memory_mask: Tensor | None = None) -> StepFunction | None:
        parts = self._inference_parts(kv, memory_kv, memory_mask)
        if parts is None:
            return None
        attn, norm1, cross, cross_norm, norm2, mlp = parts

        if cross is None:
            def step(x: Tensor, pos: int, attn_mask: Tensor | None, rope: Rope) -> Tensor:
                x = x + attn(norm1(x), pos, attn_mask, rope)
                return x + mlp(norm2(x))
        else:
            def step(x: Tensor, pos: int, attn_mask: Tensor | None, rope: Rope) -> Tensor:
                x = x + attn(norm1(x), pos, attn_mask, rope)
                x = x + cross(cross_norm(x))
                return x + mlp(norm2(x))

        return step


@BLOCKS.register("post")
class PostNormBlock(_Block):
    def forward(self, x: Tensor, *, memory: Tensor | None = None, memory_mask: Tensor | None = None,
                memory_kv: tuple[Tensor, Tensor] | None = None, need_weights: bool = False,
                queries: int | None = None, **attn_kwargs) -> tuple[Tensor, Tensor | None]:
        keep = x if queries is None else x[:, :queries]
        if self.residual_form():
            h, weights = self.attn(x, need_weights=need_weights, residual=keep, queries=queries, **attn_kwargs)
            x = self.norm1(h)
            if self.cross_attn is not None:
                h, _ = self.cross_attn(x, memory=memory, memory_kv=memory_kv, attn_mask=memory_mask, residual=x)
                x = self.norm_cross(h)
            return self.norm2(self.mlp_add(x, x)), weights
        h, weights = self.attn(x, need_weights=need_weights, queries=queries, **attn_kwargs)
        x = self.norm1(keep + self.resid_dropout(h))
        if self.cross_attn is not None:
            h, _ = self.cross_attn(x, memory=memory, memory_kv=memory_kv, attn_mask=memory_mask)
            x = self.norm_cross(x + self.resid_dropout(h))
        return self.norm2(x + self.mlp(x)), weights

    def sequence_eval(self, x: Tensor, attn_mask: Tensor | None, is_causal: bool, rope: Rope,
                      memory_kv: tuple[Tensor, Tensor] | None = None, memory_mask: Tensor | None = None) -> Tensor:
        """``forward(x, ...)[0]`` in eval mode as plain method calls (see :func:`plain_eval`)."""
        x = self.norm1.forward(self.attn.sequence_eval(x, attn_mask, is_causal, rope, x))
        if self.cross_attn is not None:
            x = self.norm_cross.forward(self.cross_attn.sequence_eval(x, memory_mask, False, None, x, memory_kv))
        return self.norm2.forward(self.mlp_add(x, x))

    def inference_step(self, kv: Tensor, memory_kv: tuple[Tensor, Tensor] | None = None,
                       memory_mask: Tensor | None = None) -> StepFunction | None:
        parts = self._inference_parts(kv, memory_kv, memory_mask)
        if parts is None:
            return None
        attn, norm1, cross, cross_norm, norm2, mlp = parts

        if cross is None:
            def step(x: Tensor, pos: int, attn_mask: Tensor | None, rope: Rope) -> Tensor:
                x = norm1(x + attn(x, pos, attn_mask, rope))
                return norm2(x + mlp(x))
        else:
            def step(x: Tensor, pos: int, attn_mask: Tensor | None, rope: Rope) -> Tensor:
                x = norm1(x + attn(x, pos, attn_mask, rope))
                x = cross_norm(x + cross(x))
                return norm2(x + mlp(x))

        return step


def create_block(norm_placement: str, *args, **kwargs) -> nn.Module:
    return BLOCKS.get(norm_placement)(*args, **kwargs)

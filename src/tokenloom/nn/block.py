"""Transformer blocks: attention and MLP sublayers with residuals, norm placement by name.

* ``pre`` (GPT-2, most modern models): ``x = x + attn(norm1(x)); x = x + mlp(norm2(x))``.
* ``post`` (the original Transformer): ``x = norm1(x + attn(x)); x = norm2(x + mlp(x))``.

A decoder block of an encoder-decoder model adds a cross-attention sublayer between the two.
Shapes: x (B, T, C); memory (B, S, C).

Each placement's residual arithmetic is written once, as a body over bound sublayers (:func:`pre_norm`,
:func:`post_norm`): every sublayer is a callable ``(h, ctx, residual) -> residual + sublayer(h)``. The three ways a
block runs bind that one body differently:

* ``forward(x, ctx, need_weights=, queries=)``: the modules (hooks fire); in training with dropout on each
  branch; in eval mode each residual add fused into the sublayer's last linear layer where :mod:`.fused` can.
* ``bind()``: plain functions ``(x (B, T, C), ctx) -> (B, T, C)`` for eval-mode passes over whole sequences (an
  encoder, a parallel decoder, teacher forcing) without the ``nn.Module`` call overhead;
  :func:`plain_eval` tells when callers may use it.
* ``bind(rows)``: plain functions for one eval-mode decode step, x (B, C) of ``rows`` rows (pre-packed linear
  layers, :func:`.fused.bind_linear`).

``ctx`` is the attention :class:`~.attention.Context` of the layer (mask, rotary angles, its cache views).
``forward(x, queries=n)`` lets only the first ``n`` positions query (a class token's last layer): (B, n, C).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor, nn

from ..registry import Registry
from .attention import NO_CONTEXT, Context, MultiHeadAttention
from .dropout import Dropout
from .fused import bind_linear
from .mlp import create_mlp
from .norms import create_norm

BLOCKS: Registry[type[nn.Module]] = Registry("norm placement")

Sublayer = Callable[[Tensor, Context, Tensor], Tensor]  # (h, ctx, residual) -> residual + sublayer(h)
MLPSublayer = Callable[[Tensor, Tensor], Tensor]  # (h, residual) -> residual + mlp(h)
Norm = Callable[[Tensor], Tensor]
BlockFunction = Callable[[Tensor, Context], Tensor]


def pre_norm(x: Tensor, ctx: Context, attn: Sublayer, cross: Sublayer | None, mlp: MLPSublayer, norm1: Norm,
             norm_cross: Norm | None, norm2: Norm) -> Tensor:
    """The pre-norm residual arithmetic (GPT-2, Llama, ViT, Swin)."""
    x = attn(norm1(x), ctx, x)
    if cross is not None:
        x = cross(norm_cross(x), ctx, x)
    return mlp(norm2(x), x)


def post_norm(x: Tensor, ctx: Context, attn: Sublayer, cross: Sublayer | None, mlp: MLPSublayer, norm1: Norm,
              norm_cross: Norm | None, norm2: Norm) -> Tensor:
    """The post-norm residual arithmetic (the original Transformer)."""
    x = norm1(attn(x, ctx, x))
    if cross is not None:
        x = norm_cross(cross(x, ctx, x))
    return norm2(mlp(x, x))


def has_forward_hooks(module: nn.Module) -> bool:
    """True when a submodule of ``module`` (not itself) or the global registry has forward (pre-)hooks: a
    decode plan or a plain eval pass would bypass them, so the modules must be called as usual."""
    return _global_hooks() or _below(module, training=False)


def plain_eval(module: nn.Module) -> bool:
    """Whether the blocks of ``module`` may run as plain method calls (``block.bind()``): it
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
    body = staticmethod(pre_norm)

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, *, hidden_dim: int,
                 mlp: str = "gelu", norm: str = "layernorm", attention: str = "sdpa", dropout: float = 0.0,
                 bias: bool = True, cross_attention: bool = False, norm_eps: float | None = None,
                 attention_dropout: float | None = None, attention_options: dict | None = None,
                 make_attention: Callable[..., nn.Module] = MultiHeadAttention,
                 make_mlp: Callable[..., nn.Module] = create_mlp,
                 make_norm: Callable[..., nn.Module] = create_norm) -> None:
        """The parts are passed in as builders (torchtune-style): ``make_attention(embed_dim, num_heads,
        num_kv_heads, bias=, dropout=, backend=, attention_options=, [cross=True])``, ``make_mlp(name, embed_dim,
        hidden_dim, bias=, dropout=)``, ``make_norm(name, embed_dim, bias=, eps=)``; the defaults build the
        registered parts by name."""
        super().__init__()
        attention_dropout = dropout if attention_dropout is None else attention_dropout
        self.attn = make_attention(embed_dim, num_heads, num_kv_heads, bias=bias, dropout=attention_dropout,
                                   backend=attention, attention_options=attention_options)
        self.norm1 = make_norm(norm, embed_dim, bias=bias, eps=norm_eps)
        if cross_attention:
            self.cross_attn = make_attention(embed_dim, num_heads, num_kv_heads, bias=bias,
                                             dropout=attention_dropout, backend=attention, cross=True,
                                             attention_options=attention_options)
            self.norm_cross = make_norm(norm, embed_dim, bias=bias, eps=norm_eps)
        else:
            self.cross_attn = None
            self.norm_cross = None
        self.mlp = make_mlp(mlp, embed_dim, hidden_dim, bias=bias, dropout=dropout)
        self.norm2 = make_norm(norm, embed_dim, bias=bias, eps=norm_eps)
        self.resid_dropout = Dropout(dropout)

    def residual_form(self) -> bool:
        """In eval mode (dropout off) each residual add is handed to the sublayer (``residual=``, ``add_to``) so
        it can be fused into the sublayer's last linear layer (:mod:`.fused`); not when hooks watch the
        submodules (the fused kernels would bypass them)."""
        return not self.training and not has_forward_hooks(self)

    def forward(self, x: Tensor, ctx: Context = NO_CONTEXT, *, memory: Tensor | None = None,
                need_weights: bool = False, queries: int | None = None) -> tuple[Tensor, Tensor | None]:
        """x (B, T, C) -> (B, T, C) (or (B, n, C) with ``queries=n``), and the self-attention probabilities when
        ``need_weights`` and the backend gives them. A cross-attention block reads ``ctx.memory`` or ``memory``."""
        weights: list[Tensor | None] = [None]
        fused = self.residual_form()
        attn_module, cross_module, mlp_module = self.attn, self.cross_attn, self.mlp
        dropout = self.resid_dropout

        def attn(h: Tensor, ctx: Context, residual: Tensor) -> Tensor:
            keep = residual if queries is None else residual[:, :queries]
            if fused:
                out, weights[0] = attn_module(h, ctx, residual=keep, need_weights=need_weights, queries=queries)
                return out
            out, weights[0] = attn_module(h, ctx, need_weights=need_weights, queries=queries)
            return keep + dropout(out)

        def cross(h: Tensor, ctx: Context, residual: Tensor) -> Tensor:
            if fused:
                return cross_module(h, ctx, memory=memory, residual=residual)[0]
            return residual + dropout(cross_module(h, ctx, memory=memory)[0])

        def mlp(h: Tensor, residual: Tensor) -> Tensor:
            return mlp_add(mlp_module, residual, h) if fused else residual + mlp_module(h)

        x = self.body(x, ctx, attn, cross if cross_module is not None else None, mlp, self.norm1, self.norm_cross,
                      self.norm2)
        return x, weights[0]

    def bind(self, rows: int | None = None) -> BlockFunction:
        """The block as a plain eval-mode function ``(x, ctx) -> x`` (see the module docstring): whole sequences
        with ``rows`` None, one-token decode steps of ``rows`` rows (x (B, C)) otherwise."""
        attn = self.attn.bind(rows)
        cross = self.cross_attn.bind(rows) if self.cross_attn is not None else None
        if rows is None:
            mlp_module = self.mlp

            def mlp(h: Tensor, residual: Tensor) -> Tensor:
                return mlp_add(mlp_module, residual, h)
        else:
            mlp = residual_function(self.mlp, rows)
        norm1, norm2 = inference_function(self.norm1), inference_function(self.norm2)
        norm_cross = inference_function(self.norm_cross) if self.norm_cross is not None else None
        body = self.body

        def block(x: Tensor, ctx: Context) -> Tensor:
            return body(x, ctx, attn, cross, mlp, norm1, norm_cross, norm2)

        return block


def residual_function(mlp: nn.Module, rows: int) -> MLPSublayer:
    """``(h, residual) -> residual + mlp(h)`` as a plain decode-step function: the MLP's own
    ``inference_function(rows, residual=True)`` where it has one (one call less per layer), else a wrapper."""
    make = getattr(mlp, "inference_function", None)
    if make is not None and "residual" in inspect.signature(make).parameters:
        return make(rows=rows, residual=True)
    function = inference_function(mlp, rows=rows)  # an MLP without the residual form (or without a plain form)
    return lambda h, residual: residual + function(h)


def mlp_add(mlp: nn.Module, residual: Tensor, x: Tensor) -> Tensor:
    """``residual + mlp(x)`` through the MLP's ``add_to`` where it has one (fused in eval mode)."""
    add_to = getattr(mlp, "add_to", None)
    return add_to(residual, x) if add_to is not None else residual + mlp(x)


@BLOCKS.register("pre")
class PreNormBlock(_Block):
    body = staticmethod(pre_norm)


@BLOCKS.register("post")
class PostNormBlock(_Block):
    body = staticmethod(post_norm)


class StepFunctions(NamedTuple):
    """A decoder's one-token eval step as plain functions (x (B, C) per row), for one batch size."""

    blocks: list[BlockFunction]
    final_norm: Norm
    head: Callable[[Tensor], Tensor]  # (B, C) -> (B, V)


# id(cache) -> (weakref to the cache, model, rows, StepFunctions | None): built once per cache and batch size, held
# only while the cache lives (a dict by id with a weakref check: one lookup per decode step, no weakref made per call)
_STEPS: dict[int, tuple] = {}


def step_functions(model: nn.Module, cache, parts: Callable[[], tuple[nn.ModuleList, nn.Module, nn.Linear]],
                   positions: int = 1, logits: Callable[[Tensor], Tensor] | None = None) -> StepFunctions | None:
    """The plain one-token step of ``model`` (``parts()``: its blocks, final norm and output layer) for
    ``cache``'s batch size, built on first use and kept while ``cache`` lives (beam search's ``select``, which
    changes the batch size, builds it anew); None when forward hooks watch a submodule (the modules run then).
    With ``positions`` K > 1 the same functions serve steps of K positions per row (x (B, K, C): B * K rows for
    the linear layers; a semi-autoregressive model's groups). The one builder behind every model's fast decode
    path: nothing is stored on the cache or the model. ``logits``, given, is applied to the output layer's result
    (a model's logit soft-cap), so every user of ``head`` sees what the model's own head gives."""
    rows = cache.batch_size * positions
    entry = _STEPS.get(id(cache))
    if entry is not None and entry[0]() is cache and entry[1] is model and entry[2] == rows:
        return entry[3]
    functions = None
    if not has_forward_hooks(model):
        blocks, final_norm, head = parts()
        head_function = bind_linear(head, rows=rows)
        if logits is not None:
            linear = head_function

            def head_function(x: Tensor) -> Tensor:
                return logits(linear(x))

        functions = StepFunctions(blocks=[block.bind(rows) for block in blocks],
                                  final_norm=inference_function(final_norm), head=head_function)
    key = id(cache)
    _STEPS[key] = (weakref.ref(cache, lambda _: _STEPS.pop(key, None)), model, rows, functions)
    return functions


def runs_plain(cache) -> bool | None:
    """Whether one-token steps over ``cache`` run as plain functions (True), call the modules because hooks watch
    them (False), or have not run yet (None): what tests of the fast path check."""
    entry = _STEPS.get(id(cache))
    return None if entry is None or entry[0]() is not cache else entry[3] is not None


def create_block(norm_placement: str, *args, **kwargs) -> nn.Module:
    return BLOCKS.get(norm_placement)(*args, **kwargs)

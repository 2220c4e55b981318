"""Parts of depth-adaptive early exit (Elbayad et al. 2020; CALM, Schuster et al. 2022): exit heads, the exit
confidence, and a block bound to keep its input frozen while still storing its keys and values.

Shapes: x (..., C) hidden states (B, T, C) over whole sequences or (B, C) in a one-token step; logits (..., V).

* :class:`ExitHeads`: the logits of layer l's state, l = 1 .. L - 1, are ``lm_head(norm_l(h_l))``. ``shared``:
  ``norm_l`` is the model's own final norm (no weights of their own: the logit lens); ``trained``: a norm of its own
  per exit layer (initialised from the final norm), trained with the backbone frozen, so the full model's own
  predictions never change. The output layer is always the model's (tied to the embeddings where the model ties).
* :func:`confident`: max softmax probability of the exit logits > threshold (strictly, so a threshold of 1 never
  exits).
* :func:`frozen_block`: a block whose position has exited. Its state stays as it is, but the layer's keys and
  values of that frozen state are still stored, so later positions attend to well-defined entries (state copying).
  It is the block's own residual body (:func:`~.block.pre_norm`, :func:`~.block.post_norm`) bound with an attention
  that only projects and stores keys and values and an MLP that adds nothing; its result is discarded. Skipping
  the queries, the attention itself, its output projection and the MLP is where early exit saves time.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..errors import GenerationError
from .attention import Context, MultiHeadAttention, mixed_values
from .block import inference_function
from .fused import decode_linear
from .norms import create_norm

EXIT_KINDS = ("shared", "trained")


class ExitHeads(nn.Module):
    """The exit heads of a decoder of ``num_layers`` layers: one after each layer but the last (see the module
    docstring). ``norms`` None: ``shared`` (the model's final norm at every exit layer); else ``trained``: one norm
    per exit layer, ``num_layers - 1`` of them."""

    def __init__(self, num_layers: int, norms: nn.ModuleList | None = None) -> None:
        super().__init__()
        if norms is not None and len(norms) != num_layers - 1:
            raise ValueError(f"{num_layers} layers need {num_layers - 1} exit norms, got {len(norms)}")
        self.num_layers = num_layers
        self.norms = norms

    @classmethod
    def shared(cls, num_layers: int) -> ExitHeads:
        return cls(num_layers)

    @classmethod
    def trained(cls, final_norm: nn.Module, num_layers: int, norm: str, embed_dim: int,
                eps: float | None = None) -> ExitHeads:
        """Fresh trainable heads: a ``norm`` (layernorm | rmsnorm, with a bias where it has one) per exit layer,
        each a copy of ``final_norm``'s weights where it has any (an Identity final norm, post-norm models: ones)."""
        norms = nn.ModuleList(create_norm(norm, embed_dim, bias=True, eps=eps) for _ in range(num_layers - 1))
        source = dict(final_norm.named_parameters())
        with torch.no_grad():
            for module in norms:
                for name, p in module.named_parameters():
                    if name in source:
                        p.copy_(source[name])
        return cls(num_layers, norms)

    @property
    def kind(self) -> str:
        return "shared" if self.norms is None else "trained"

    def norm_functions(self, final_norm: Callable[[Tensor], Tensor],
                       plain: bool) -> list[Callable[[Tensor], Tensor]]:
        """The norm of each exit layer as a callable: ``final_norm`` for shared heads, else this module's norms
        (``plain``: bound as plain functions, for eval-mode decode steps)."""
        if self.norms is None:
            return [final_norm] * (self.num_layers - 1)
        return [inference_function(norm) if plain else norm for norm in self.norms]


def max_probability(logits: Tensor) -> Tensor:
    """(..., V) logits -> (...) the largest softmax probability, in float32 (one fused softmax: at most 1, exactly)."""
    return (logits if logits.dtype == torch.float32 else logits.float()).softmax(-1).amax(-1)


def confident(logits: Tensor, threshold: float) -> Tensor:
    """(..., V) -> (...) bool: the exit head is confident enough to exit (max probability > ``threshold``)."""
    return max_probability(logits) > threshold


def key_value_store(attn: MultiHeadAttention, rows: int | None) -> Callable[[Tensor, Context, Tensor], Tensor]:
    """A self-attention sublayer ``(h, ctx, residual) -> residual`` that only projects ``h``'s keys and values
    (the k and v rows of the fused qkv projection; no queries) and stores them through ``ctx.cache`` (nothing to
    store without one), normed and rotated as the attention itself stores them (:meth:`MultiHeadAttention.keys`),
    the values mixed with the layer's value embeddings where the context carries them (:func:`.attention.mixed_values`).
    ``rows``: bound for one-token steps of that many rows (h (B, C)); None: whole sequences (h (B, T, C))."""
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    proj = attn.qkv_proj
    if not isinstance(proj, nn.Linear):  # a quantised projection: its k and v rows are not a slice of a weight
        raise GenerationError(f"early exit runs float models only; this one has a {type(proj).__name__} "
                              "projection (a quantised model: use its float checkpoint)")
    weight = proj.weight[H * D:]  # (2 Hkv D, C): the rows of k then v (the qkv layout: H, Hkv, Hkv heads of D)
    bias = proj.bias[H * D:] if proj.bias is not None else None
    linear = partial(F.linear, weight=weight, bias=bias) if rows is None else decode_linear(weight, bias, rows)

    def store(h: Tensor, ctx: Context, residual: Tensor) -> Tensor:
        if ctx.cache is None:
            return residual
        B = h.shape[0]
        kv = linear(h)
        # (B, 2 Hkv, T, D), one position per row needing no transpose
        kv = kv.view(B, 2 * Hkv, 1, D) if h.dim() == 2 else kv.view(B, h.shape[1], 2 * Hkv, D).transpose(1, 2)
        k, v = kv.split_with_sizes((Hkv, Hkv), 1)
        ctx.cache.update(attn.keys(k, ctx.rope), mixed_values(v, ctx))
        return residual

    return store


def _keep(h: Tensor, residual: Tensor) -> Tensor:
    return residual


def frozen_block(block: nn.Module, rows: int | None) -> Callable[[Tensor, Context], None]:
    """``block`` for positions that exited: ``(x, ctx) -> None`` stores the layer's keys and values of the frozen
    ``x`` and computes nothing else (see the module docstring). ``rows`` as in :func:`key_value_store`. A block with
    cross-attention (an encoder-decoder's) has no frozen form here."""
    if block.cross_attn is not None:
        raise ValueError("frozen_block binds decoder-only blocks (no cross-attention)")
    store = key_value_store(block.attn, rows)
    norm1 = inference_function(block.norm1)
    body = block.body

    def frozen(x: Tensor, ctx: Context) -> None:
        # the second norm feeds only the MLP, which adds nothing: bound as the identity
        body(x, ctx, store, None, _keep, norm1, None, _identity)

    return frozen


def _identity(x: Tensor) -> Tensor:
    return x

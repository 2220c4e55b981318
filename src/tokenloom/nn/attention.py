"""Multi-head attention (self, causal, cross; grouped-query via ``num_kv_heads``) and its backends.

Backends, by name (``ATTENTION_BACKENDS``), share one signature::

    backend(q, k, v, attn_mask, is_causal, dropout_p, need_weights) -> (out, weights | None)

with q (B, H, Tq, D), k and v (B, Hkv, Tk, D), ``attn_mask`` None, bool (True = may attend) or an
additive float mask broadcastable to (B, H, Tq, Tk), and out (B, H, Tq, D).

* ``sdpa``: torch's fused ``scaled_dot_product_attention`` (flash / memory-efficient kernels); the
  default. It never returns weights.
* ``math``: the explicit ``softmax(q k^T / sqrt(D) + mask) v``; returns the probabilities when asked.
* ``performer``, ``linformer``: linear-time approximations with state (random features, learned projections),
  :mod:`.linear_attention`; registered as classes, each attention layer builds its own instance from
  ``max_len`` and the model config's ``attention_options`` section, which the backend owns and validates
  (its ``Options`` dataclass: performer ``features``, ``redraw``; linformer ``k``; :func:`backend_options`).
  A backend with options joins by registering a class with an ``Options`` dataclass; nothing else changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..config import from_dict
from ..errors import ConfigError
from .backends import ATTENTION_BACKENDS, load_backend_files
from .fused import bind_linear, linear_add_of
from .kv_cache import LayerCache, MemoryLayer
from .masks import causal_mask
from .positions import Relative, apply_rotary
from .sliding import Band

Backend = Callable[[Tensor, Tensor, Tensor, Tensor | None, bool, float, bool], tuple[Tensor, Tensor | None]]


_causal_masks: dict[tuple, Tensor] = {}


def backend_options(backend: str, options: dict | None, prefix: str = "attention_options") -> dict:
    """The validated ``attention_options`` of ``backend`` as keyword arguments (defaults filled in): each backend
    owns its options (the ``Options`` dataclass of a backend class); a backend without one takes none. A
    :class:`~tokenloom.errors.ConfigError` names the key and the value."""
    implementation = ATTENTION_BACKENDS.get(backend)
    spec = getattr(implementation, "Options", None)
    if spec is None:
        if options:
            raise ConfigError(f"{prefix}: attention {backend!r} takes no options, got {sorted(options)}")
        return {}
    if options is not None and not isinstance(options, dict):
        raise ConfigError(f"{prefix}: expected a mapping of {backend} options, got {options!r}")
    return asdict(from_dict(spec, options or {}, prefix=prefix))


EXPLICIT_TRAINING_MAX_KEYS = 96  # float32 CPU training: explicit attention up to this many keys


def _explicit_training_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
                                 dropout_p: float) -> Tensor:
    """softmax(q k^T / sqrt(D) + mask) v as three autograd ops, for CPU training where torch's CPU
    flash-attention backward is slower: in bf16 always (~1.6x: B=8, H=6, T=256, D=64: 28 vs 17 ms forward +
    backward), in float32 for short key lengths (<= ``EXPLICIT_TRAINING_MAX_KEYS``; ViT on MNIST, B=128, H=4,
    T=50, D=32: 14.3 vs 9.1 ms; even at T=128, flash ahead from T=192)."""
    if q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)  # (B, H, Tq, Tk)
    if is_causal and attn_mask is None:
        tq, tk = scores.shape[-2:]
        key = (tq, tk, q.dtype)
        if key not in _causal_masks:
            _causal_masks[key] = torch.full((tq, tk), float("-inf"), dtype=q.dtype).triu(tk - tq + 1)
        attn_mask = _causal_masks[key]
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask.to(scores.dtype)
    probs = F.dropout(scores.softmax(dim=-1), p=dropout_p) if dropout_p > 0 else scores.softmax(dim=-1)
    return probs @ v


class _PartitionViews(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, make_views: Callable[[Tensor], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
        ctx.make_views, ctx.shape, ctx.dtype, ctx.device = make_views, x.shape, x.dtype, x.device
        return tuple(make_views(x))

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor, None]:
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        for view, g in zip(ctx.make_views(grad), grads, strict=True):
            view.zero_() if g is None else view.copy_(g)
        return grad, None


def partition_views(x: Tensor, make_views: Callable[[Tensor], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
    """``make_views(x)``: views that together cover every element of ``x`` exactly once (q, k and v of a fused
    projection). Under autograd their gradients are copied straight into one buffer in ``x``'s layout (one pass)
    instead of autograd's stack followed by a contiguous copy (two); ViT-MNIST / Swin-MNIST training
    ~5% faster."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _PartitionViews.apply(x, make_views)
    return tuple(make_views(x))


def explicit_training(q: Tensor, keys: int) -> bool:
    """Whether the ``sdpa`` backend computes attention over ``keys`` keys for ``q`` explicitly (CPU training:
    :func:`_explicit_training_attention`); those three ops accept extra batch dims and broadcast masks."""
    return q.device.type == "cpu" and q.requires_grad and torch.is_grad_enabled() and (
        q.dtype == torch.bfloat16 or keys <= EXPLICIT_TRAINING_MAX_KEYS)


@ATTENTION_BACKENDS.register("sdpa")
def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
                   dropout_p: float, need_weights: bool) -> tuple[Tensor, None]:
    """The ``sdpa`` backend: torch's fused ``scaled_dot_product_attention`` (no weights returned). ``is_causal``
    aligns the causal mask to the last keys as every backend does (query i of Tq sees keys <= Tk - Tq + i); torch's
    own ``is_causal`` aligns it to the first keys when Tq != Tk, so it is used for Tq == Tk only (the models' one
    case: no cache), an explicit bottom-right mask otherwise."""
    if explicit_training(q, k.shape[-2]):
        return _explicit_training_attention(q, k, v, attn_mask, is_causal, dropout_p), None
    gqa = q.shape[1] != k.shape[1]
    is_causal = is_causal and attn_mask is None
    if is_causal and q.shape[-2] != k.shape[-2]:
        attn_mask, is_causal = causal_mask(q.shape[-2], k.shape[-2], q.device), False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                         enable_gqa=gqa)
    return out, None


def ragged_rows_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
                          dropout_p: float, need_weights: bool) -> tuple[Tensor, None]:
    """``sdpa`` for rows at different lengths (:attr:`Context.ragged`: one query per row, an additive mask
    (B, 1|H, 1, S) hiding each row's later keys): on CPU, without grouped-query heads, as ``baddbmm`` (mask +
    scaled scores in one product) + softmax + ``bmm``, ~15-25% faster than the fused kernel with a mask at a
    server's batch (16 rows x 6 heads x 64, 60-250 keys: 120 vs 180 us, 493 vs 588 us), the same to float
    rounding; slower for small batches (8 rows x 4 heads x 32, 40 keys: 28 vs 22 us), so used for ragged rows
    only, as before the one path."""
    if (attn_mask is None or q.device.type != "cpu" or q.shape[1] != k.shape[1] or attn_mask.dtype == torch.bool
            or torch.is_grad_enabled() or torch.compiler.is_compiling()):
        return sdpa_attention(q, k, v, attn_mask, is_causal, dropout_p, need_weights)
    B, H, S, D = k.shape
    bias = attn_mask.expand(B, H, 1, S).reshape(B * H, 1, S).to(q.dtype)
    scores = torch.baddbmm(bias, q.reshape(B * H, 1, D), k.reshape(B * H, S, D).transpose(1, 2),
                           alpha=1.0 / math.sqrt(D))  # (BH, 1, S)
    return torch.bmm(scores.softmax(-1), v.reshape(B * H, S, D)).view(B, H, 1, D), None


def _scores(q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool) -> Tensor:
    """Masked scaled scores (B, H, Tq, Tk) of q (B, H, Tq, D) against k (B, Hkv, Tk, D): grouped-query keys
    repeated, the causal mask aligned to the last keys, a bool mask (True = may attend) or an additive one."""
    if q.shape[1] != k.shape[1]:  # grouped-query: each kv head serves H / Hkv query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, Tq, Tk)
    if is_causal and attn_mask is None:
        scores = scores.masked_fill(~causal_mask(*scores.shape[-2:], q.device), float("-inf"))
    elif attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attn_mask
    return scores


def attention_probs(q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool) -> Tensor:
    """The softmax attention probabilities (B, H, Tq, Tk), float32, of the q and k (and mask) a backend is
    given: what the ``math`` backend returns as weights, and what :func:`capture_attention` records for any
    backend (for ``performer`` / ``linformer``: the exact attention they approximate)."""
    return _scores(q.float(), k.float(), attn_mask if attn_mask is None or attn_mask.dtype == torch.bool
                   else attn_mask.float(), is_causal).softmax(dim=-1)


@ATTENTION_BACKENDS.register("math")
def math_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
                   dropout_p: float, need_weights: bool) -> tuple[Tensor, Tensor | None]:
    """The ``math`` backend: softmax(q k^T / sqrt(d) + mask) v written out, so it can return the weights."""
    if q.shape[1] != k.shape[1]:
        v = v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    probs = _scores(q, k, attn_mask, is_causal).float().softmax(dim=-1).to(q.dtype)
    dropped = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
    return dropped @ v, (probs if need_weights else None)


# --- attention capture: probabilities recorded as data while any backend runs ---------------------------------------

_CAPTURE: ContextVar[dict[int, list[Tensor]] | None] = ContextVar("tokenloom_attention_capture", default=None)


@contextmanager
def capture_attention_of(modules: list[nn.Module]) -> Iterator[dict[int, list[Tensor]]]:
    """Within the block, every forward of one of ``modules`` (:class:`MultiHeadAttention`) appends the
    attention probabilities of its q and k (:func:`attention_probs`, (B, H, Tq, Tk) float32) to
    ``records[id(module)]``; nothing is stored on the modules, and other modules run untouched. The models'
    one-token decode plans do not record (use a full forward). :func:`tokenloom.viz.capture_attention` is the
    user-facing form."""
    records: dict[int, list[Tensor]] = {id(m): [] for m in modules}
    token = _CAPTURE.set(records)
    try:
        yield records
    finally:
        _CAPTURE.reset(token)


def capturing() -> bool:
    """Whether a capture is active (never while ``torch.compile`` traces: a compiled model is not captured, and
    the context variable is not traceable): a model then attends with explicit masks, whose probabilities the
    capture records, rather than block-wise (:class:`~.sliding.Band`)."""
    return not torch.compiler.is_compiling() and _CAPTURE.get() is not None


def _record(module: nn.Module, q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool) -> None:
    records = _CAPTURE.get()
    if records is not None and id(module) in records:
        with torch.no_grad():
            records[id(module)].append(attention_probs(q.detach(), k.detach(), attn_mask, is_causal))


class Context(NamedTuple):
    """What one attention call reads besides its queries' source: built once per forward by the model (the mask
    from :func:`~.masks.attention_mask`, the rotary angles) and given each layer's cache views."""

    mask: Tensor | None = None  # self-attention: None, bool (True = may attend) or additive (B|1, H|1, T, S)
    is_causal: bool = False  # the fused kernels' own causal mask (no cache, no mask)
    rope: tuple[Tensor, Tensor] | None = None  # (cos, sin) of the queries' positions
    cache: LayerCache | None = None  # self-attention: this layer's cache strategy (None: attend over x itself)
    memory: LayerCache | None = None  # cross-attention: the memory's keys and values (a MemoryLayer)
    memory_mask: Tensor | None = None  # cross-attention: the memory's additive mask (Bm, 1, 1, S)
    ragged: bool = False  # rows at different lengths, one query each (KeySpan.ragged): sdpa as ragged_rows_attention
    band: Band | None = None  # block-wise attention instead of ``mask``: a sliding window over the whole sequence
    #   (:class:`~.sliding.Band`), or a paged cache's groups of rows (:class:`~.paged.PagedLayout`)
    relative: Relative | None = None  # this layer's query-dependent position term (Position.relative: XL)
    value_embed: Tensor | None = None  # self-attention: rows added to this layer's values before they are cached,
    #   (B, T, Hkv * D): the speedrun's value embeddings, lambda_l * table[ids] (:mod:`.speedrun`)


NO_CONTEXT = Context()


def mixed_values(v: Tensor, ctx: Context) -> Tensor:
    """v (B, Hkv, T, D) as a self-attention layer stores and attends over it: ``v + ctx.value_embed`` viewed as
    (B, Hkv, T, D) where the context carries value-embedding rows (B, T, Hkv * D), else v."""
    rows = ctx.value_embed
    if rows is None:
        return v
    B, Hkv, T, D = v.shape
    return v + rows.view(B, T, Hkv, D).transpose(1, 2).to(v.dtype)

Linear = Callable[[Tensor], Tensor]


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over ``num_heads`` heads.

    Self-attention projects q, k and v with one fused matmul; with ``cross=True`` the keys and values
    come from an encoder's memory (``ctx.memory``: its keys and values, :meth:`memory_kv`). ``num_kv_heads <
    num_heads`` shares each key/value head among ``num_heads // num_kv_heads`` query heads (grouped-query
    attention; 1 = multi-query). ``qk_norm``, a norm builder ``(head_dim) -> module``, adds a norm of each head's
    queries and of its keys, applied before RoPE in the one body (:meth:`queries_keys`), so every entry point and
    cache strategy sees it (OLMo-2, the modded-nanogpt speedrun).

    Two entry points run one body (:meth:`attend`): ``forward`` (the module: hooks, dropout, weights) and
    :meth:`bind` (plain functions for eval-mode passes and one-token decode steps, without ``nn.Module`` call
    overhead). Keys and values are stored and read through the context's cache strategy
    (:mod:`.kv_cache`): dense, static, ragged or an encoder's memory.
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, *, bias: bool = True,
                 dropout: float = 0.0, backend: str = "sdpa", cross: bool = False,
                 attention_options: dict | None = None, qk_norm: Callable[[int], nn.Module] | None = None) -> None:
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.cross = cross
        kv_dim = 2 * num_kv_heads * self.head_dim
        if cross:
            self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
            self.kv_proj = nn.Linear(embed_dim, kv_dim, bias=bias)
        else:
            self.qkv_proj = nn.Linear(embed_dim, embed_dim + kv_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        # qk_norm(head_dim): a norm of each head's queries and keys before RoPE and attention (OLMo-2, the speedrun)
        self.q_norm = qk_norm(self.head_dim) if qk_norm is not None else None
        self.k_norm = qk_norm(self.head_dim) if qk_norm is not None else None
        self.dropout = dropout
        self.backend_name = backend
        implementation = ATTENTION_BACKENDS.get(backend)
        if isinstance(implementation, type):  # a backend with state (performer, linformer): one per layer
            options = dict(attention_options or {})
            max_len = options.pop("max_len", None)
            implementation = implementation(num_heads, self.head_dim, max_len=max_len,
                                            **backend_options(backend, options))
        self.backend = implementation

    def forward(self, x: Tensor, ctx: Context = NO_CONTEXT, *, memory: Tensor | None = None,
                residual: Tensor | None = None, need_weights: bool = False,
                queries: int | None = None) -> tuple[Tensor, Tensor | None]:
        """x (B, T, C) -> (B, T, C), and the (B, H, T, S) probabilities when ``need_weights`` and the
        backend can give them.

        ``residual`` (B, T, C) is added to the output (in eval-mode inference fused into the output projection,
        :func:`.fused.linear_add`). ``queries = n`` (self-attention without a cache) lets only the first ``n``
        positions query (all still serve as keys and values): the output is (B, n, C), e.g. a class token's
        last layer, whose other positions nothing reads. Cross-attention reads ``ctx.memory`` or, given
        ``memory`` (Bm, S, C), its keys and values computed here.
        """
        if memory is not None:
            ctx = ctx._replace(memory=MemoryLayer(*self.memory_kv(memory)))
        linear_in = self.q_proj if self.cross else self.qkv_proj
        weights: list[Tensor | None] = [None]
        out = self.attend(linear_in, self.project, False, x, ctx, residual, self.dropout if self.training else 0.0,
                          need_weights, queries, weights)
        return out, weights[0]

    def bind(self, rows: int | None = None) -> Callable[[Tensor, Context, Tensor], Tensor]:
        """The same attention as a plain eval-mode function ``(x, ctx, residual) -> residual + attention(x)``,
        without ``nn.Module`` call overhead: over whole sequences x (B, T, C) with ``rows`` None (an encoder, a
        parallel decoder, teacher forcing; the residual fused into the output projection where :mod:`.fused`
        can), or for one-token decode steps x (B, C) of ``rows`` rows (linear layers through
        :func:`.fused.bind_linear`: pre-packed weights, or a quantised layer's kernel)."""
        proj, out_proj = self.q_proj if self.cross else self.qkv_proj, self.out_proj
        if rows is None:
            linear_in: Linear = bind_linear(proj)

            def linear_out(out: Tensor, residual: Tensor) -> Tensor:
                return linear_add_of(out_proj, out, residual)

            return partial(self.attend, linear_in, linear_out, False)
        linear_in = bind_linear(proj, rows=None if self.cross else rows)
        out_linear = bind_linear(out_proj, rows=None if self.cross else rows)
        return partial(self.attend, linear_in, out_linear, True)

    def attend(self, linear_in: Linear, linear_out: Callable, add: bool, x: Tensor, ctx: Context,
               residual: Tensor | None, dropout: float = 0.0, need_weights: bool = False, queries: int | None = None,
               weights: list | None = None) -> Tensor:
        """The one attention body, with its projections bound by the caller (a partial of the first three: the
        entry points): x (B, T, C) or (B, C) (one position per row) -> ``residual + linear_out(heads' output)``
        with ``add``, else ``linear_out(heads' output, residual)`` (a fused projection + residual); the attention
        probabilities (or None) go into ``weights[0]`` when a list is given.

        Self-attention stores the new keys and values through ``ctx.cache`` and attends over what it returns.
        Cross-attention reads ``ctx.memory``; when x has ``B = Bm * g`` rows, each group of ``g`` consecutive
        rows (the beams of one sentence) attends to one memory row: the group is folded into the query length,
        so the memory is never copied per beam (``ctx.memory_mask`` is then (Bm, 1, 1, S))."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        step = x.dim() == 2  # one position per row (a decode step): not recorded by capture_attention_of
        B = x.shape[0]
        T = 1 if step else x.shape[1]
        fold = 1
        if self.cross:
            if ctx.memory is None:
                raise ValueError("cross-attention needs memory")
            k, v = ctx.memory.update(None, None)
            mask, causal = ctx.memory_mask, False
            q = linear_in(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
            fold = B // k.shape[0]
            if fold != 1:  # (Bm, H, g*T, D)
                q = q.view(-1, fold, H, T, D).transpose(1, 2).reshape(-1, H, fold * T, D)
        else:
            qkv = linear_in(x)
            rope = ctx.rope
            if torch.is_grad_enabled() and qkv.requires_grad:  # gradients into one buffer (partition_views)
                q, k, v = partition_views(  # each (B, H|Hkv, T, D)
                    qkv, lambda t, n=T: t.view(B, n, H + 2 * Hkv, D).transpose(1, 2).split((H, Hkv, Hkv), 1))
                q, k = self.queries_keys(q, k, rope)
            else:
                # (B, H + 2Hkv, T, D); one position per row needs no transpose
                qkv = qkv.view(B, H + 2 * Hkv, 1, D) if step else qkv.view(B, T, H + 2 * Hkv, D).transpose(1, 2)
                if rope is None or self.q_norm is not None:
                    q, k, v = qkv.split_with_sizes((H, Hkv, Hkv), 1)
                    q, k = self.queries_keys(q, k, rope)
                else:
                    qk, v = qkv.split_with_sizes((H + Hkv, Hkv), 1)
                    q, k = apply_rotary(qk, *rope).split_with_sizes((H, Hkv), 1)  # q and k rotated together
            v = mixed_values(v, ctx)
            mask, causal = ctx.mask, ctx.is_causal
            if queries is not None:
                assert ctx.cache is None and not causal, "queries is for uncached attention without a causal mask"
                q, T = q[:, :, :queries], queries
                if mask is not None and mask.shape[-2] > 1:
                    mask = mask[..., :queries, :]
            if ctx.cache is not None:
                k, v = ctx.cache.update(k, v)
            if ctx.relative is not None:  # Transformer-XL: (q + u) k + (q + v) R, the mask additive already
                q, term = ctx.relative(q, k.shape[-2])
                mask = term if mask is None else mask + term
        if not step and capturing():
            _record(self, q, k, mask, causal)
        backend = ragged_rows_attention if ctx.ragged and self.backend is sdpa_attention else self.backend
        if ctx.band is not None:
            out, probs = ctx.band.attend(backend, q, k, v, dropout), None
        else:
            out, probs = backend(q, k, v, mask, causal, dropout, need_weights)
        if fold != 1:
            out = out.view(-1, H, fold, T, D).transpose(1, 2).reshape(B, H, T, D)
        out = out.reshape(B, H * D) if step and fold == 1 else \
            out.transpose(1, 2).reshape((B, H * D) if step else (B, T, H * D))
        if weights is not None:
            weights[0] = probs
        return residual + linear_out(out) if add else linear_out(out, residual)

    def queries_keys(self, q: Tensor, k: Tensor, rope: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
        """q (B, H, T, D) and k (B, Hkv, T, D) normed per head (``qk_norm``) and then rotated (RoPE), where set."""
        if self.q_norm is not None:
            q = self.q_norm(q)
        return (q if rope is None else apply_rotary(q, *rope)), self.keys(k, rope)

    def keys(self, k: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        """k (B, Hkv, T, D) as attention stores it: normed per head (``qk_norm``), then rotated (RoPE), where set;
        also what a layer that only stores keys (early exit's frozen layers, :mod:`.exits`) applies."""
        if self.k_norm is not None:
            k = self.k_norm(k)
        return k if rope is None else apply_rotary(k, *rope)

    def project(self, out: Tensor, residual: Tensor | None = None) -> Tensor:
        """The output projection of the heads' concatenation ``out`` (..., C), plus ``residual`` if given."""
        if residual is None:
            return self.out_proj(out)
        return linear_add_of(self.out_proj, out, residual)

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention keys and values of ``memory`` (B, S, C): two (B, Hkv, S, D) tensors."""
        B = memory.shape[0]
        k, v = self.kv_proj(memory).view(B, -1, 2, self.num_kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return k, v


load_backend_files()  # the backends in files of their own (tokenloom/nn/backends/)

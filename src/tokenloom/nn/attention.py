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
  ``attention_options`` (``max_len``, ``performer_features``, ``performer_redraw``, ``linformer_k``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..registry import Registry
from .fused import decode_linear, linear_add
from .positions import apply_rotary

Backend = Callable[[Tensor, Tensor, Tensor, Tensor | None, bool, float, bool], tuple[Tensor, Tensor | None]]
ATTENTION_BACKENDS: Registry[Backend] = Registry("attention backend")


_causal_masks: dict[tuple, Tensor] = {}


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


def _masked_one_query(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor) -> Tensor:
    """Exact attention of one query per (row, head) under an additive mask (B, 1|H, 1, S): q (B, H, 1, D), k and
    v (B, H, S, D) slices of a cache -> (B, H, 1, D), as ``baddbmm`` (mask + scaled scores in one product) +
    softmax + ``bmm``: on CPU ~25% faster than the fused kernel with a mask (16 rows x 6 heads x 64, 60-250
    keys: 120 vs 180 us, 493 vs 588 us), the same to float rounding."""
    B, H, S, D = k.shape
    bias = attn_mask.expand(B, H, 1, S).reshape(B * H, 1, S).to(q.dtype)
    scores = torch.baddbmm(bias, q.reshape(B * H, 1, D), k.reshape(B * H, S, D).transpose(1, 2),
                           alpha=1.0 / math.sqrt(D))  # (BH, 1, S)
    return torch.bmm(scores.softmax(-1), v.reshape(B * H, S, D)).view(B, H, 1, D)


@ATTENTION_BACKENDS.register("sdpa")
def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
                   dropout_p: float, need_weights: bool) -> tuple[Tensor, None]:
    if explicit_training(q, k.shape[-2]):
        return _explicit_training_attention(q, k, v, attn_mask, is_causal, dropout_p), None
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                         is_causal=is_causal and attn_mask is None, enable_gqa=gqa)
    return out, None


def _scores(q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool) -> Tensor:
    """Masked scaled scores (B, H, Tq, Tk) of q (B, H, Tq, D) against k (B, Hkv, Tk, D): grouped-query keys
    repeated, the causal mask aligned to the last keys, a bool mask (True = may attend) or an additive one."""
    if q.shape[1] != k.shape[1]:  # grouped-query: each kv head serves H / Hkv query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, Tq, Tk)
    if is_causal and attn_mask is None:
        tq, tk = scores.shape[-2:]
        causal = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
        scores = scores.masked_fill(~causal, float("-inf"))
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


def _capturing() -> bool:
    """Whether a capture is active (never while ``torch.compile`` traces: a compiled model is not captured, and
    the context variable is not traceable)."""
    return not torch.compiler.is_compiling() and _CAPTURE.get() is not None


def _record(module: nn.Module, q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool) -> None:
    records = _CAPTURE.get()
    if records is not None and id(module) in records:
        with torch.no_grad():
            records[id(module)].append(attention_probs(q.detach(), k.detach(), attn_mask, is_causal))


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over ``num_heads`` heads.

    Self-attention projects q, k and v with one fused matmul; with ``cross=True`` the keys and values
    come from ``memory`` (an encoder's output). ``num_kv_heads < num_heads`` shares each key/value head
    among ``num_heads // num_kv_heads`` query heads (grouped-query attention; 1 = multi-query).
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, *, bias: bool = True,
                 dropout: float = 0.0, backend: str = "sdpa", cross: bool = False,
                 attention_options: dict | None = None) -> None:
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
        self.dropout = dropout
        self.backend_name = backend
        implementation = ATTENTION_BACKENDS.get(backend)
        if isinstance(implementation, type):  # a backend with state (performer, linformer): one per layer
            implementation = implementation(num_heads, self.head_dim, **(attention_options or {}))
        self.backend = implementation

    def forward(self, x: Tensor, *, attn_mask: Tensor | None = None, is_causal: bool = False,
                rope: tuple[Tensor, Tensor] | None = None, kv_cache: tuple[Tensor, Tensor] | None = None,
                cache_pos: int | Tensor = 0, memory: Tensor | None = None,
                memory_kv: tuple[Tensor, Tensor] | None = None, need_weights: bool = False,
                residual: Tensor | None = None, queries: int | None = None) -> tuple[Tensor, Tensor | None]:
        """x (B, T, C) -> (B, T, C), and the (B, H, T, Tk) probabilities when ``need_weights`` and the
        backend can give them.

        ``residual`` (B, T, C) is added to the output (in eval-mode inference fused into the output projection,
        :func:`.fused.linear_add`). ``queries = n`` (self-attention without a cache) lets only the first ``n``
        positions query (all still serve as keys and values): the output is (B, n, C), e.g. a class token's
        last layer, whose other positions nothing reads.

        ``kv_cache`` is a layer's preallocated (k, v) pair, each (B, Hkv, S, D): the new keys and values
        are written at ``cache_pos`` and attention runs over positions ``[0, cache_pos + T)``. With
        ``cache_pos`` a (T,) long tensor of positions (static shapes, for a compiled decode step) they are
        written there and attention runs over all S positions: ``attn_mask`` must hide those not yet written.
        With ``cache_pos`` a (B, 1) tensor (T = 1; a server's batch of sequences at different lengths) row b
        writes at its own position and attends over the first ``attn_mask.shape[-1]`` positions, the mask
        hiding each row's unwritten ones.

        Cross-attention takes ``memory`` (Bm, S, C) or its keys and values ``memory_kv`` computed once by
        :meth:`memory_kv` (a decoder's cache). When ``x`` has ``B = Bm * g`` rows, each group of ``g``
        consecutive rows (the beams of one sentence) attends to one memory row: the group is folded into
        the query length, so the memory is never copied per beam. ``attn_mask`` is then (Bm, 1, 1, S).
        """
        B, T, C = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.cross:
            assert memory is not None or memory_kv is not None, "cross-attention needs memory"
            k, v = memory_kv if memory_kv is not None else self.memory_kv(memory)
            Bm = k.shape[0]
            q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
            if B != Bm:  # fold groups of g rows into the query length: (Bm, H, g*T, D)
                g = B // Bm
                q = q.view(Bm, g, H, T, D).transpose(1, 2).reshape(Bm, H, g * T, D)
                if _capturing():
                    _record(self, q, k, attn_mask, False)
                dropout = self.dropout if self.training else 0.0
                out, weights = self.backend(q, k, v, attn_mask, False, dropout, need_weights)
                out = out.view(Bm, H, g, T, D).transpose(1, 2).reshape(B, H, T, D).transpose(1, 2).reshape(B, T, C)
                return self.project(out, residual), weights
        else:
            q, k, v = partition_views(  # each (B, H|Hkv, T, D)
                self.qkv_proj(x), lambda t: t.unflatten(-1, (H + 2 * Hkv, D)).transpose(1, 2).split((H, Hkv, Hkv), 1))
            if rope is not None:
                q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
            if queries is not None:
                assert kv_cache is None and not is_causal, "queries is for uncached attention without a causal mask"
                q, T = q[:, :, :queries], queries
                if attn_mask is not None and attn_mask.shape[-2] > 1:
                    attn_mask = attn_mask[..., :queries, :]
            if kv_cache is not None:
                k_buf, v_buf = kv_cache
                if isinstance(cache_pos, Tensor) and cache_pos.dim() == 2:  # (B, 1): a position per row
                    rows = torch.arange(B, device=k.device)
                    k_buf[rows, :, cache_pos[:, 0]] = k[:, :, 0]
                    v_buf[rows, :, cache_pos[:, 0]] = v[:, :, 0]
                    S = attn_mask.shape[-1]  # the mask spans the keys to attend (the longest row + 1)
                    k, v = k_buf[:, :, :S], v_buf[:, :, :S]
                elif isinstance(cache_pos, Tensor):  # static shapes: write at the (T,) positions, attend over all
                    k_buf.index_copy_(2, cache_pos, k)
                    v_buf.index_copy_(2, cache_pos, v)
                    k, v = k_buf, v_buf
                else:
                    end = cache_pos + T
                    k_buf[:, :, cache_pos:end] = k
                    v_buf[:, :, cache_pos:end] = v
                    k, v = k_buf[:, :, :end], v_buf[:, :, :end]
        dropout = self.dropout if self.training else 0.0
        if _capturing():
            _record(self, q, k, attn_mask, is_causal)
        out, weights = self.backend(q, k, v, attn_mask, is_causal, dropout, need_weights)
        out = out.transpose(1, 2).reshape(B, T, C)  # (B, T, H*D)
        return self.project(out, residual), weights

    def sequence_eval(self, x: Tensor, attn_mask: Tensor | None, is_causal: bool,
                      rope: tuple[Tensor, Tensor] | None, residual: Tensor,
                      memory_kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``residual + forward(x, ...)[0]`` for an eval-mode pass over whole sequences (no cache, no weights,
        no ``queries``), called as a plain method: the same computation without the ``nn.Module`` call overhead
        (a 15-token decoder block: 604 -> 447 us measured; the caller checks eval mode and hooks).
        x (B, T, C); cross-attention reads ``memory_kv`` (:meth:`memory_kv`, B rows) with ``attn_mask`` the
        memory's additive mask."""
        B, T, C = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.cross:
            k, v = memory_kv
            if k.shape[0] != B:  # beams folded into the query length: forward's path
                return self.forward(x, memory_kv=memory_kv, attn_mask=attn_mask, residual=residual)[0]
            q = F.linear(x, self.q_proj.weight, self.q_proj.bias).view(B, T, H, D).transpose(1, 2)
        else:
            q, k, v = F.linear(x, self.qkv_proj.weight, self.qkv_proj.bias).view(B, T, H + 2 * Hkv, D) \
                .transpose(1, 2).split((H, Hkv, Hkv), 1)
            if rope is not None:
                q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if _capturing():
            _record(self, q, k, attn_mask, is_causal)
        out, _ = self.backend(q, k, v, attn_mask, is_causal, 0.0, False)
        return linear_add(out.transpose(1, 2).reshape(B, T, C), self.out_proj.weight, self.out_proj.bias, residual)

    def project(self, out: Tensor, residual: Tensor | None = None) -> Tensor:
        """The output projection of the heads' concatenation ``out`` (..., C), plus ``residual`` if given."""
        if residual is None:
            return self.out_proj(out)
        return linear_add(out, self.out_proj.weight, self.out_proj.bias, residual)

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention keys and values of ``memory`` (B, S, C): two (B, Hkv, S, D) tensors."""
        B = memory.shape[0]
        k, v = self.kv_proj(memory).view(B, -1, 2, self.num_kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return k, v

    def inference_step(self, kv: Tensor) -> Callable[[Tensor, int, Tensor | None, tuple[Tensor, Tensor] | None],
                                                     Tensor]:
        """A plain function for one eval-mode decode step of self-attention over the cache ``kv``
        (2, B, Hkv, max_len, D), the same computation as ``forward`` with T = 1, without module overhead,
        on one position per row (2-D ``x``, so each linear is a single matrix product)::

            step(x (B, C), pos, attn_mask (B|1, H|1, 1, pos + 1) | None, rope) -> (B, C)

        writes the new key and value at ``pos`` and attends over positions ``[0, pos]``. With ``pos`` a (B, 1)
        tensor (rows at different lengths), row b writes at ``pos[b]`` and attends over the first
        ``attn_mask.shape[-1]`` positions, the mask (B, 1|H, 1, S) hiding each row's later ones.
        """
        if self.cross:
            raise ValueError("inference_step is for self-attention")
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        w_in, b_in = self.qkv_proj.weight, self.qkv_proj.bias
        w_out, b_out = self.out_proj.weight, self.out_proj.bias
        backend = self.backend
        k_buf, v_buf = kv[0], kv[1]  # (B, Hkv, max_len, D) each
        qkv_linear = decode_linear(w_in, b_in, rows=kv.shape[1])
        out_linear = decode_linear(w_out, b_out, rows=kv.shape[1])

        def step(x: Tensor, pos: int | Tensor, attn_mask: Tensor | None,
                 rope: tuple[Tensor, Tensor] | None) -> Tensor:
            B = x.shape[0]
            qkv = qkv_linear(x).view(B, H + 2 * Hkv, 1, D)  # (B, H + 2Hkv, T=1, D): no transpose
            if isinstance(pos, Tensor):  # (B, 1): rows at different lengths (a server's running batch)
                qk = qkv[:, :H + Hkv] if rope is None else apply_rotary(qkv[:, :H + Hkv], *rope)
                rows = torch.arange(B, device=x.device)
                k_buf[rows, :, pos[:, 0]] = qk[:, H:, 0]
                v_buf[rows, :, pos[:, 0]] = qkv[:, H + Hkv:, 0]
                S = attn_mask.shape[-1]  # the mask hides each row's positions past its own
                if backend is sdpa_attention and Hkv == H and x.device.type == "cpu":
                    out = _masked_one_query(qk[:, :H], k_buf[:, :, :S], v_buf[:, :, :S], attn_mask)
                else:
                    out, _ = backend(qk[:, :H], k_buf[:, :, :S], v_buf[:, :, :S], attn_mask, False, 0.0, False)
                return out_linear(out.reshape(B, H * D))
            end = pos + 1
            if rope is None:
                q = qkv[:, :H]
                kv[:, :, :, pos:end] = qkv[:, H:].view(B, 2, Hkv, 1, D).transpose(0, 1)  # (2, B, Hkv, 1, D)
            else:
                qk = apply_rotary(qkv[:, :H + Hkv], *rope)  # q and k rotated together: (B, H + Hkv, 1, D)
                q = qk[:, :H]
                k_buf[:, :, pos:end] = qk[:, H:]
                v_buf[:, :, pos:end] = qkv[:, H + Hkv:]
            out, _ = backend(q, k_buf[:, :, :end], v_buf[:, :, :end], attn_mask, False, 0.0, False)
            return out_linear(out.reshape(B, H * D))  # (B, H, 1, D) -> (B, C)

        return step

    def cross_inference_step(self, memory_kv: tuple[Tensor, Tensor],
                             memory_mask: Tensor | None) -> Callable[[Tensor], Tensor]:
        """A plain function for one eval-mode decode step of cross-attention over precomputed memory keys and
        values (:meth:`memory_kv`, each (Bm, Hkv, S, D)) and the memory's additive mask (Bm, 1, 1, S) | None,
        the same computation as ``forward`` with T = 1, on one position per row::

            step(x (B, C)) -> (B, C)      # B = Bm * g: each group of g rows (beams) attends to one memory row

        The group is folded into the query length, as in ``forward``.
        """
        if not self.cross:
            raise ValueError("cross_inference_step is for cross-attention")
        H, D = self.num_heads, self.head_dim
        w_q, b_q = self.q_proj.weight, self.q_proj.bias
        w_out, b_out = self.out_proj.weight, self.out_proj.bias
        backend = self.backend
        k, v = memory_kv
        Bm = k.shape[0]
        q_linear, out_linear = decode_linear(w_q, b_q), decode_linear(w_out, b_out)

        def step(x: Tensor) -> Tensor:
            B = x.shape[0]
            q = q_linear(x).view(Bm, B // Bm, H, D).transpose(1, 2)  # (Bm, H, g, D)
            out, _ = backend(q, k, v, memory_mask, False, 0.0, False)  # (Bm, H, g, D)
            return out_linear(out.transpose(1, 2).reshape(B, H * D))

        return step


from .linear_attention import LinformerAttention, PerformerAttention  # noqa: E402  (they register here)

ATTENTION_BACKENDS.register("performer")(PerformerAttention)
ATTENTION_BACKENDS.register("linformer")(LinformerAttention)

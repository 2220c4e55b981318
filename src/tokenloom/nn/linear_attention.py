"""Attention in time and memory linear in the sequence length: Performer (FAVOR+) and Linformer.

Both are attention backends (``attention: performer | linformer`` in a model config) with the signature of
:data:`~tokenloom.nn.attention.ATTENTION_BACKENDS`; unlike ``sdpa`` and ``math`` they hold state, so each
:class:`~tokenloom.nn.attention.MultiHeadAttention` builds its own instance (a submodule named ``backend``).

* :class:`PerformerAttention` (Choromanski et al. 2021): softmax attention estimated with positive orthogonal
  random features, ``exp(q . k / sqrt(D)) ~ phi(q) . phi(k)`` with ``phi(x) = exp(W x - |x|^2 / 2) / sqrt(m)``
  (x scaled by ``D^-1/4``, the m rows of W orthogonal in blocks, with Gaussian-vector norms), so that
  ``softmax(q k^T) v ~ phi(q) (phi(k)^T v) / (phi(q) phi(k)^T 1)``: O(T m D) instead of O(T^2 D). The causal
  form runs over chunks of ``chunk`` positions: exact-structured within a chunk (a lower-triangular
  ``phi(q) phi(k)^T``), a running sum ``phi(k)^T v`` across chunks (the prefix sums), so memory stays linear.
  ``redraw`` > 0 draws new features every ``redraw`` training calls (seeded by the count, so a resumed run
  draws the same). Masks: key padding, causal, and their combination (what the models pass); a score bias
  (ALiBi, T5) cannot be expressed and is refused by the configs.
* :class:`LinformerAttention` (Wang et al. 2020): keys and values projected along the sequence by learned
  (k, max_len) matrices to k positions, then exact attention over those: O(T k D). It mixes all positions, so it
  is non-causal: causal use is refused, as is a sequence longer than ``max_len``.

Attention dropout does not apply to either (there are no attention probabilities to drop); they never return
attention weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..errors import ConfigError, GenerationError


def orthogonal_random_features(num_features: int, dim: int, generator: torch.Generator | None = None) -> Tensor:
    """(num_features, dim) rows: blocks of ``dim`` orthonormal directions (QR of a Gaussian matrix), each row
    scaled by the norm of a Gaussian vector, so every row is marginally N(0, I) (FAVOR+'s ``W``)."""
    blocks = []
    for _ in range(-(-num_features // dim)):
        q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=generator))
        blocks.append(q.T)
    directions = torch.cat(blocks)[:num_features]
    norms = torch.randn(num_features, dim, generator=generator).norm(dim=1, keepdim=True)
    return directions * norms


def favor_features(x: Tensor, features: Tensor, is_query: bool, eps: float = 1e-4, scale: float = 1.0) -> Tensor:
    """Positive random features of ``scale * x`` (x (..., T, D); FAVOR+ scales q and k by ``D^-1/4``) ->
    (..., T, m), float32, without materialising the scaled x.

    The largest exponent is subtracted for stability: per query row (it cancels in the ratio of each query's
    output) and over all keys of a head (a common factor of every key, which also cancels)."""
    x = x.float()
    projected = x @ (scale * features.float()).T  # (..., T, m)
    peak = projected.amax(-1, keepdim=True) if is_query else projected.amax(dim=(-2, -1), keepdim=True)
    squared = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square()
    shift = (0.5 * scale * scale) * squared + peak.detach()  # (..., T, 1): one pass over (T, m) below
    # FAVOR+'s 1 / sqrt(m) is left out: it scales numerator and normaliser alike
    if torch.is_grad_enabled() and (x.requires_grad or features.requires_grad):
        return torch.exp(projected - shift) + eps
    return projected.sub_(shift).exp_().add_(eps)  # inference: in place, no fresh (T, m) buffers to fault in


def _key_weights(attn_mask: Tensor | None, is_causal: bool, tq: int, tk: int,
                 name: str) -> tuple[Tensor | None, bool]:
    """From a model's mask (bool, True = may attend, or additive: 0 / a large negative number): (key weights
    (B|1, H|1, Tk, 1), 1 = may be attended, or None; causal). A mask with a query dimension must be key padding,
    alone or combined with the bottom-right-aligned causal mask; anything else (a score bias, another pattern)
    is a one-line error naming the backend ``name``."""
    if attn_mask is None:
        return None, is_causal
    if attn_mask.dtype == torch.bool:
        allowed = attn_mask
    else:
        very_negative = torch.finfo(attn_mask.dtype).min / 2
        if bool(((attn_mask != 0) & (attn_mask > very_negative)).any()):
            raise GenerationError(f"{name} attention cannot add a score bias to the attention (alibi, t5)")
        allowed = attn_mask == 0
    while allowed.dim() < 4:
        allowed = allowed.unsqueeze(0)
    keys = allowed[..., -1:, :]  # the last query sees every real key (padding alone or with the causal mask)
    if allowed.shape[-2] > 1 and not bool((allowed == keys).all()):
        causal = torch.ones(tq, tk, dtype=torch.bool, device=allowed.device).tril(tk - tq)
        if not bool((allowed == (keys & causal)).all()):
            raise GenerationError(f"{name} attention takes causal and key-padding masks only, not an arbitrary "
                                  "pattern")
        is_causal = True
    return keys.transpose(-1, -2).float(), is_causal


@torch.no_grad()
def _draw(num_features: int, dim: int, seed: int, draws: int, device: torch.device) -> Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + draws)
    return orthogonal_random_features(num_features, dim, generator).to(device)


@dataclass
class PerformerOptions:
    """``attention_options`` of ``attention: performer``."""

    features: int = 0  # random features per head; 0 = round(head_dim * ln head_dim), the paper's choice
    redraw: int = 0  # draw new features every N training calls; 0 = never

    def __post_init__(self) -> None:
        for name in ("features", "redraw"):
            value = getattr(self, name)
            if value < 0:
                raise ConfigError(f"attention_options.{name} must be an integer >= 0, got {value}")


@dataclass
class LinformerOptions:
    """``attention_options`` of ``attention: linformer``."""

    k: int = 64  # positions the keys and values are projected to

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"attention_options.k must be an integer >= 1, got {self.k}")


class PerformerAttention(nn.Module):
    """FAVOR+ attention (see the module docstring). ``features`` 0 = ``round(D ln D)``, the paper's choice."""

    Options = PerformerOptions

    def __init__(self, num_heads: int, head_dim: int, *, features: int = 0, redraw: int = 0, chunk: int = 128,
                 max_len: int | None = None) -> None:
        super().__init__()
        self.head_dim, self.chunk = head_dim, chunk
        self.num_features = features or max(1, round(head_dim * math.log(head_dim)))
        self.redraw = redraw
        self.seed = int(torch.randint(0, 2**31 - 1, (1,)).item())  # from the (seeded) model initialisation
        self.register_buffer("features", _draw(self.num_features, head_dim, self.seed, 0, torch.device("cpu")))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))  # training calls, for the redraws

    def extra_repr(self) -> str:
        return f"features={self.num_features}, redraw={self.redraw}, chunk={self.chunk}"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, dropout_p: float,
                need_weights: bool) -> tuple[Tensor, None]:
        if self.training and self.redraw:
            if int(self.calls) % self.redraw == 0 and int(self.calls) > 0:
                self.features.copy_(_draw(self.num_features, self.head_dim, self.seed, int(self.calls) // self.redraw,
                                          self.features.device))
            self.calls += 1
        if q.shape[1] != k.shape[1]:  # grouped-query attention
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        tq, tk = q.shape[-2], k.shape[-2]
        weights, causal = _key_weights(attn_mask, is_causal, tq, tk, "performer")
        scale = self.head_dim ** -0.25
        qf = favor_features(q, self.features, is_query=True, scale=scale)  # (B, H, Tq, m)
        kf = favor_features(k, self.features, is_query=False, scale=scale)  # (B, H, Tk, m)
        if weights is not None:
            kf = kf * weights
        vf = v.float()
        if causal:
            out = self._causal(qf, kf, vf)
        else:
            context = kf.transpose(-2, -1) @ vf  # (B, H, m, D)
            normaliser = qf @ kf.sum(-2).unsqueeze(-1)  # (B, H, Tq, 1)
            out = (qf @ context) / normaliser.clamp_min(torch.finfo(torch.float32).tiny)
        return out.to(q.dtype), None

    def _causal(self, qf: Tensor, kf: Tensor, vf: Tensor) -> Tensor:
        """Causal FAVOR+ (query i sees keys up to i + Tk - Tq) over chunks: the running state is the prefix sum
        of phi(k)^T v and of phi(k)."""
        tq, tk = qf.shape[-2], kf.shape[-2]
        offset = tk - tq  # keys before the first query (a cache): seen by every query
        state = kf[..., :offset, :].transpose(-2, -1) @ vf[..., :offset, :]  # (B, H, m, D)
        total = kf[..., :offset, :].sum(-2)  # (B, H, m)
        outs = []
        for start in range(0, tq, self.chunk):
            end = min(start + self.chunk, tq)
            qc, kc, vc = qf[..., start:end, :], kf[..., offset + start:offset + end, :], vf[..., offset + start:
                                                                                          offset + end, :]
            local = (qc @ kc.transpose(-2, -1)).tril()  # (B, H, c, c): within the chunk, causal
            numerator = qc @ state + local @ vc
            denominator = qc @ total.unsqueeze(-1) + local.sum(-1, keepdim=True)
            outs.append(numerator / denominator.clamp_min(torch.finfo(torch.float32).tiny))  # no key: 0
            state = state + kc.transpose(-2, -1) @ vc
            total = total + kc.sum(-2)
        return torch.cat(outs, dim=-2)


class LinformerAttention(nn.Module):
    """Linformer attention (see the module docstring): keys and values projected to ``k`` positions."""

    Options = LinformerOptions

    def __init__(self, num_heads: int, head_dim: int, *, max_len: int, k: int = 64) -> None:
        super().__init__()
        self.max_len, self.k = max_len, k
        self.proj_k = nn.Parameter(torch.randn(k, max_len) / math.sqrt(k))
        self.proj_v = nn.Parameter(torch.randn(k, max_len) / math.sqrt(k))

    def extra_repr(self) -> str:
        return f"k={self.k}, max_len={self.max_len}"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool, dropout_p: float,
                need_weights: bool) -> tuple[Tensor, None]:
        if is_causal:
            raise ConfigError("linformer attention is non-causal (its projections mix all positions); use sdpa or "
                              "performer for causal attention")
        tk = k.shape[-2]
        if tk > self.max_len:
            raise GenerationError(f"sequence of {tk} positions exceeds the linformer projection length "
                                  f"{self.max_len}")
        if attn_mask is not None:  # key padding: padded keys and values contribute nothing to the projections
            weights, causal = _key_weights(attn_mask, False, q.shape[-2], tk, "linformer")
            if causal:
                raise ConfigError("linformer attention is non-causal; it got a causal mask")
            k, v = k * weights.to(k.dtype), v * weights.to(v.dtype)
        keys = torch.matmul(self.proj_k[:, :tk].to(k.dtype), k)  # (B, Hkv, k, D)
        values = torch.matmul(self.proj_v[:, :tk].to(v.dtype), v)
        out = F.scaled_dot_product_attention(q, keys, values, dropout_p=dropout_p if self.training else 0.0,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out, None

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
  Stabilisers (exp overflows past ~88): a query's features are divided by their own largest exponent, keys by
  the largest among the keys the query may see (a running maximum in the causal form), never by a padded or a
  future key (:func:`favor_features`, :meth:`PerformerAttention._causal`).
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

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..errors import ConfigError, GenerationError
from .masks import causal_mask


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


def favor_exponents(x: Tensor, features: Tensor, scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """The exponents of FAVOR+'s positive features ``phi(x) = exp(W x' - |x'|^2 / 2)`` of ``x' = scale * x``
    (x (..., T, D); FAVOR+ scales q and k by ``D^-1/4``; its ``1 / sqrt(m)`` is left out: it scales numerator and
    normaliser alike), float32: (``W x'`` (..., T, m), its row maximum ``peak`` (..., T), a constant for autograd,
    and ``|x'|^2 / 2`` (..., T))."""
    x = x.float()
    projected = x @ (scale * features.float()).T  # (..., T, m)
    half_norm = (0.5 * scale * scale) * torch.linalg.vector_norm(x, dim=-1).square()  # (..., T)
    return projected, projected.detach().amax(-1), half_norm


def positive_features(projected: Tensor, shift: Tensor, eps: float) -> Tensor:
    """``exp(projected - shift) + eps`` (projected (..., T, m), shift (..., T)); in inference in place, so no
    fresh (T, m) buffer is faulted in."""
    if projected.requires_grad:
        return torch.exp(projected - shift.unsqueeze(-1)) + eps
    out = projected.sub_(shift.unsqueeze(-1)).exp_()
    return out.add_(eps) if eps else out


def _finite(reference: Tensor) -> Tensor:
    """A stabiliser with -inf (no allowed key seen yet) replaced by 0: every weight it divides is 0 there anyway."""
    return reference.masked_fill(reference == -math.inf, 0.0)


def favor_features(x: Tensor, features: Tensor, is_query: bool, eps: float = 1e-4, scale: float = 1.0,
                   keep: Tensor | None = None) -> Tensor:
    """Positive random features of ``scale * x`` (x (..., T, D)) -> (..., T, m), float32, stabilised and with
    ``eps`` added (every feature positive, so no normaliser is 0), as FAVOR+'s reference implementations do:

    * queries: ``phi(q) / exp(peak_q) + eps``, ``peak_q = max_f (W q')_f``: each row divided by its own largest
      exponent, a factor of that query's numerator and normaliser alike;
    * keys: ``phi(k) / exp(M) + eps`` with ``M = max_j peak_j`` over the rows ``keep`` (bool (..., T), None = all)
      marks, the others 0: one factor shared by the keys a query sees when it sees all of them. A causal query
      takes M over the keys before it (:meth:`PerformerAttention._causal`); a padded or future key in M would
      move its eps."""
    projected, peak, half_norm = favor_exponents(x, features, scale)
    if is_query:
        return positive_features(projected, peak + half_norm, eps)
    if keep is not None:
        peak = peak.masked_fill(~keep, -math.inf)
    out = positive_features(projected, half_norm + _finite(peak.amax(-1, keepdim=True)), eps)
    return out if keep is None else out.masked_fill(~keep.unsqueeze(-1), 0.0)


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
        causal = causal_mask(tq, tk, allowed.device)
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
        self.eps = 1e-4  # added to every feature (FAVOR+'s reference implementations): no normaliser is 0
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
        qf = favor_features(q, self.features, is_query=True, eps=self.eps, scale=scale)  # (B, H, Tq, m)
        keep = None if weights is None else (weights.squeeze(-1) > 0).expand(*k.shape[:-1])  # (B, H, Tk)
        vf = v.float() if keep is None else v.float().masked_fill(~keep.unsqueeze(-1), 0.0)  # whatever sits there
        if causal:
            out = self._causal(qf, k, keep, vf)
        else:
            kf = favor_features(k, self.features, is_query=False, eps=self.eps, scale=scale, keep=keep)  # (B,H,Tk,m)
            context = kf.transpose(-2, -1) @ vf  # (B, H, m, D)
            normaliser = qf @ kf.sum(-2).unsqueeze(-1)  # (B, H, Tq, 1)
            out = (qf @ context) / normaliser.clamp_min(torch.finfo(torch.float32).tiny)  # no key: 0
        return out.to(q.dtype), None

    def _causal(self, qf: Tensor, k: Tensor, keep: Tensor | None, vf: Tensor) -> Tensor:
        """Causal FAVOR+: query i sits at key position p = i + Tk - Tq (the last Tq of Tk positions, a cache before
        them) and sees the allowed keys j <= p, exactly as the non-causal form would over those keys alone (a
        one-token decode step over the cache). qf (B, H, Tq, m) (:func:`favor_features`), k (B, H, Tk, D), ``keep``
        (B, H, Tk) bool (False: a masked key) or None, vf (B, H, Tk, D). A key's features are split as
        ``phi(k_j) = ku_j exp(ks_j)``, ``ku_j = exp(W k_j' - peak_j)`` in (0, 1], ``ks_j = peak_j - |k_j'|^2 / 2``
        (:func:`favor_exponents`), so that each is stabilised by itself alone.

        Query i's key features are ``phi(k_j) / exp(m_p) + eps`` with ``m_p = max_{j <= p} peak_j``, a running
        maximum over the keys it may see: no future or padded key moves it, and ``w_pj = exp(ks_j - m_p) <= 1``
        (ks_j <= peak_j <= m_p), so nothing overflows. With ``Q_i = sum_f qf_if``::

            out_i = sum_{j<=p} a_ij v_j / sum_{j<=p} a_ij,   a_ij = w_pj (qf_i . ku_j) + eps Q_i

        (masked keys left out of both sums), which is ``phi(q_i) . phi(k_j)`` up to the factors exp(-peak_q) and
        exp(-m_p) of query i alone, and those cancel. Over chunks of ``chunk`` queries: within a chunk the a_ij are
        explicit (a lower-triangular (c, c) matrix); across chunks the prefix sums ``S = sum_j exp(ks_j - M) ku_j
        [v_j, 1]^T`` (m, D + 1) are kept relative to M, the running maximum at the last key summed. Since
        ``exp(ks_j - M') = exp(ks_j - M) exp(M - M')``, a later query reads them times ``exp(M - m_p) <= 1`` and
        the next chunk's reference M' rescales them the same way (the online-softmax update): memory stays
        linear, and a large key arriving later never overflows the state nor changes an earlier output. The eps
        part needs plain prefix sums ``sum_j [v_j, 1]`` (eps is not rescaled)."""
        tq, tk = qf.shape[-2], k.shape[-2]
        offset = tk - tq  # keys before the first query (a cache): seen by every query
        projected, peak, half_norm = favor_exponents(k, self.features, self.head_dim ** -0.25)
        ks = peak - half_norm  # (B, H, Tk)
        ku = positive_features(projected, peak, 0.0)  # (B, H, Tk, m)
        allowed = torch.ones_like(ks) if keep is None else keep.float()  # (B, H, Tk)
        if keep is not None:  # a masked key has no weight (w_pj = 0: its ku <= 1 is multiplied by 0, its [v, 1] is
            # 0) and no say in any stabiliser
            ks, peak = ks.masked_fill(~keep, -math.inf), peak.masked_fill(~keep, -math.inf)
        running = peak.cummax(-1).values  # (B, H, Tk): m_p; -inf while no allowed key is seen
        reference = _finite(running)  # what each position's weights are taken relative to
        values = torch.cat([vf, allowed.unsqueeze(-1)], dim=-1)  # (B, H, Tk, D + 1): [v_j, 1], 0 at a masked key
        B, H, _, m = ku.shape
        state = qf.new_zeros(B, H, m, values.shape[-1])  # S
        plain = qf.new_zeros(B, H, 1, values.shape[-1])  # sum_j [v_j, 1]
        seen = running.new_full((B, H), -math.inf)  # M (exp(-inf - M') = 0: the state is empty)
        ones = qf.new_ones(B, H, m, 1)  # reads Q_i = qf_i . 1 in the same product as qf_i S
        # the cache's keys, then one piece per chunk of queries (split, not sliced: one gradient copy, not one each)
        sizes = ([offset] if offset else []) + [min(self.chunk, tq - start) for start in range(0, tq, self.chunk)]
        ends = [hi - 1 for hi in itertools.accumulate(sizes)]  # each piece's last key position
        pieces = list(zip(ku.split(sizes, -2), ks.split(sizes, -1), values.split(sizes, -2), reference.split(sizes, -1),
                          allowed.split(sizes, -1), ends, strict=True))

        def absorb(state: Tensor, plain: Tensor, seen: Tensor, u: Tensor, s: Tensor, vals: Tensor,
                   last: int) -> tuple[Tensor, Tensor, Tensor]:
            """The prefix sums with a piece of keys added (u (B, H, n, m), s (B, H, n), vals (B, H, n, D + 1)), S
            relative to the running maximum at its last key, position ``last``."""
            new = reference[..., last]  # (B, H)
            carry = torch.exp(seen - new)[..., None, None]  # (B, H, 1, 1), <= 1
            state = carry * state + u.transpose(-2, -1) @ (vals * torch.exp(s - new.unsqueeze(-1)).unsqueeze(-1))
            return state, plain + vals.sum(-2, keepdim=True), running[..., last]

        if offset:
            u, s, vals, _, _, last = pieces.pop(0)
            state, plain, seen = absorb(state, plain, seen, u, s, vals, last)
        outs = []
        for qc, (u, s, vals, m_q, keys, last) in zip(qf.split(self.chunk, -2), pieces, strict=True):
            # qc (B, H, c, m); m_q (B, H, c): each query's m_p; keys (B, H, c): 1 = an allowed key
            carry = torch.exp(seen.unsqueeze(-1) - m_q).unsqueeze(-1)  # (B, H, c, 1): the state read at each m_p
            read = qc @ torch.cat([state, ones], dim=-1)  # (B, H, c, D + 2): qf_i S and Q_i
            eps_q = self.eps * read[..., -1:]  # (B, H, c, 1)
            # w_pj, clamped to <= 1 past the diagonal too (tril_ zeroes those); 0 at a masked key (ks_j = -inf)
            decay = (s.unsqueeze(-2) - m_q.unsqueeze(-1)).clamp_max_(0.0).exp_()  # (B, H, c, c)
            local = (qc @ u.transpose(-2, -1)).mul_(decay).addcmul_(eps_q, keys.unsqueeze(-2)).tril_()  # a_ij
            both = carry * read[..., :-1] + eps_q * plain + local @ vals  # (B, H, c, D + 1): numerator, normaliser
            outs.append(both[..., :-1] / both[..., -1:].clamp_min(torch.finfo(torch.float32).tiny))  # no key: 0
            if last < tk - 1:
                state, plain, seen = absorb(state, plain, seen, u, s, vals, last)
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

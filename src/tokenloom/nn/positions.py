"""Position information, by name: ``sinusoidal``, ``learned``, ``rope``, ``alibi``, ``t5``, ``none``.

Two kinds of scheme:

* added to the token embeddings: ``sinusoidal`` (Vaswani et al. 2017) and ``learned`` (GPT-2) implement
  :meth:`Position.embed`;
* applied inside attention: ``rope`` rotates queries and keys (:meth:`Position.rotary`), ``alibi`` and
  ``t5`` add a bias to the attention scores (:meth:`Position.bias`).

``rope`` takes an optional frequency ``scaling`` (a plain dict such as ``{"type": "linear", "factor": 2.0}``,
see :data:`ROPE_SCALINGS` and :func:`rope_frequencies`) that stretches a model to longer contexts; the
computations match Hugging Face transformers' ``rope_type`` of the same name.

A model calls all three hooks once per forward and hands the results to every layer; a scheme returns
None from the hooks it does not use. Shapes: B batch, T positions, C embed_dim, H heads, D head_dim.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from ..registry import Registry, did_you_mean

POSITIONS: Registry[type[Position]] = Registry("position")
Relative = Callable[[Tensor, int], tuple[Tensor, Tensor]]


class Position(nn.Module):
    """Base class: every hook returns None."""

    def __init__(self, *, embed_dim: int, num_heads: int, head_dim: int, max_seq_len: int, **kwargs) -> None:
        super().__init__()

    def embed(self, positions: Tensor) -> Tensor | None:
        """(B, T) position ids -> (B, T, C) to add to the token embeddings, or None."""
        return None

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor] | None:
        """(B, T) position ids -> (cos, sin), each (B, 1, T, D), for :func:`apply_rotary`, or None."""
        return None

    def bias(self, q_index: Tensor, k_index: Tensor) -> Tensor | None:
        """(Tq,) query and (Tk,) key indices -> (1, H, Tq, Tk) additive score bias, or None; (B, Tq) query
        indices (rows at different lengths) -> (B, H, Tq, Tk)."""
        return None

    def relative(self, layer: int, q_index: Tensor) -> Relative | None:
        """A score term that depends on the queries' content (Transformer-XL): for attention layer ``layer`` and
        queries at key indices ``q_index`` (B|1, T), a function ``(q (B, H, T, D), S keys) -> (q', term (B, H, T,
        S))`` that attention applies before its softmax: the scores become ``q' k^T / sqrt(D) + term``. None: the
        scheme has none."""
        return None

    extrapolates = True  # positions past max_seq_len are defined (False: a table of max_seq_len rows)

    def reserve(self, positions: int) -> None:
        """Make positions ``0 .. positions - 1`` available (a scheme with a table grows it; only called where
        :attr:`extrapolates`)."""

    @property
    def has_relative(self) -> bool:
        """Whether the scheme has a query-dependent score term (overrides :meth:`relative`: Transformer-XL)."""
        return type(self).relative is not Position.relative

    @property
    def has_bias(self) -> bool:
        """Whether the scheme adds a score bias (overrides :meth:`bias`: ALiBi, T5)."""
        return type(self).bias is not Position.bias


@POSITIONS.register("none")
class NoPosition(Position):
    """No position information (a causal decoder can still infer order)."""


def sinusoid_table(num_positions: int, dim: int, layout: str = "interleaved") -> Tensor:
    """(num_positions, dim) float32, computed in float64: angle pos * 10000^(-2i/dim) for i < ceil(dim/2);
    ``interleaved`` (the paper): sin on even, cos on odd features; ``halves`` (fairseq, Marian): all
    sines, then all cosines."""
    pos = torch.arange(num_positions, dtype=torch.float64)[:, None]
    inv = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = pos * inv  # (T, ceil(dim / 2))
    if layout == "halves":
        half = (dim + 1) // 2
        return torch.cat((angles.sin(), angles.cos()[:, : dim - half]), dim=1).float()
    table = torch.zeros(num_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)[:, : dim // 2]
    return table.float()


@POSITIONS.register("sinusoidal")
class SinusoidalPosition(Position):
    """Fixed sinusoids added to the token embeddings (Vaswani et al. 2017), sin/cos interleaved."""

    layout = "interleaved"
    extrapolates = False

    def __init__(self, *, embed_dim: int, max_seq_len: int, **kwargs) -> None:
        super().__init__(embed_dim=embed_dim, max_seq_len=max_seq_len, **kwargs)
        self.register_buffer("table", sinusoid_table(max_seq_len, embed_dim, self.layout), persistent=False)

    def embed(self, positions: Tensor) -> Tensor:
        return self.table[positions]


@POSITIONS.register("sinusoidal_halves")
class SinusoidalHalvesPosition(SinusoidalPosition):
    """The same sinusoids with all sines first, then all cosines (fairseq, Marian)."""

    layout = "halves"


@POSITIONS.register("learned")
class LearnedPosition(Position):
    extrapolates = False

    def __init__(self, *, embed_dim: int, max_seq_len: int, **kwargs) -> None:
        super().__init__(embed_dim=embed_dim, max_seq_len=max_seq_len, **kwargs)
        self.weight = nn.Embedding(max_seq_len, embed_dim)

    def embed(self, positions: Tensor) -> Tensor:
        return self.weight(positions)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, H, T, D) ``x`` by the angles in cos/sin (B, 1, T, D), half-split layout (GPT-NeoX/Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# --- RoPE frequency scaling -----------------------------------------------------------------------------------
#
# Each scaling is a function (inv_freq, *, head_dim, base, max_seq_len, **params) -> (inv_freq, attention_factor):
# it turns the unscaled inverse frequencies (D/2,) into scaled ones, and returns the factor by which cos and sin
# are multiplied. Its keyword-only parameters after ``max_seq_len`` are the parameters a ``scaling`` dict may
# set: those without a default are required. Each mirrors the function of the same rope_type in Hugging Face
# transformers' ``modeling_rope_utils`` (5.x) operation for operation, so the float32 results are identical.

RopeScaling = Callable[..., tuple[Tensor, float]]
ROPE_SCALINGS: Registry[RopeScaling] = Registry("rope_scaling type")
_ROPE_CONTEXT = ("head_dim", "base", "max_seq_len")  # passed by rope_frequencies, not set in the dict
_ROPE_BOOL_PARAMS = {"truncate"}
_ROPE_POSITIVE_PARAMS = {"factor", "original_max_position_embeddings"}


def _rope_pos_freqs(head_dim: int, base: float) -> Tensor:
    """base^(2i/D) for i < D/2: the wavelengths / 2pi of unscaled RoPE, float32."""
    return base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


@ROPE_SCALINGS.register("default")
def _rope_default(inv_freq: Tensor, *, head_dim: int, base: float, max_seq_len: int | None) -> tuple[Tensor, float]:
    """No scaling (Hugging Face's rope_type 'default')."""
    return inv_freq, 1.0


@ROPE_SCALINGS.register("linear")
def _rope_linear(inv_freq: Tensor, *, head_dim: int, base: float, max_seq_len: int | None,
                 factor: float) -> tuple[Tensor, float]:
    """Position interpolation (kaiokendev; Chen et al. 2023): every frequency divided by ``factor``."""
    return inv_freq / factor, 1.0


@ROPE_SCALINGS.register("llama3")
def _rope_llama3(inv_freq: Tensor, *, head_dim: int, base: float, max_seq_len: int | None, factor: float,
                 low_freq_factor: float, high_freq_factor: float,
                 original_max_position_embeddings: int) -> tuple[Tensor, float]:
    """Llama 3.1: wavelengths above original_len / low_freq_factor are divided by ``factor``, those below
    original_len / high_freq_factor kept, and those in between interpolated smoothly."""
    old_context_len = original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama), 1.0


@ROPE_SCALINGS.register("yarn")
def _rope_yarn(inv_freq: Tensor, *, head_dim: int, base: float, max_seq_len: int | None, factor: float,
               original_max_position_embeddings: int, attention_factor: float | None = None,
               beta_fast: float | None = None, beta_slow: float | None = None, mscale: float | None = None,
               mscale_all_dim: float | None = None, truncate: bool = True) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023): frequencies that rotate fewer than ``beta_slow`` times over the original context
    are interpolated (divided by ``factor``), those rotating more than ``beta_fast`` times are kept, with a linear
    ramp between; cos and sin are scaled by ``attention_factor`` (default 0.1 ln(factor) + 1)."""

    def get_mscale(scale: float, mscale: float = 1) -> float:
        if scale <= 1:
            return 1.0
        return 0.1 * mscale * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = beta_fast or 32  # like Hugging Face, 0 also means the default
    beta_slow = beta_slow or 1
    dim = head_dim

    def find_correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = find_correction_dim(beta_fast), find_correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent a singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    # Recomputed rather than derived from inv_freq: Hugging Face divides by factor * pos_freqs, not inv_freq / factor.
    pos_freqs = _rope_pos_freqs(head_dim, base)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq_extrapolation_factor = 1 - ramp
    inv_freq = (
        inv_freq_interpolation * (1 - inv_freq_extrapolation_factor)
        + inv_freq_extrapolation * inv_freq_extrapolation_factor
    )
    return inv_freq, float(attention_factor)


def _rope_scaling_parts(scaling: dict) -> tuple[str, RopeScaling, dict]:
    """Validate a scaling dict: (type name, function, parameters) or ConfigError."""
    if not isinstance(scaling, dict):
        raise ConfigError(f"rope_scaling must be a mapping such as {{type: linear, factor: 2.0}}, got {scaling!r}")
    params = dict(scaling)
    kind = params.pop("type", None)
    alias = params.pop("rope_type", None)
    if kind is not None and alias is not None and kind != alias:
        raise ConfigError(f"rope_scaling: 'type' {kind!r} and 'rope_type' {alias!r} disagree")
    kind = kind if kind is not None else alias
    if kind is None:
        raise ConfigError(f"rope_scaling needs a 'type', one of: {', '.join(ROPE_SCALINGS.names())}")
    fn = ROPE_SCALINGS.get(kind)  # RegistryError (a ConfigError) naming the known types
    spec = {name: p for name, p in inspect.signature(fn).parameters.items()
            if p.kind is p.KEYWORD_ONLY and name not in _ROPE_CONTEXT}
    for name in params:
        if name not in spec:
            known = ", ".join(spec) or "none"
            raise ConfigError(f"rope_scaling: {kind!r} has no parameter {name!r}{did_you_mean(name, spec)}; "
                              f"its parameters: {known}")
    missing = [name for name, p in spec.items() if p.default is p.empty and name not in params]
    if missing:
        raise ConfigError(f"rope_scaling: {kind!r} needs {', '.join(repr(m) for m in missing)}")
    for name, value in params.items():
        if value is None and spec[name].default is None:
            continue
        if name in _ROPE_BOOL_PARAMS:
            if not isinstance(value, bool):
                raise ConfigError(f"rope_scaling: {kind!r} {name} must be true or false, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"rope_scaling: {kind!r} {name} must be a number, got {value!r}")
        elif name in _ROPE_POSITIVE_PARAMS and value <= 0:
            raise ConfigError(f"rope_scaling: {kind!r} {name} must be positive, got {value!r}")
    return kind, fn, params


def check_rope_scaling(scaling: dict | None) -> None:
    """Raise ConfigError when ``scaling`` is not None and not a valid scaling dict (cheap: builds no tensors)."""
    if scaling is not None:
        _rope_scaling_parts(scaling)


def rope_frequencies(head_dim: int, base: float = 10000.0, scaling: dict | None = None,
                     max_seq_len: int | None = None) -> tuple[Tensor, float]:
    """RoPE inverse frequencies (head_dim/2,) float32 and the factor cos and sin are multiplied by.

    ``scaling`` is None or a dict with a ``type`` (alias ``rope_type``) from :data:`ROPE_SCALINGS` and that
    type's parameters, e.g. ``{"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}``; ConfigError on an unknown type or a missing or unknown parameter.
    """
    inv_freq = 1.0 / _rope_pos_freqs(head_dim, base)
    if scaling is None:
        return inv_freq, 1.0
    _, fn, params = _rope_scaling_parts(scaling)
    return fn(inv_freq, head_dim=head_dim, base=base, max_seq_len=max_seq_len, **params)


@POSITIONS.register("rope")
class RotaryPosition(Position):
    """Rotary position embedding (Su et al. 2021): q·k depends on positions only through their offset.

    ``scaling``: optional frequency scaling for longer contexts, see :func:`rope_frequencies`."""

    def __init__(self, *, head_dim: int, max_seq_len: int, base: float = 10000.0, scaling: dict | None = None,
                 **kwargs) -> None:
        super().__init__(head_dim=head_dim, max_seq_len=max_seq_len, **kwargs)
        if head_dim % 2:
            raise ValueError(f"rope needs an even head_dim, got {head_dim}")
        inv, self.attention_factor = rope_frequencies(head_dim, base, scaling, max_seq_len)
        self.register_buffer("inv", inv, persistent=False)
        cos, sin = self._table(max_seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _table(self, n: int) -> tuple[Tensor, Tensor]:
        angles = torch.arange(n, dtype=torch.float32, device=self.inv.device)[:, None] * self.inv.float()  # (T, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (T, D)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def reserve(self, positions: int) -> None:
        """Grow the cos / sin tables to ``positions`` rows (doubling), for windowed models run past
        ``max_seq_len``."""
        if positions > self.cos.shape[0]:
            cos, sin = self._table(max(positions, 2 * self.cos.shape[0]))
            self.cos, self.sin = cos.to(self.cos.dtype), sin.to(self.sin.dtype)

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.cos[positions][:, None], self.sin[positions][:, None]  # (B, 1, T, D)


def alibi_slopes(num_heads: int) -> Tensor:
    """Press et al. 2022: a geometric sequence starting at 2^(-8/n); non-powers of two interleave."""

    def pow2(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        return torch.tensor(pow2(num_heads))
    closest = 2 ** math.floor(math.log2(num_heads))
    extra = pow2(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(pow2(closest) + extra)


@POSITIONS.register("alibi")
class AlibiPosition(Position):
    """Attention with linear biases: score(i, j) -= slope_h * (i - j)."""

    def __init__(self, *, num_heads: int, bidirectional: bool = False, **kwargs) -> None:
        super().__init__(num_heads=num_heads, **kwargs)
        self.bidirectional = bidirectional  # an encoder: penalise |i - j| in both directions
        self.register_buffer("slopes", alibi_slopes(num_heads)[:, None, None], persistent=False)

    def bias(self, q_index: Tensor, k_index: Tensor) -> Tensor:
        offset = q_index[..., :, None] - k_index[..., None, :]  # (B?, Tq, Tk)
        distance = (offset.abs() if self.bidirectional else offset.clamp(min=0)).float()
        bias = -self.slopes * distance[..., None, :, :]  # (B?, H, Tq, Tk)
        return bias if q_index.dim() == 2 else bias[None]


def t5_bucket(relative: Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """T5's relative position buckets (exact for small offsets, logarithmic up to ``max_distance``).
    ``relative`` = key index - query index."""
    bucket = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        bucket += (relative > 0).long() * num_buckets
        n = relative.abs()
    else:
        n = (-relative).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (
        torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).long()
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(is_small, n, large)


@POSITIONS.register("t5")
class T5Position(Position):
    """T5 relative position bias: a learned scalar per (bucket, head), shared by all layers."""

    def __init__(self, *, num_heads: int, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = False, **kwargs) -> None:
        super().__init__(num_heads=num_heads, **kwargs)
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.weight = nn.Embedding(num_buckets, num_heads)

    def bias(self, q_index: Tensor, k_index: Tensor) -> Tensor:
        relative = k_index[..., None, :] - q_index[..., :, None]  # (B?, Tq, Tk)
        buckets = t5_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        bias = self.weight(buckets).movedim(-1, -3)  # (B?, H, Tq, Tk)
        return bias if q_index.dim() == 2 else bias[None]


@POSITIONS.register("xl")
class XLPosition(Position):
    """Transformer-XL's relative positions (Dai et al. 2019): the score of query i and key j is

        (q_i + u) . k_j  +  (q_i + v) . (W_r r_{i-j})        (then / sqrt(D), softmax)

    with r the sinusoid of the distance i - j (the embedding width), per layer a projection W_r and the global
    content and position biases u, v (H, D) (untied across layers, as Hugging Face's ``untie_r``). Nothing is added
    to the embeddings and the keys carry no position, so a key cached in an earlier segment keeps its meaning:
    segment-level recurrence (``memory_len``) relies on it. Distances up to ``max_seq_len + memory_len``."""

    extrapolates = True

    def __init__(self, *, embed_dim: int, num_heads: int, head_dim: int, max_seq_len: int, num_layers: int = 1,
                 memory_len: int = 0, **kwargs) -> None:
        super().__init__(embed_dim=embed_dim, num_heads=num_heads, head_dim=head_dim, max_seq_len=max_seq_len)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.register_buffer("table", sinusoid_table(max_seq_len + memory_len, embed_dim, "halves"),
                             persistent=False)  # (distances, C): sines then cosines, as the paper's code
        self.projections = nn.ModuleList(nn.Linear(embed_dim, num_heads * head_dim, bias=False)
                                         for _ in range(num_layers))
        self.content_bias = nn.Parameter(torch.zeros(num_layers, num_heads, head_dim))  # u
        self.position_bias = nn.Parameter(torch.zeros(num_layers, num_heads, head_dim))  # v
        for projection in self.projections:
            nn.init.normal_(projection.weight, std=0.02)

    def bias(self, q_index: Tensor, k_index: Tensor) -> None:
        """No static bias: the position term depends on the queries (:meth:`relative`); declaring this hook makes
        the mask builder give attention an additive mask, to which the term is added."""
        return None

    def reserve(self, positions: int) -> None:
        """Grow the distance table (distances beyond ``max_seq_len + memory_len`` appear only when a forward is
        longer than a segment)."""
        if positions > self.table.shape[0]:
            self.table = sinusoid_table(max(positions, 2 * self.table.shape[0]), self.table.shape[1],
                                        "halves").to(self.table)

    def relative(self, layer: int, q_index: Tensor) -> Relative:
        projection, u, v = self.projections[layer], self.content_bias[layer], self.position_bias[layer]
        H, D = self.num_heads, self.head_dim

        def term(q: Tensor, S: int) -> tuple[Tensor, Tensor]:
            B, _, T, _ = q.shape
            if S > self.table.shape[0]:
                self.reserve(S)
            r = projection(self.table[:S].to(q.dtype)).view(S, H, D).transpose(0, 1)  # (H, S, D): distance d
            by_distance = (q + v[:, None]) @ r.transpose(-2, -1) * (1.0 / math.sqrt(D))  # (B, H, T, S)
            # (B|1, T, S) distances query - key; a future key's (negative) is masked anyway
            distance = (q_index[..., None] - torch.arange(S, device=q.device)).clamp(min=0, max=S - 1)
            return q + u[:, None], by_distance.gather(-1, distance[:, None].expand(B, H, T, S))

        return term


def create_position(name: str, **kwargs) -> Position:
    return POSITIONS.get(name)(**kwargs)

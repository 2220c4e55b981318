"""Weight-only int8 / int4 arithmetic: quantising a weight, its portable storage, and the kernels that multiply
activations by it (``x @ dequant(W).T + b``). :mod:`.quantized` builds the layers on it.

Storage (what a checkpoint holds, the same on every machine; quantised from float32, a bf16 weight converted first):

* int8: ``qweight`` int8 (out, in) and ``scales`` (out,): ``W ~ qweight * scales[:, None]``, symmetric per output
  channel, ``scale = max|w_row| / 127`` (q in [-127, 127]).
* int4: ``qweight`` uint8 (out, in / 2), two 4-bit values q in [0, 15] per byte: byte j of a row holds column j in
  its low nibble and column ``j + in / 2`` in its high one (unpacking is a concatenation); ``scales`` and ``zeros``
  (out, in / group_size): ``W ~ (q - 8) * scale + zero`` within each group of ``group_size`` input columns.
  Asymmetric (each group's minimum to maximum over the 16 levels) because that is the form torch's CPU int4 kernel
  (``_weight_int4pack_mm_for_cpu``, tinygemm's convention) takes: its ``qScaleAndZeros`` hold a float zero per
  group and it dequantises ``(q - 8) * scale + zero``. A symmetric grid is the special case zero = 0, which wastes
  range on every group that is not centred on 0 (the error bound is scale / 2 either way; the asymmetric scale is
  smaller). Neither int4 kernel nor the CPU kernel's own packed layout (machine-specific) is stored: it is made at
  load.

Kernels, by bit width (:data:`KERNELS`): ``runs(weights, dtype)`` says whether one computes a layer in activations of
``dtype`` here, ``prepare(weights, dtype)`` makes what it reads (a repacked weight, cast scales), ``matmul(x (rows,
in), bias, *prepared) -> (rows, out)``:

* ``dequantize`` (both widths, any device and dtype): the weight dequantised to the activations' dtype, in blocks of
  at most :data:`BLOCK_ELEMENTS` weights (a GPT-2 vocabulary head never makes a float copy at once), then
  ``F.linear``. int8 folds the per-row scale into the output (``(x @ q.T) * scale + b``: one conversion pass over
  the weight, no multiplication over it).
* ``_weight_int8pack_mm``: torch's CPU int8 weight-only kernel (float32 / bfloat16 / float16 activations).
* ``_weight_int4pack_mm_for_cpu``: torch's CPU int4 kernel, on the weight repacked into its layout
  (``_convert_weight_to_int4pack_for_cpu``) at load; out a multiple of 16, group_size 32, 64, 128 or 256.

Measured on an AMD EPYC with AVX2 only (no AVX-512; 2 cores shared with other work, torch 2.13.0, 1 thread; one
row x 384 -> 1536): float32 ``F.linear`` 0.06-0.14 ms, int8 ``dequantize`` 0.19-0.28 ms, ``_weight_int8pack_mm``
0.7-1.0 ms, int4 ``dequantize`` 0.45-0.8 ms, ``_weight_int4pack_mm_for_cpu`` 1.2-1.3 ms; at 16 rows torch's two
kernels take ~20 ms (they grow linearly with the rows; ``dequantize`` 0.5-1 ms). :func:`kernel_timings` measures the
kernels that run here (and agree with ``dequantize``) at one shape; the layers take the fastest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn import functional as F

BITS = (4, 8)  # the weight widths there are kernels for
INT4_GROUP_SIZES = (32, 64, 128, 256)  # int4 group sizes torch's CPU int4 kernel accepts
BLOCK_ELEMENTS = 1 << 20  # dequantize: weights made float at a time (4 MB in float32)
INNER_K_TILES = 2  # _convert_weight_to_int4pack_for_cpu's innerKTiles (the CPU layout is the same for 1, 2, 4, 8)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class QuantizedWeights(NamedTuple):
    """A quantised weight in its portable storage (see the module docstring)."""

    bits: int  # 8 or 4
    qweight: Tensor  # int8 (out, in) | uint8 (out, in / 2)
    scales: Tensor  # (out,) | (out, in / group_size)
    zeros: Tensor | None  # int4: (out, in / group_size); int8: None
    group_size: int  # int4: input columns per scale and zero

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.bits == 4 else 1)


def quantize_weight(weight: Tensor, bits: int, group_size: int = 128) -> QuantizedWeights:
    """A float weight (out, in) -> its int8 (per output row, symmetric) or int4 (per group of ``group_size`` input
    columns, asymmetric) storage, computed in float32."""
    w = weight.detach().float()
    if bits == 8:
        scales = w.abs().amax(1) / 127
        q = torch.round(w / torch.where(scales > 0, scales, 1)[:, None]).clamp_(-127, 127).to(torch.int8)
        return QuantizedWeights(8, q, scales, None, group_size)
    out, width = w.shape
    groups = w.view(out, width // group_size, group_size)  # (out, G, g)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = (high - low) / 15
    q = torch.round((groups - low[..., None]) / torch.where(scales > 0, scales, 1)[..., None]).clamp_(0, 15)
    return QuantizedWeights(4, pack_int4(q.to(torch.uint8).view(out, width)), scales, low + 8 * scales, group_size)


def pack_int4(q: Tensor) -> Tensor:
    """uint8 (out, in) values in [0, 15] -> uint8 (out, in / 2): column j in the low nibble, j + in / 2 in the high."""
    low, high = q.chunk(2, dim=1)
    return low | (high << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 (out, in / 2) -> uint8 (out, in): the inverse of :func:`pack_int4`."""
    return torch.cat((packed & 15, packed >> 4), dim=1)


def dequantize(weights: QuantizedWeights, dtype: torch.dtype = torch.float32) -> Tensor:
    """The float weight (out, in) the storage stands for: ``q * scale`` (int8), ``(q - 8) * scale + zero`` (int4)."""
    if weights.bits == 8:
        return (weights.qweight.float() * weights.scales.float()[:, None]).to(dtype)
    out, width = weights.out_features, weights.in_features
    q = unpack_int4(weights.qweight).float().view(out, -1, weights.group_size)
    w = (q - 8) * weights.scales.float()[..., None] + weights.zeros.float()[..., None]
    return w.view(out, width).to(dtype)


# --- kernels ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kernel:
    """One way to compute ``x @ dequant(W).T + b`` for one weight width (see the module docstring)."""

    name: str
    runs: Callable[[QuantizedWeights, torch.dtype], bool]  # computes this layer in activations of this dtype here
    prepare: Callable[[QuantizedWeights, torch.dtype], tuple[Tensor | int, ...]]  # what matmul reads after x, bias
    matmul: Callable[..., Tensor]  # (x (rows, in), bias | None, *prepared) -> (rows, out)


def _blocks(rows: int, width: int) -> list[tuple[int, int]]:
    step = max(1, BLOCK_ELEMENTS // max(width, 1))
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def _int8_dequantized(x: Tensor, bias: Tensor | None, q: Tensor, scales: Tensor) -> Tensor:
    blocks = _blocks(q.shape[0], q.shape[1])
    y = F.linear(x, q.to(x.dtype)) if len(blocks) == 1 else \
        torch.cat([F.linear(x, q[a:b].to(x.dtype)) for a, b in blocks], dim=-1)
    return y.mul_(scales) if bias is None else torch.addcmul(bias, y, scales)


def _int4_dequantized(x: Tensor, bias: Tensor | None, packed: Tensor, scales: Tensor, offsets: Tensor) -> Tensor:
    """``offsets = zero - 8 scale``: ``W = q * scale + offset``, one multiply-add over the unpacked weight."""
    out, width = packed.shape[0], packed.shape[1] * 2

    def block(a: int, b: int) -> Tensor:
        w = unpack_int4(packed[a:b]).to(x.dtype).view(b - a, scales.shape[1], -1)  # (rows, G, g)
        return F.linear(x, w.mul_(scales[a:b, :, None]).add_(offsets[a:b, :, None]).view(b - a, width))

    blocks = _blocks(out, width)
    y = block(*blocks[0]) if len(blocks) == 1 else torch.cat([block(a, b) for a, b in blocks], dim=-1)
    return y if bias is None else y.add_(bias)


def _aten(name: str):
    return getattr(torch.ops.aten, name, None)


_INT8_MM, _INT4_PACK, _INT4_MM = (_aten("_weight_int8pack_mm"), _aten("_convert_weight_to_int4pack_for_cpu"),
                                  _aten("_weight_int4pack_mm_for_cpu"))


def _int8_packed(x: Tensor, bias: Tensor | None, q: Tensor, scales: Tensor) -> Tensor:
    y = _INT8_MM(x, q, scales)
    return y if bias is None else y.add_(bias)


def _int4_packed(x: Tensor, bias: Tensor | None, packed: Tensor, scale_and_zeros: Tensor, group: int) -> Tensor:
    y = _INT4_MM(x, packed, group, scale_and_zeros)
    return y if bias is None else y.add_(bias)


def _int4_repack(w: QuantizedWeights, dtype: torch.dtype) -> tuple[Tensor | int, ...]:
    packed = _INT4_PACK(unpack_int4(w.qweight).to(torch.int32), INNER_K_TILES)
    scale_and_zeros = torch.stack((w.scales, w.zeros), dim=-1).transpose(0, 1).contiguous().to(dtype)  # (G, out, 2)
    return packed, scale_and_zeros, w.group_size


def _on_cpu(w: QuantizedWeights, dtype: torch.dtype) -> bool:
    return w.qweight.device.type == "cpu" and dtype in _FLOATS


KERNELS: dict[int, tuple[Kernel, ...]] = {
    8: (Kernel("dequantize", lambda w, dtype: True, lambda w, dtype: (w.qweight, w.scales.to(dtype)),
               _int8_dequantized),
        Kernel("_weight_int8pack_mm", lambda w, dtype: _INT8_MM is not None and _on_cpu(w, dtype),
               lambda w, dtype: (w.qweight, w.scales.to(dtype)), _int8_packed)),
    4: (Kernel("dequantize", lambda w, dtype: True,
               lambda w, dtype: (w.qweight, w.scales.to(dtype), (w.zeros - 8 * w.scales).to(dtype)),
               _int4_dequantized),
        Kernel("_weight_int4pack_mm_for_cpu",
               lambda w, dtype: (_INT4_MM is not None and _INT4_PACK is not None and _on_cpu(w, dtype)
                                 and w.out_features % 16 == 0 and w.group_size in INT4_GROUP_SIZES),
               _int4_repack, _int4_packed)),
}
FALLBACK = "dequantize"  # the kernel every layer can run


def kernel(bits: int, name: str) -> Kernel:
    """The kernel called ``name`` for ``bits``-bit weights."""
    for candidate in KERNELS[bits]:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no int{bits} kernel {name!r}; known: {', '.join(k.name for k in KERNELS[bits])}")


def tolerance(dtype: torch.dtype) -> float:
    """How far (relative to the largest output) a kernel's result may be from float32 on dequantised weights."""
    return 1e-4 if dtype == torch.float32 else 3e-2


def kernel_timings(bits: int, dtype: torch.dtype, rows: int, in_features: int, out_features: int,
                   group_size: int = 128, only: str | None = None, budget_s: float = 0.05,
                   repeats: int = 15) -> dict[str, float]:
    """Seconds per call of each ``bits``-bit kernel (or just ``only``) on CPU at ``rows`` x ``in_features`` ->
    ``out_features`` in ``dtype``, measured now, taking turns (the best of up to ``repeats`` calls, fewer once a
    kernel has used ``budget_s``); ``inf`` for a kernel that does not run here or disagrees with float32 on the
    dequantised weights. A few milliseconds at a decode step's size."""
    gen = torch.Generator().manual_seed(0)  # never the global generator: sampling after it stays as it was
    weights = quantize_weight(torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5, bits,
                              group_size)
    bias = (torch.randn(out_features, generator=gen) * 0.1).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    reference = F.linear(x.float(), dequantize(weights), bias.float())
    runs: dict[str, Callable[[], Tensor]] = {}
    result = {}
    with torch.no_grad():
        for candidate in KERNELS[bits]:
            if only is not None and candidate.name != only:
                continue
            result[candidate.name] = float("inf")
            if not candidate.runs(weights, dtype):
                continue
            try:
                run = partial(candidate.matmul, x, bias, *candidate.prepare(weights, dtype))
                out = run()
            except RuntimeError:  # the op refuses this shape or dtype here
                continue
            limit = tolerance(dtype) * (reference.abs().max().item() or 1.0)
            if out.shape == reference.shape and (out.float() - reference).abs().max().item() <= limit:
                runs[candidate.name] = run
        spent = dict.fromkeys(runs, 0.0)
        for attempt in range(repeats):
            for name, run in runs.items():
                if attempt >= 3 and spent[name] > budget_s:
                    continue
                start = time.perf_counter()
                run()
                took = time.perf_counter() - start
                spent[name] += took
                result[name] = min(result[name], took)
    return result

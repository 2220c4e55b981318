"""Linear layers fused with what follows them, for eval-mode inference on CPU (oneDNN).

``linear_act(x, weight, bias, act)`` = ``act(F.linear(x, weight, bias))`` and ``linear_add(x, weight, bias,
residual)`` = ``residual + F.linear(x, weight, bias)`` as one oneDNN primitive each
(``torch.ops.mkldnn._linear_pointwise``, the kernels ``torch.compile`` emits for CPU inference): the bias, the
activation and the residual are applied while the output tile is still in cache, instead of three more passes
over memory. In float32 the results equal the unfused ops (GELU, ReLU, residual add: bit for bit; SiLU to float
rounding).

They run only where they can and pay: :func:`fusable` is False with autograd recording (the fused primitive has no
backward), under autocast, off CPU, for dtypes other than float32 / bfloat16, when oneDNN is switched off or the op
is missing from the torch build, while ``torch.compile`` traces (Inductor fuses on its own), and for inputs of fewer
than ``FUSED_MIN_ROWS`` rows: each call costs oneDNN ~35 us more than a plain matrix product, so for a batch-1
decoder pass (15-45 rows x 256 -> 1024) the fused op is 30-60% slower than linear + add, and it only draws level
from ~1,000 rows (measured here, fp32, 2 threads).
Callers fall back to the plain ops.

The eval paths reach a linear layer through its module (:func:`bind_linear`, :func:`linear_act_of`,
:func:`linear_add_of`), dispatched by the module's type (:data:`LINEAR_FORMS`): an ``nn.Linear`` runs the
functions above, a weight-only quantised layer (:mod:`.quantized`) its kernel, through the same block bodies.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

_OPS = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
FUSED_MIN_ROWS = 2048  # rows (tokens) below which the plain ops are faster (see the module docstring)

# activation name (the MLP registry's) -> (oneDNN post-op, its algorithm)
ACTIVATIONS: dict[str, tuple[str, str]] = {
    "gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", ""), "silu": ("swish", ""),
}
_PLAIN = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu}


def fusable(x: Tensor, weight: Tensor) -> bool:
    """Whether the fused kernels apply to input ``x`` and ``weight`` now (see the module docstring)."""
    return (_OPS is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and weight.dtype == x.dtype and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
            and x.numel() >= FUSED_MIN_ROWS * x.shape[-1] and not torch.compiler.is_compiling()
            and torch._C._get_mkldnn_enabled())


def linear_act(x: Tensor, weight: Tensor, bias: Tensor | None, act: str) -> Tensor:
    """``act(F.linear(x, weight, bias))`` for ``act`` in :data:`ACTIVATIONS`, fused where :func:`fusable`."""
    if fusable(x, weight):
        op, algorithm = ACTIVATIONS[act]
        return _OPS(x, weight, bias, op, [], algorithm)
    return _PLAIN[act](F.linear(x, weight, bias))


def linear_add(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
    """``residual + F.linear(x, weight, bias)`` (a new tensor), fused where :func:`fusable`."""
    if fusable(x, weight) and residual.dtype == x.dtype:
        return _OPS.binary(x, residual, weight, bias, "add")
    return residual + F.linear(x, weight, bias)


# --- decode-step linear layers --------------------------------------------------------------------------------------

# oneDNN's packed bf16 weights need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and an ONEDNN_MAX_CPU_ISA that allows them
_REORDER = (getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
            if _OPS is not None and torch.ops.mkldnn._is_mkldnn_bf16_supported() else None)
# id(weight) -> (weakref to weight, data_ptr, version, updates, kind, prepared weight): see :func:`decode_linear`
_PREPARED: dict[int, tuple[weakref.ref, int, int, int, str, Tensor]] = {}
_UPDATES = [0]  # counts weights_updated() calls: part of a prepared weight's key


def weights_updated() -> None:
    """Forget every prepared decode weight (:func:`decode_linear`): to call after weights were written in place
    without bumping their version counters, as a fused optimizer step does (``torch.optim.AdamW(fused=True)`` on the
    CPU leaves ``_version`` as it was, so a decode step would otherwise keep reading the weights before the step)."""
    _UPDATES[0] += 1


def decode_linear(weight: Tensor, bias: Tensor | None, rows: int | None = None) -> Callable[[Tensor], Tensor]:
    """A plain function ``x (rows, in) -> F.linear(x, weight, bias)`` for eval-mode decode steps (a few rows per
    call; x (B, K, in) for steps of K positions per row, rows = B * K), through the kernel measured fastest here
    for the weight's dtype and the row count (2 threads, fp32 and bf16, 1 and 8 rows, 128-3,072 wide):

    * bfloat16: oneDNN on a weight pre-packed once into its blocked layout (``mkldnn._reorder_linear_weight``,
      what ``torch.compile(freezing=True)`` swaps in). Plain bf16 ``F.linear`` reads the weight at 10-14 GB/s
      at these sizes, the packed kernel at 20-30 GB/s: 1.3-2.2x faster, bit-identical.
    * float32 with ``rows`` > 1, and an output layer over a large vocabulary (``out >= 8 * in``) at any row
      count: ``addmm`` on a transposed, contiguous copy of the weight, which MKL's small-M path reads faster:
      1.3-1.5x (e.g. 8 x 768 -> 2304: 445 -> 355 us), 1.2x for GPT-2's 768 -> 50,257 head at one row (5.3 ->
      4.4 ms); equal to float rounding.
    * otherwise (float32 layers at one row, other devices and dtypes, no oneDNN or a CPU whose oneDNN has no bf16
      path, such as AVX2-only ones): ``F.linear`` itself.

    The prepared weight is made on the first call that needs it and kept (one more copy of the weight in
    memory) while the weight's storage and version counter are unchanged, so a training step, ``load_state_dict``
    or ``.to()`` make it anew (a fused optimizer's step, which bumps no version counter, through
    :func:`weights_updated`: the Trainer calls it after each update).
    With autograd recording or under autocast the function runs plain ``F.linear``
    (the prepared kernels have no backward and do not autocast).
    """
    kind = None
    if weight.device.type == "cpu" and weight.dim() == 2:
        if weight.dtype == torch.bfloat16 and _REORDER is not None and (bias is None or bias.dtype == weight.dtype):
            kind = "onednn"
        elif weight.dtype == torch.float32 and ((rows or 1) > 1 or weight.shape[0] >= 8 * weight.shape[1]):
            kind = "transposed"
    if kind is None:
        return partial(F.linear, weight=weight, bias=bias)
    slot = id(weight)
    last: list = [None, None]  # this function's (storage, version) and prepared weight: the common case

    def prepared() -> Tensor:
        # an inference tensor (a model loaded under inference_mode) has no version counter: its storage identifies it
        key = (weight.data_ptr(), 0 if weight.is_inference() else weight._version, _UPDATES[0])
        if last[0] == key:
            return last[1]
        entry = _PREPARED.get(slot)
        if entry is not None and entry[0]() is weight and entry[1:5] == (*key, kind):
            made = entry[5]
        else:
            with torch.no_grad():
                w = weight.detach()
                made = _REORDER(w) if kind == "onednn" else w.t().contiguous()
            _PREPARED[slot] = (weakref.ref(weight, lambda _: _PREPARED.pop(slot, None)), *key, kind, made)
        last[0], last[1] = key, made
        return made

    if kind == "onednn":
        def run(x: Tensor) -> Tensor:
            if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or x.dtype != torch.bfloat16:
                return F.linear(x, weight, bias)
            return _OPS(x, prepared(), bias, "none", [], "")
    else:
        def run(x: Tensor) -> Tensor:
            if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
                return F.linear(x, weight, bias)
            w_t = prepared()
            flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (B, K, in): a K-token step's B*K rows
            out = torch.mm(flat, w_t) if bias is None else torch.addmm(bias, flat, w_t)
            return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])
    return run


def decode_bf16_speedup(width: int, rows: int = 1, repeats: int = 15) -> float:
    """How many times faster a decode step's MLP input layer (``rows`` x ``width`` -> 4 ``width``, through
    :func:`decode_linear`, the kernels the decode step runs) is with bfloat16 weights than with float32 ones, measured
    now, the two taking turns (< 1: bf16 is slower). Tens of milliseconds at a GPT-2-small width; what
    ``--precision auto`` decides on."""
    import time

    runs = []
    gen = torch.Generator().manual_seed(0)  # never the global generator: sampling after it stays as it was
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(4 * width, width, generator=gen).to(dtype) / width ** 0.5
        runs.append((decode_linear(weight, torch.zeros(4 * width, dtype=dtype), rows),
                     torch.randn(rows, width, generator=gen).to(dtype)))
    best = [float("inf"), float("inf")]
    with torch.no_grad():
        for run, x in runs:  # warm-up: prepares the packed weight, creates the kernels
            run(x)
        for _ in range(repeats):
            for i, (run, x) in enumerate(runs):
                start = time.perf_counter()
                for _ in range(4):
                    run(x)
                best[i] = min(best[i], time.perf_counter() - start)
    return best[0] / best[1]


# --- linear layers by kind: one binding for float and quantised layers ---------------------------------------------

class LinearForms(NamedTuple):
    """The three ways the eval paths run a linear layer of one module type (:func:`register_linear`)."""

    bind: Callable[[nn.Module, int | None], Callable[[Tensor], Tensor]]  # (module, rows) -> plain x -> linear(x)
    act: Callable[[nn.Module, Tensor, str], Tensor]  # (module, x, activation name) -> act(linear(x))
    add: Callable[[nn.Module, Tensor, Tensor], Tensor]  # (module, x, residual) -> residual + linear(x)


# module type -> its forms; nn.Linear's are below, tokenloom.nn.quantized registers QuantizedLinear's
LINEAR_FORMS: dict[type, LinearForms] = {}


def register_linear(kind: type, forms: LinearForms) -> None:
    """Declare how the eval and decode fast paths run a linear layer of type ``kind`` (and its subclasses)."""
    LINEAR_FORMS[kind] = forms


def linear_forms(module: nn.Module) -> LinearForms:
    """The registered :class:`LinearForms` of ``module``'s type (or the nearest base class that has some)."""
    for kind in type(module).__mro__:
        forms = LINEAR_FORMS.get(kind)
        if forms is not None:
            return forms
    raise TypeError(f"{type(module).__name__} is not a linear layer the fast paths know (see register_linear)")


def bind_linear(module: nn.Module, rows: int | None = None) -> Callable[[Tensor], Tensor]:
    """A plain function ``x -> module(x)`` for eval-mode passes, bound once: for an ``nn.Linear``
    :func:`decode_linear` (``rows`` rows per call in decode steps; None: whole sequences), for a quantised layer
    (:class:`tokenloom.nn.quantized.QuantizedLinear`) its kernel. It captures the layer's current tensors."""
    return linear_forms(module).bind(module, rows)


def linear_act_of(module: nn.Module, x: Tensor, act: str) -> Tensor:
    """``act(module(x))`` for a linear layer, fused where its kind can (:func:`linear_act` for ``nn.Linear``)."""
    return linear_forms(module).act(module, x, act)


def linear_add_of(module: nn.Module, x: Tensor, residual: Tensor) -> Tensor:
    """``residual + module(x)`` for a linear layer, fused where its kind can (:func:`linear_add` for
    ``nn.Linear``)."""
    return linear_forms(module).add(module, x, residual)


def activation(name: str, x: Tensor) -> Tensor:
    """The activation of :data:`ACTIVATIONS` called ``name``, unfused."""
    return _PLAIN[name](x)


register_linear(nn.Linear, LinearForms(
    bind=lambda m, rows: decode_linear(m.weight, m.bias, rows),
    act=lambda m, x, act: linear_act(x, m.weight, m.bias, act),
    add=lambda m, x, residual: linear_add(x, m.weight, m.bias, residual)))

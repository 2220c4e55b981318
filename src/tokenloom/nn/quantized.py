"""Weight-only quantisation for inference: int8 / int4 linear layers (and an int8 token embedding), put in place of
a float model's layers by :func:`quantize_model`.

Shapes: x (..., in) -> (..., out); ids (...) -> (..., C).

* :class:`QuantizedLinear` holds its weight in the portable storage of :mod:`.int_kernels` (int8 per output channel,
  or int4 in groups of ``group_size`` input columns with a scale and zero each), its float scales (zeros) and bias,
  all as persistent buffers: ``state_dict()`` / safetensors carry them, and nothing is re-quantised at load. It runs
  through the kernel chosen for it (:func:`select_kernels`: a short measurement of the kernels that run here and agree
  with float32 on the dequantised weights; ``dequantize`` until then), in the module's ``forward`` and in the eval /
  decode fast paths (:func:`tokenloom.nn.fused.bind_linear`: the same block bodies, a quantised out projection
  giving ``residual + f(out)``). One kernel serves decode steps (up to :data:`DECODE_ROWS` rows a call), one whole
  sequences.
* :class:`QuantizedEmbedding`: int8 per row, the looked-up rows dequantised (:func:`embedding_rows`).
* A quantised model cannot be trained: ``train(True)`` raises a one-line :class:`~tokenloom.errors.TrainingError`
  (``eval()`` works).

Which layers (:class:`QuantizationConfig`): every ``nn.Linear`` inside a Transformer block (the :data:`~.block.BLOCKS`
kinds: attention's qkv / q / kv / out projections, the MLP's layers); with ``head`` the model's ``lm_head`` too (a head
tied to the embedding gets its own quantised copy: the tie is broken), with ``embedding`` the token embedding of a
model that declares one (``quantizable_embedding``, GPT's ``tok_embed``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from ..config import check
from ..errors import ConfigError, TrainingError
from .block import BLOCKS
from .fused import LinearForms, activation, register_linear
from .int_kernels import (
    BITS,
    FALLBACK,
    INT4_GROUP_SIZES,
    KERNELS,
    QuantizedWeights,
    dequantize,
    kernel,
    kernel_timings,
    quantize_weight,
)

DECODE_ROWS = 8  # calls of at most this many rows run the decode kernel, larger ones the sequence kernel
SEQUENCE_ROWS = 16  # the rows at which the sequence kernel is measured


@dataclass
class QuantizationConfig:
    """Weight-only quantisation of a model (``quantization:`` in a quantised checkpoint's config.yaml)."""

    bits: int = 8  # 8: int8 per output channel (symmetric); 4: int4 per group of input columns (scale + zero)
    group_size: int = 128  # int4: input columns sharing a scale and zero point: 32, 64, 128 or 256
    head: bool = False  # also the output layer (lm_head); a head tied to the embedding gets its own copy
    embedding: bool = False  # also the token embedding, int8 per row (models that declare one: GPT)

    def __post_init__(self) -> None:
        check(self.bits in BITS, f"quantization.bits must be 4 or 8, got {self.bits!r}")
        if self.bits == 4:
            check(self.group_size in INT4_GROUP_SIZES, f"quantization.group_size must be one of "
                  f"{', '.join(map(str, INT4_GROUP_SIZES))} for int4 (the int4 kernel's), got {self.group_size!r}")

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """``int4 (group 128), blocks + head``."""
        what = "int8" if self.bits == 8 else f"int4 (group {self.group_size})"
        return what + ", blocks" + " + head" * self.head + " + embedding" * self.embedding


def _refuse_training(module: nn.Module) -> None:
    raise TrainingError(f"a quantised model cannot be trained ({type(module).__name__} holds integer weights): "
                        "train or fine-tune the float checkpoint, then quantise it")


class QuantizedLinear(nn.Module):
    """``x @ dequant(W).T + b`` with W stored as int8 or int4 (see the module docstring): x (..., in) -> (..., out)."""

    def __init__(self, in_features: int, out_features: int, bits: int = 8, group_size: int = 128, bias: bool = True,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.bits, self.group_size = in_features, out_features, bits, group_size
        if bits == 8:
            self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.zeros(out_features, dtype=dtype, device=device))
            self.register_buffer("zeros", None)
        else:
            groups = (out_features, in_features // group_size)
            self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8,
                                                        device=device))
            self.register_buffer("scales", torch.zeros(groups, dtype=dtype, device=device))
            self.register_buffer("zeros", torch.zeros(groups, dtype=dtype, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)
        self.kernels = (FALLBACK, FALLBACK)  # kernel names: decode steps, whole sequences (select_kernels)
        self._prepared: dict[tuple, tuple] = {}  # (kernel, dtype) -> (buffers' identity, what the kernel reads)
        self.training = False  # inference only (train() refuses)

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int = 128) -> QuantizedLinear:
        """``linear`` quantised (from float32); the scales and bias keep ``linear``'s float dtype."""
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, bits, group_size, linear.bias is not None,
                    dtype=w.dtype, device=w.device)
        stored = quantize_weight(w, bits, group_size)
        with torch.no_grad():
            layer.qweight.copy_(stored.qweight)
            layer.scales.copy_(stored.scales)
            if stored.zeros is not None:
                layer.zeros.copy_(stored.zeros)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.detach())
        return layer

    @property
    def weights(self) -> QuantizedWeights:
        return QuantizedWeights(self.bits, self.qweight, self.scales, self.zeros, self.group_size)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The float weight (out, in) this layer multiplies by."""
        return dequantize(self.weights, dtype)

    def use_kernels(self, decode: str, sequence: str) -> tuple[str, str]:
        """Run decode steps through kernel ``decode`` and whole sequences through ``sequence`` where they can compute
        this layer (else ``dequantize``); returns the names taken."""
        dtype = self.scales.dtype
        self.kernels = tuple(name if kernel(self.bits, name).runs(self.weights, dtype) else FALLBACK
                             for name in (decode, sequence))
        return self.kernels

    def prepared(self, name: str, dtype: torch.dtype) -> tuple:
        """What kernel ``name`` reads for activations of ``dtype`` (a repacked weight, cast scales), made once and
        kept while the buffers are the same (``load_state_dict`` or ``.to()`` make it anew); made in the graph while
        ``torch.compile`` traces (which cannot compare data pointers)."""
        if torch.compiler.is_compiling():
            return kernel(self.bits, name).prepare(self.weights, dtype)
        identity = tuple((t.data_ptr(), t._version) for t in (self.qweight, self.scales, self.zeros) if t is not None)
        entry = self._prepared.get((name, dtype))
        if entry is None or entry[0] != identity:
            with torch.no_grad():
                entry = (identity, kernel(self.bits, name).prepare(self.weights, dtype))
            self._prepared[(name, dtype)] = entry
        return entry[1]

    def function(self, rows: int | None = None) -> Callable[[Tensor], Tensor]:
        """A plain function x (..., in) -> (..., out) through this layer's kernel for calls of ``rows`` rows (None:
        whole sequences), computed in the dtype of the scales (the model's)."""
        name = self.kernels[0] if rows is not None and rows <= DECODE_ROWS else self.kernels[1]
        dtype, bias, out_features = self.scales.dtype, self.bias, self.out_features
        matmul, prepared = kernel(self.bits, name).matmul, self.prepared(name, dtype)

        def run(x: Tensor) -> Tensor:
            flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (rows, in)
            y = matmul(flat if flat.dtype == dtype else flat.to(dtype), bias, *prepared)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], out_features)

        return run

    def forward(self, x: Tensor) -> Tensor:
        return self.function(x.numel() // max(x.shape[-1], 1))(x)

    def train(self, mode: bool = True) -> QuantizedLinear:
        if mode:
            _refuse_training(self)
        return super().train(False)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.bits == 4 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}{group}, "
                f"bias={self.bias is not None}, kernels={self.kernels}")


register_linear(QuantizedLinear, LinearForms(
    bind=lambda m, rows: m.function(rows),
    act=lambda m, x, act: activation(act, m(x)),
    add=lambda m, x, residual: residual + m(x)))


class QuantizedEmbedding(nn.Module):
    """A token embedding stored int8 per row (symmetric): ids (...) -> (..., C), the looked-up rows dequantised."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.register_buffer("qweight", torch.zeros(num_embeddings, embedding_dim, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.zeros(num_embeddings, dtype=dtype, device=device))
        self.training = False  # inference only (train() refuses)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> QuantizedEmbedding:
        w = embedding.weight
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, dtype=w.dtype, device=w.device)
        stored = quantize_weight(w, 8)
        with torch.no_grad():
            layer.qweight.copy_(stored.qweight)
            layer.scales.copy_(stored.scales)
        return layer

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize(QuantizedWeights(8, self.qweight, self.scales, None, 0), dtype)

    def forward(self, ids: Tensor) -> Tensor:
        return torch.embedding(self.qweight, ids).to(self.scales.dtype) * self.scales[ids].unsqueeze(-1)

    def train(self, mode: bool = True) -> QuantizedEmbedding:
        if mode:
            _refuse_training(self)
        return super().train(False)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8"


def embedding_rows(embedding: nn.Module, ids: Tensor) -> Tensor:
    """The rows of ``ids`` of a token embedding, float or quantised, without ``nn.Module`` call overhead for a float
    one (the decode step's lookup)."""
    if isinstance(embedding, QuantizedEmbedding):
        return embedding(ids)
    return torch.embedding(embedding.weight, ids)


def reference_tensor(module: nn.Module) -> Tensor:
    """A floating tensor of ``module`` (parameter or buffer) whose dtype and device its outputs take: an
    ``nn.Embedding``'s weight, a quantised embedding's scales."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            return tensor
    raise ValueError(f"{type(module).__name__} has no floating tensor")


QUANTIZED_KINDS = (QuantizedLinear, QuantizedEmbedding)


def is_quantized(model: nn.Module) -> bool:
    """Whether any layer of ``model`` is quantised."""
    return any(isinstance(m, QUANTIZED_KINDS) for m in model.modules())


def quantization_of(model: nn.Module) -> QuantizationConfig | None:
    """The :class:`QuantizationConfig` ``model`` was quantised with (read from its layers), or None for a float
    model."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if not layers:
        return None
    head = getattr(model, "lm_head", None)
    return QuantizationConfig(bits=layers[0].bits, group_size=layers[0].group_size,
                              head=isinstance(head, QuantizedLinear),
                              embedding=any(isinstance(m, QuantizedEmbedding) for m in model.modules()))


def _block_linears(model: nn.Module) -> list[str]:
    """Qualified names of the ``nn.Linear`` layers inside the model's Transformer blocks, in order."""
    kinds = tuple(BLOCKS.get(name) for name in BLOCKS.names())
    names: list[str] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, kinds):
            names += [f"{name}.{sub}" if name else sub for sub, layer in module.named_modules(remove_duplicate=False)
                      if isinstance(layer, nn.Linear)]
    return list(dict.fromkeys(names))


def fitting_group_size(model: nn.Module, preferred: int = 128) -> int:
    """An int4 group size for ``model``'s block layers: ``preferred`` where it divides every input width, else the
    largest of :data:`~.int_kernels.INT4_GROUP_SIZES` that does (``preferred`` when none does: quantising then says
    which layer it does not fit)."""
    widths = {model.get_submodule(name).in_features for name in _block_linears(model)}
    for size in (preferred, *sorted(INT4_GROUP_SIZES, reverse=True)):
        if all(width % size == 0 for width in widths):
            return size
    return preferred


def _replace(model: nn.Module, name: str, make: Callable[[nn.Module], nn.Module], made: dict[int, nn.Module]) -> None:
    """Put ``make(old)`` at ``name`` (one new module per old one: a layer registered twice stays shared)."""
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, attr)
    if id(old) not in made:
        made[id(old)] = make(old)
    setattr(parent, attr, made[id(old)])


def quantize_model(model: nn.Module, config: QuantizationConfig, *, quantize_weights: bool = True) -> nn.Module:
    """Replace ``model``'s layers in place (see the module docstring) by quantised ones and return it.
    ``quantize_weights=False`` puts empty layers of the right shapes (a checkpoint's skeleton, loaded next). A model
    already quantised, a ``group_size`` that does not divide a layer's input width, or a head / embedding the model
    does not have is a one-line :class:`~tokenloom.errors.ConfigError`; nothing is replaced then."""
    if is_quantized(model):
        found = quantization_of(model)
        raise ConfigError(f"the model is already quantised ({found.describe() if found else 'int8 embedding'}); "
                          "quantise its float checkpoint instead")
    names = _block_linears(model)
    if config.head:
        head = getattr(model, "lm_head", None)
        if not isinstance(head, nn.Linear):
            raise ConfigError(f"quantization.head: {type(model).__name__} has no lm_head output layer to quantise")
        names.append("lm_head")
    if not names:
        raise ConfigError(f"{type(model).__name__} has no linear layers in Transformer blocks to quantise")
    embedding = getattr(type(model), "quantizable_embedding", None) if config.embedding else None
    if config.embedding and embedding is None:
        raise ConfigError(f"quantization.embedding: {type(model).__name__} does not read a quantised token embedding "
                          "(the GPT family does)")
    if config.bits == 4:
        for name in names:
            width = model.get_submodule(name).in_features
            if width % config.group_size:
                raise ConfigError(f"quantization.group_size={config.group_size} does not divide the input width "
                                  f"{width} of {name}; choose a group size that divides it")

    def linear(old: nn.Linear) -> QuantizedLinear:
        if quantize_weights:
            return QuantizedLinear.from_linear(old, config.bits, config.group_size)
        w = old.weight
        return QuantizedLinear(old.in_features, old.out_features, config.bits, config.group_size,
                               old.bias is not None, dtype=w.dtype, device=w.device)

    def embed(old: nn.Embedding) -> QuantizedEmbedding:
        if quantize_weights:
            return QuantizedEmbedding.from_embedding(old)
        return QuantizedEmbedding(old.num_embeddings, old.embedding_dim, dtype=old.weight.dtype,
                                  device=old.weight.device)

    made: dict[int, nn.Module] = {}
    for name in names:
        _replace(model, name, linear, made)
    if embedding is not None:
        _replace(model, embedding, embed, made)
    return model.eval()


# --- choosing the kernels -------------------------------------------------------------------------------------------

Timings = Callable[..., dict[str, float]]  # kernel_timings' signature: (bits, dtype, rows, in, out, group) -> times


@dataclass(frozen=True)
class KernelChoice:
    """The kernels measured for one weight width and the ones taken: decode steps at ``rows`` rows, whole sequences
    at :data:`SEQUENCE_ROWS` rows."""

    bits: int  # weight width
    dtype: torch.dtype  # the activations'
    rows: int  # rows of the decode measurement
    in_features: int  # the layer shape measured (the model's largest quantised layer)
    out_features: int
    decode: dict[str, float] = field(default_factory=dict)  # kernel -> seconds a call at rows (inf: not here)
    sequence: dict[str, float] = field(default_factory=dict)  # the same at SEQUENCE_ROWS rows
    device: str = "cpu"  # where the model runs (off the CPU: dequantize, unmeasured)

    @staticmethod
    def _best(times: dict[str, float]) -> str:
        finite = {name: t for name, t in times.items() if t != float("inf")}
        return min(finite, key=finite.get) if finite else FALLBACK

    @property
    def decode_kernel(self) -> str:
        return self._best(self.decode)

    @property
    def sequence_kernel(self) -> str:
        return self._best(self.sequence)

    def describe(self) -> str:
        """``int8 weights: kernel dequantize (0.22 ms vs _weight_int8pack_mm 0.73 ms at 1 x 384 -> 1536; dequantize
        at 16 rows)``."""
        if self.device != "cpu":
            return f"int{self.bits} weights: kernel {FALLBACK} (on {self.device})"
        best = self.decode_kernel
        others = [f"{name} {t * 1e3:.2f} ms" for name, t in self.decode.items() if name != best and t != float("inf")]
        missing = [name for name, t in self.decode.items() if t == float("inf")]
        timing = f"{self.decode[best] * 1e3:.2f} ms" + (f" vs {', '.join(others)}" if others else "") \
            if best in self.decode else "unmeasured"
        unavailable = f"; {', '.join(missing)} does not run here" if missing else ""
        return (f"int{self.bits} weights: kernel {best} ({timing} at {self.rows} x {self.in_features} -> "
                f"{self.out_features}; {self.sequence_kernel} at {SEQUENCE_ROWS} rows{unavailable})")


def select_kernels(model: nn.Module, rows: int = 1, timings: Timings = kernel_timings) -> list[KernelChoice]:
    """Choose once, by a short measurement (``timings``, default :func:`~.int_kernels.kernel_timings`; the CLI's
    remembers it between runs), the kernel of each weight width in ``model`` for decode steps of ``rows`` rows and
    for whole sequences, at the shape of the model's largest quantised layer in the model's dtype, and set it on
    every quantised layer of that width that it can compute. Off the CPU every layer dequantises. Returns the
    choices (:meth:`KernelChoice.describe` says them)."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    choices = []
    for bits in sorted({m.bits for m in layers}, reverse=True):
        group = [m for m in layers if m.bits == bits]
        ref = max(group, key=lambda m: m.in_features * m.out_features)
        shape = dict(bits=bits, dtype=ref.scales.dtype, rows=rows, in_features=ref.in_features,
                     out_features=ref.out_features)
        device = ref.qweight.device.type
        if device != "cpu":
            choice = KernelChoice(**shape, device=device)
        else:
            measure = dict(bits=bits, dtype=ref.scales.dtype, in_features=ref.in_features,
                           out_features=ref.out_features, group_size=ref.group_size)
            choice = KernelChoice(**shape, decode=timings(rows=rows, **measure),
                                  sequence=timings(rows=SEQUENCE_ROWS, **measure))
        for m in group:
            m.use_kernels(choice.decode_kernel, choice.sequence_kernel)
        choices.append(choice)
    return choices


def kernel_names(bits: int) -> list[str]:
    """The kernels there are for ``bits``-bit weights (not all run on every machine)."""
    return [k.name for k in KERNELS[bits]]

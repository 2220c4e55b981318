"""Low-rank adapters (LoRA, Hu et al. 2021): a frozen linear layer plus a trained update of rank r.

Shapes: x (..., in) -> (..., out); A (r, in), B (out, r); ``scale = alpha / r``.

``LoRALinear(base, rank, alpha, dropout)(x) = base(x) + scale * B(A(dropout(x)))`` with A drawn kaiming-uniform and B
zero, so an adapted model starts equal to its base; the base layer is frozen (float ``nn.Linear`` or, for QLoRA, a
weight-only int8 / int4 :class:`~.quantized.QuantizedLinear`). :func:`apply_lora` puts adapters in place of the linear
layers whose qualified names match the target patterns, :func:`merge_lora` folds ``scale * B @ A`` into the base
weights and puts plain ``nn.Linear`` layers back (a quantised base is dequantised first: the merged layer is float),
:func:`lora_state_dict` / :func:`load_lora` are the adapter's tensors alone, :func:`save_adapter` /
:func:`read_adapter` the adapter-only files ``adapter.safetensors`` + ``adapter.json``.

Target patterns (``train.lora.targets``): each is matched against the qualified module names of ``named_modules()``
(``blocks.0.attn.qkv_proj``); only linear layers count. A pattern is an ``fnmatch`` glob (``*`` also crosses dots:
``*.mlp.fc_*``); a glob without a dot also matches the last part of a name (``out_proj``: every ``*.out_proj``, as
peft's ``target_modules``); ``re:...`` is a regular expression matched against the whole name. Every pattern must
match at least one linear layer (a typo fails at once, naming it and some real layer names).

Why native and not peft (checked with peft 0.21.2, which installs beside this torch and gives the same logits,
tests/nn/test_lora.py): tokenloom's eval and decode fast paths do not call linear modules; they bind each layer's
tensors into plain functions, dispatched by the module's type (:data:`.fused.LINEAR_FORMS`). peft's ``lora.Linear``
is a type they do not know (an eval forward or a decode step fails; a subclass of ``nn.Linear`` would be silently
bypassed, its adapter ignored). :class:`LoRALinear` registers its own forms (:func:`.fused.register_linear`), so an
unmerged adapted model decodes through the fast paths with its adapters, the same tokens as the merged one. peft's QLoRA
wraps bitsandbytes / GPTQ layers, not the toolkit's own int8 / int4 :class:`~.quantized.QuantizedLinear`; and peft
imports transformers and accelerate (seconds, heavy optional packages) where the toolkit's training needs neither.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.nn import functional as F

from ..errors import CheckpointError, ConfigError
from .dropout import Dropout
from .fused import LinearForms, activation, bind_linear, register_linear
from .quantized import QuantizedLinear, reference_tensor

DEFAULT_TARGETS = ("*.attn.*_proj", "*.mlp.fc_*")  # attention's qkv / q / kv / out and the MLP's layers (GPT, Llama)
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter.safetensors", "adapter.json"
ADAPTABLE = (nn.Linear, QuantizedLinear)  # the layers an adapter may wrap


class LoRASettings(Protocol):
    """What :func:`apply_lora` reads (``train.lora``: :class:`tokenloom.training.config.LoRAConfig`, or an
    :class:`AdapterSpec`)."""

    rank: int
    alpha: float
    dropout: float
    targets: Sequence[str]


@dataclass
class AdapterSpec:
    """An adapter's settings as ``adapter.json`` records them (with the layers adapted and where its base is)."""

    rank: int  # r: the rank of each update B @ A
    alpha: float  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input (training only)
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))  # the name patterns
    modules: list[str] = field(default_factory=list)  # the qualified names of the adapted layers
    base: dict[str, Any] = field(default_factory=dict)  # the base weights: checkpoint path, sha256 (the trainer's)
    quantized_base: dict[str, Any] | None = None  # QLoRA: {bits, group_size, layers} the base was quantised with

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class LoRALinear(nn.Module):
    """``base(x) + (alpha / rank) * B(A(dropout(x)))``, the base frozen: x (..., in) -> (..., out)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if not isinstance(base, ADAPTABLE):
            raise TypeError(f"LoRA adapts nn.Linear or QuantizedLinear layers, not {type(base).__name__}")
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        ref = reference_tensor(base)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha, self.scaling = rank, float(alpha), float(alpha) / rank
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, dtype=ref.dtype, device=ref.device)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, dtype=ref.dtype, device=ref.device)
        self.dropout = Dropout(dropout)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # nn.Linear's (and peft's) initialisation
        nn.init.zeros_(self.lora_B.weight)  # the update starts at zero: the adapted layer equals its base
        self.base.train(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling

    def delta_weight(self) -> Tensor:
        """The update ``scale * B @ A`` (out, in), computed in float32."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def base_weight(self) -> Tensor:
        """The frozen base's float weight (out, in) (a quantised base dequantised), in float32."""
        if isinstance(self.base, QuantizedLinear):
            return self.base.dequantized(torch.float32)
        return self.base.weight.detach().float()

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` computing what this layer computes (base weight + update; a quantised base
        dequantised), in the base's float dtype."""
        ref = reference_tensor(self.base)
        bias = self.base.bias
        linear = nn.Linear(self.in_features, self.out_features, bias=bias is not None, dtype=ref.dtype,
                           device=ref.device)
        linear.weight.copy_((self.base_weight() + self.delta_weight()).to(ref.dtype))
        if bias is not None:
            linear.bias.copy_(bias.detach())
        linear.weight.requires_grad_(False)
        if linear.bias is not None:
            linear.bias.requires_grad_(False)
        return linear.train(self.training)

    def train(self, mode: bool = True) -> LoRALinear:
        """The adapter (its dropout) follows ``mode``; the frozen base stays in eval mode (a quantised base cannot
        train)."""
        self.training = mode
        self.lora_A.train(mode)
        self.lora_B.train(mode)
        self.dropout.train(mode)
        return self

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}, scale={self.scaling:g}"


def _bind_lora(module: LoRALinear, rows: int | None):
    """The eval / decode fast paths' plain function for an unmerged adapter: the base's own bound form plus the
    low-rank update (the same operations as :meth:`LoRALinear.forward` in eval mode)."""
    base = bind_linear(module.base, rows)
    a, b, scale = module.lora_A.weight, module.lora_B.weight, module.scaling

    def run(x: Tensor) -> Tensor:
        return base(x) + F.linear(F.linear(x, a), b) * scale

    return run


# the fast paths (:mod:`.fused`) dispatch linear layers by type: an adapted layer declares its forms, so an unmerged
# model's eval passes and decode steps run base + update, never the base alone
register_linear(LoRALinear, LinearForms(
    bind=_bind_lora,
    act=lambda m, x, act: activation(act, m(x)),
    add=lambda m, x, residual: residual + m(x)))


# --- choosing the layers ---------------------------------------------------------------------------------------------

def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern) or ("." not in pattern and
                                                  fnmatch.fnmatchcase(name.rpartition(".")[2], pattern))


def check_targets(targets: Sequence[str], setting: str = "train.lora.targets") -> None:
    """A one-line :class:`ConfigError` for an empty list, a pattern that is not a string, or a bad ``re:``."""
    if not isinstance(targets, list | tuple) or not targets:
        raise ConfigError(f"{setting} must be a non-empty list of module name patterns, got {targets!r}")
    for pattern in targets:
        if not isinstance(pattern, str) or not pattern.strip():
            raise ConfigError(f"{setting}: each pattern must be a non-empty string, got {pattern!r}")
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as err:
                raise ConfigError(f"{setting}: {pattern!r} is not a regular expression ({err})") from None


def linear_names(model: nn.Module) -> list[str]:
    """Qualified names of the layers of ``model`` an adapter may wrap, in order (a shared layer once)."""
    return [name for name, module in model.named_modules() if isinstance(module, ADAPTABLE) and name]


def match_targets(model: nn.Module, targets: Sequence[str], setting: str = "train.lora.targets") -> list[str]:
    """The names of ``model``'s linear layers that match any pattern of ``targets``; a pattern matching none is a
    one-line :class:`ConfigError` naming ``setting``, the patterns and some real layer names."""
    check_targets(targets, setting)
    names = linear_names(model)
    unmatched = [p for p in targets if not any(_matches(p, name) for name in names)]
    if unmatched:
        shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
        raise ConfigError(f"{setting}: {', '.join(map(repr, unmatched))} of {list(targets)} matches no linear layer "
                          f"of {type(model).__name__} (its linear layers: {shown or 'none'})")
    return [name for name in names if any(_matches(p, name) for p in targets)]


def _shared_weight(model: nn.Module, name: str) -> str | None:
    """The name of another parameter sharing the weight of layer ``name`` (a head tied to the embedding)."""
    weight = getattr(model.get_submodule(name), "weight", None)
    if weight is None:
        return None
    for other, p in model.named_parameters(remove_duplicate=False):
        if p is weight and not other.startswith(name + "."):
            return other
    return None


def apply_lora(model: nn.Module, config: LoRASettings, *, setting: str = "train.lora.targets",
               freeze: bool = True) -> list[str]:
    """Put a :class:`LoRALinear` in place of every linear layer of ``model`` whose name matches ``config.targets``
    (see the module docstring) and return their names. ``freeze``: every other parameter of the model stops
    requiring gradients (the adapters alone train). Refused (one line, nothing changed): a pattern that matches
    nothing, a model already adapted, a layer whose weight is tied to another parameter (an output layer sharing
    the token embedding: merging would change the embedding too)."""
    if has_lora(model):
        raise ConfigError(f"{setting}: the model already has LoRA adapters ({', '.join(lora_modules(model)[:3])}, "
                          "...); merge them first (merge_lora)")
    names = match_targets(model, config.targets, setting)
    for name in names:
        tied = _shared_weight(model, name)
        if tied is not None:
            raise ConfigError(f"{setting}: {name} shares its weight with {tied} (tied embeddings); leave it out of "
                              "the targets or adapt a model with tie_embeddings false")
    if freeze:
        model.requires_grad_(False)
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, LoRALinear(getattr(parent, attr), config.rank, config.alpha, config.dropout))
    return names


def lora_modules(model: nn.Module) -> list[str]:
    """Qualified names of the adapted layers of ``model``."""
    return [name for name, module in model.named_modules() if isinstance(module, LoRALinear)]


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(module, LoRALinear) for module in model.modules())


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapters' parameters (A and B of every adapted layer)."""
    return [p for m in model.modules() if isinstance(m, LoRALinear) for p in (m.lora_A.weight, m.lora_B.weight)]


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (``W + scale * B @ A``; a quantised base dequantised first) and put a
    plain ``nn.Linear`` in its place; the model (in place) computes what it computed, at the cost of the base alone.
    The merged layers' parameters are frozen like the base was (``requires_grad_(True)`` to train them)."""
    for name in lora_modules(model):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, getattr(parent, attr).merged())
    return model


# --- adapter tensors and files --------------------------------------------------------------------------------------

def _adapter_keys(model: nn.Module) -> list[str]:
    return [f"{name}.{part}.weight" for name in lora_modules(model) for part in ("lora_A", "lora_B")]


def full_trained(model: nn.Module) -> list[str]:
    """Names of the parameters of an adapted model that train in full beside the adapters (a task's new head, e.g.
    a reward model's: peft's ``modules_to_save``): the trainable ones outside the adapters."""
    inside = set(_adapter_keys(model))
    return [name for name, p in model.named_parameters() if p.requires_grad and name not in inside]


def lora_state_dict(model: nn.Module, state: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """What an adapter file holds: the adapters' tensors, ``{<layer>.lora_A.weight: (r, in), <layer>.lora_B.weight:
    (out, r)}``, and the parameters trained in full beside them (:func:`full_trained`), from the model or from its
    full ``state`` dict (the trainer's float32 masters)."""
    state = model.state_dict() if state is None else state
    return {key: state[key].detach() for key in _adapter_keys(model) + full_trained(model)}


def base_state_dict(model: nn.Module, state: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The frozen base's tensors under the names of the model without adapters (``<layer>.base.weight`` ->
    ``<layer>.weight``), from the model or its full ``state`` dict: a plain checkpoint's weights."""
    state = model.state_dict() if state is None else state
    prefixes = [name + "." for name in lora_modules(model)]
    out = {}
    for key, tensor in state.items():
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        if prefix is None:
            out[key] = tensor
        elif key.startswith(prefix + "base."):
            out[prefix + key[len(prefix) + 5:]] = tensor
    return out


@torch.no_grad()
def load_lora(model: nn.Module, tensors: dict[str, Tensor], source: str) -> None:
    """Copy adapter ``tensors`` (:func:`lora_state_dict`'s names) into ``model``'s adapters (and the parameters
    trained in full), after checking that the names are exactly the adapters' (and parameters of the model) and
    every shape agrees; a mismatch is a one-line :class:`CheckpointError` naming ``source``."""
    params = dict(model.named_parameters())
    expected = _adapter_keys(model)
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in params]
    if missing or unexpected:
        raise CheckpointError(f"{source} does not match the adapted model: missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}")
    for key, tensor in tensors.items():
        if tensor.shape != params[key].shape:
            raise CheckpointError(f"{source}: {key} has shape {tuple(tensor.shape)}, the adapter needs "
                                  f"{tuple(params[key].shape)} (another rank or model)")
    for key, tensor in tensors.items():
        params[key].copy_(tensor)


def save_adapter(directory: str | Path, tensors: dict[str, Tensor], spec: AdapterSpec) -> None:
    """Write ``adapter.safetensors`` (``tensors``, float32) and ``adapter.json`` (``spec``) into ``directory``."""
    directory = Path(directory)
    save_file({k: v.detach().float().contiguous().cpu() for k, v in tensors.items()},
              str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt", "adapter": "lora"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(spec.as_dict(), indent=1) + "\n", encoding="utf-8")


def is_adapter(directory: str | Path) -> bool:
    """Whether ``directory`` holds adapter files (``adapter.json``)."""
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def read_adapter_spec(directory: str | Path) -> AdapterSpec:
    """The settings of the adapter in ``directory`` (its ``adapter.json``); a missing or malformed file is a one-line
    :class:`CheckpointError` naming it."""
    meta = Path(directory) / ADAPTER_CONFIG
    try:
        data = json.loads(meta.read_text(encoding="utf-8"))
        spec = AdapterSpec(**data)
        check_targets(spec.targets, str(meta))
        if not (isinstance(spec.rank, int) and spec.rank >= 1 and isinstance(spec.alpha, int | float)):
            raise TypeError(f"rank {spec.rank!r}, alpha {spec.alpha!r}")
    except OSError as err:
        raise CheckpointError(f"cannot read {meta}: {err.strerror or err}") from None
    except (ValueError, TypeError, ConfigError) as err:
        raise CheckpointError(f"{meta} is not an adapter description ({str(err).splitlines()[0]})") from None
    return spec


def read_adapter(directory: str | Path) -> tuple[AdapterSpec, dict[str, Tensor]]:
    """(settings, tensors) of the adapter files in ``directory``; a missing, truncated or malformed file is a
    one-line :class:`CheckpointError` naming it."""
    spec = read_adapter_spec(directory)
    weights = Path(directory) / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"the adapter is missing its weights: {weights}")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{weights} is truncated or corrupt ({str(err).splitlines()[0]})") from None
    return spec, tensors


def frozen_state_names(model: nn.Module) -> list[str]:
    """Names of the untrained floating state of an adapted model: its frozen parameters and the buffers of the
    adapted layers' bases (a quantised base's scales, zeros and bias)."""
    names = [name for name, p in model.named_parameters() if not p.requires_grad]
    names += [f"{name}.base.{buffer}" for name, module in model.named_modules() if isinstance(module, LoRALinear)
              for buffer, t in module.base.named_buffers() if t.is_floating_point()]
    return names


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) values of ``model``: its parameters (a tied one once), a quantised layer's weight counted
    by its shape (in x out, + bias)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    total += sum(m.in_features * m.out_features + (m.bias.numel() if m.bias is not None else 0)
                 for m in model.modules() if isinstance(m, QuantizedLinear))
    return trainable, total


def adapter_parameter_count(model: nn.Module) -> int:
    """Trainable values the adapters add: ``rank * (in + out)`` per adapted layer."""
    return sum(p.numel() for p in lora_parameters(model))

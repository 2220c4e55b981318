"""LoRA runs (``train.lora``): the model made ready (base frozen, optionally quantised, adapters put in), the base
named for the checkpoints, and a resumed run's adapter loaded back.

A LoRA run's checkpoints hold the adapter (``adapter.safetensors`` + ``adapter.json``), never a copy of the frozen
base: its ``adapter.json`` names the base checkpoint (``train.init_from``, with the SHA-256 of its weights) or, when
the base is no float checkpoint on disk (no ``init_from``, or ``init_from`` another LoRA run), the run's own
``<run>/base``, written once at the start (:func:`start_lora`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from ..checkpoint import BASE_DIR, adapter_state, base_reference, load_state, write_checkpoint
from ..config import to_dict
from ..errors import CheckpointError, ConfigError
from ..nn.int_kernels import INT4_GROUP_SIZES
from ..nn.lora import AdapterSpec, apply_lora, is_adapter, load_lora
from ..nn.quantized import QuantizedLinear
from .config import LoRAConfig, RunConfig


def prepare_lora(model: nn.Module, lora: LoRAConfig, base: dict[str, Any],
                 full: tuple[str, ...] = ()) -> AdapterSpec:
    """Make ``model`` (its float base weights loaded) a LoRA model in place: every weight frozen, adapters on the
    target layers (with ``quantize_base`` their frozen bases quantised: int8 per output channel; int4 in groups of
    input columns, 128 or the largest group size that divides every adapted layer's width), and the parameters whose
    names start with ``full`` (a task's new head) trained in full beside them. Returns what ``adapter.json``
    records."""
    modules = apply_lora(model, lora)
    quantized = None
    if lora.quantize_base is not None:
        bits = 8 if lora.quantize_base == "int8" else 4
        layers = [model.get_submodule(name) for name in modules]
        group = 128
        if bits == 4:
            widths = sorted({layer.in_features for layer in layers})
            group = next((size for size in (128, *sorted(INT4_GROUP_SIZES, reverse=True))
                          if all(width % size == 0 for width in widths)), 0)
            if not group:
                sizes = ", ".join(map(str, INT4_GROUP_SIZES))
                raise ConfigError(f"train.lora.quantize_base=int4: no int4 group size ({sizes}) divides the input "
                                  f"widths {widths} of the adapted layers; use int8 or leave those layers out of "
                                  "train.lora.targets")
        for layer in layers:
            layer.base = QuantizedLinear.from_linear(layer.base, bits, group)
        quantized = {"bits": bits, "group_size": group, "layers": modules}
    if full:
        for name, p in model.named_parameters():
            if name.startswith(full):
                p.requires_grad_(True)
    return AdapterSpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=list(lora.targets),
                       modules=modules, base=base, quantized_base=quantized)


def start_lora(model: nn.Module, config: RunConfig, run_dir: Path, section: dict[str, Any], tokenizer: Any,
               init_from: Path | None, full: tuple[str, ...] = (), write: bool = True) -> AdapterSpec:
    """A fresh LoRA run: name the base (``init_from`` when it is a float checkpoint of its own, else the run's
    ``<run>/base``, written now from ``model``'s weights: ``write`` on the process that writes), then
    :func:`prepare_lora`."""
    if init_from is not None and not is_adapter(init_from):
        base = base_reference(config.train.init_from or init_from)
    elif write:
        base = base_reference(write_run_base(model, config, run_dir, section, tokenizer), in_run=True)
    else:
        base = {}  # (another process of a distributed run: rank 0 writes the base and the checkpoints)
    return prepare_lora(model, config.train.lora, base, full)


def write_run_base(model: nn.Module, config: RunConfig, run_dir: Path, section: dict[str, Any],
                   tokenizer: Any) -> Path:
    """``<run>/base``: ``model``'s float weights as a plain checkpoint (its config that of the run, without LoRA),
    the base the run's adapters name."""
    data = config.to_dict()
    data["model"] = dict(section)
    data["train"]["lora"] = to_dict(LoRAConfig())
    eos = getattr(tokenizer, "eos_token", None)
    data["tokenizer"] = {**(data.get("tokenizer") or {}), **({"eos_token": eos} if eos is not None else {})}
    return write_checkpoint(Path(run_dir) / BASE_DIR, model, data, tokenizer)


def resume_lora(model: nn.Module, checkpoint: Path, lora: LoRAConfig, full: tuple[str, ...] = ()) -> AdapterSpec:
    """A resumed LoRA run: the base the checkpoint names (its SHA-256 checked) loaded into ``model``, the model
    prepared as the run was (:func:`prepare_lora`), the checkpoint's adapter loaded. The base stays the one the run
    started from."""
    if not lora.enabled:
        raise CheckpointError(f"{checkpoint} holds a LoRA adapter: resume it with the run's train.lora settings "
                              "(train.lora.rank 0 trains the whole model)")
    spec, base, tensors = adapter_state(checkpoint)
    fresh = (lambda name: name.startswith(full)) if full else None  # a task's new head: in the adapter file
    load_state(model, base, f"{checkpoint} (the adapter's base)", fresh)
    prepared = prepare_lora(model, lora, spec.base, full)
    load_lora(model, tensors, str(checkpoint / "adapter.safetensors"))
    return prepared

"""Loading a checkpoint to run it from the command line: on ``--device`` (auto | cpu | cuda | cuda:N | mps), the
weights in ``--precision`` (auto | fp32 | bf16 | fp16 | int8 | int4), chosen once per process, device and width, and
the family checks of the commands that need one kind of model. int8 / int4 are weight-only quantised weights
(:mod:`tokenloom.nn.quantized`) with float32 activations: a float checkpoint is quantised as it loads (the blocks'
linear layers), a quantised checkpoint brings its own; the kernels are chosen by a measurement kept between runs
(said on stderr)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from ..checkpoint import load_model, load_tokenizer, read_config, resolve_checkpoint, stored_quantization
from ..errors import ConfigError
from ..nn.quantized import QuantizationConfig, fitting_group_size, quantize_model

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # --precision -> weights' dtype
QUANTIZED = {"int8": 8, "int4": 4}  # --precision -> weight-only quantised bits


@functools.lru_cache(maxsize=8)
def command_device(device: str):
    """The device of a command's ``--device`` (:func:`tokenloom.devices.choose_device`), chosen once per process;
    ``auto`` says on stderr what it took."""
    from ..devices import choose_device

    choice = choose_device(device)
    if choice.requested == "auto":
        print(choice.describe(), file=sys.stderr)
    return choice


@functools.lru_cache(maxsize=8)
def _inference_choice(precision: str, width: int, device: torch.device):
    from ..hardware import cache_dir, choose_inference_precision, remembered
    from ..nn.fused import decode_bf16_speedup

    kept = []

    def speedup() -> float:
        value, cached = remembered(f"decode bf16 speedup, width {width}", lambda: decode_bf16_speedup(width))
        kept.append(cached)
        return value

    choice = choose_inference_precision(precision, speedup, device=device)
    if choice.requested == "auto":
        note = f" (measured on an earlier run, kept in {cache_dir() / 'measurements.json'})" if any(kept) else ""
        print(choice.describe() + note, file=sys.stderr)
    return choice


def load_inference_model(checkpoint: str | Path, precision: str, device: str = "auto"):
    """(model in eval mode, config) like :func:`load_model`, on ``--device`` (:func:`tokenloom.devices.choose_device`;
    ``auto`` says on stderr what it took), its weights in ``--precision`` (auto | fp32 | bf16 | fp16 | int8 | int4).
    ``auto`` on a CPU measures the decode step's kernels at the model's width, once per process and width
    (:func:`tokenloom.hardware.choose_inference_precision`), and says on stderr what it picked and why. A quantised
    checkpoint runs quantised (``auto`` or its own int8 / int4; another precision is a one-line error); int8 / int4
    quantise a float checkpoint's blocks as it loads. Either way the kernels are chosen by
    :func:`quantized_kernels` and said on stderr."""
    where = command_device(device).device  # an unknown device fails before the checkpoint is read
    model, config = load_model(checkpoint)  # a missing or corrupt checkpoint fails before anything is measured
    stored = stored_quantization(config)
    if stored is not None:
        own = f"int{stored.bits}"
        if precision not in ("auto", own):
            raise ConfigError(f"{resolve_checkpoint(checkpoint)} holds {own} weights (a quantised checkpoint): "
                              f"--precision {precision} does not apply; use --precision auto or {own}")
        precision = own
    if precision in QUANTIZED:
        if stored is None:  # int4: groups of 128 input columns, or the largest group size the widths allow
            bits = QUANTIZED[precision]
            quantize_model(model, QuantizationConfig(bits=bits, group_size=fitting_group_size(model) if bits == 4
                                                     else 128))
        model = model.to(where)
        for choice in quantized_kernels(model):
            print(choice.describe(), file=sys.stderr)
        return model, config
    width = int((config.get("model") or {}).get("embed_dim") or 512)
    return model.to(PRECISIONS[_inference_choice(precision, width, where).precision]).to(where), config


def quantized_kernels(model):
    """:func:`tokenloom.nn.quantized.select_kernels` for one-row decode steps, each kernel's time remembered between
    runs (:func:`tokenloom.hardware.remembered`, like ``--precision auto``'s measurement): the same kernels run after
    a busy moment as before it."""
    from ..hardware import remembered
    from ..nn.int_kernels import kernel_timings
    from ..nn.quantized import kernel_names, select_kernels

    def timings(bits: int, dtype: torch.dtype, rows: int, in_features: int, out_features: int,
                group_size: int) -> dict[str, float]:
        shape = f"int{bits} {str(dtype).removeprefix('torch.')} {rows} x {in_features} -> {out_features}" + \
            (f" group {group_size}" if bits == 4 else "")
        return {name: remembered(f"quantized kernel {name}, {shape}", lambda name=name: kernel_timings(
                    bits, dtype, rows, in_features, out_features, group_size, only=name)[name])[0]
                for name in kernel_names(bits)}

    return select_kernels(model, rows=1, timings=timings)


def translation_model(checkpoint: str | Path, precision: str, device: str = "auto"):
    """(checkpoint directory, model, tokenizer) of an encoder-decoder or NAT checkpoint; a one-line error for
    another family."""
    from ..models.registry import MODELS, decoding_of
    from ..tasks.translation import BATCH_DECODINGS

    ckpt = resolve_checkpoint(checkpoint)
    family = (read_config(ckpt).get("model") or {}).get("family", "gpt")
    families = [name for name in MODELS.names() if decoding_of(MODELS.get(name)[1]) in BATCH_DECODINGS]
    if family not in families:
        raise ConfigError(f"{ckpt} holds a {family!r} model; translation needs an encoder-decoder (family "
                          f"{', '.join(families)})")
    model, _ = load_inference_model(ckpt, precision, device)
    return ckpt, model, load_tokenizer(ckpt)

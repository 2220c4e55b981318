"""Loading a checkpoint to run it from the command line: on ``--device`` (auto | cpu | cuda | cuda:N | mps), the
weights in ``--precision`` (auto | fp32 | bf16 | fp16), chosen once per process, device and width, and the family
checks of the commands that need one kind of model."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from ..checkpoint import load_model, load_tokenizer, read_config, resolve_checkpoint
from ..errors import ConfigError

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # --precision -> weights' dtype


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
    ``auto`` says on stderr what it took), its weights in ``--precision`` (auto | fp32 | bf16 | fp16). ``auto`` on a CPU
    measures the decode step's kernels at the model's width, once per process and width
    (:func:`tokenloom.hardware.choose_inference_precision`), and says on stderr what it picked and why."""
    where = command_device(device).device  # an unknown device fails before the checkpoint is read
    model, config = load_model(checkpoint)  # a missing or corrupt checkpoint fails before anything is measured
    width = int((config.get("model") or {}).get("embed_dim") or 512)
    return model.to(PRECISIONS[_inference_choice(precision, width, where).precision]).to(where), config


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

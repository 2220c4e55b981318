"""The checkpoint directory, one format everywhere::

    config.yaml         the run's settings: model (with its family), data/tokenizer, training; a weight-only
                        quantised checkpoint adds ``quantization: {bits, group_size, head, embedding}``
    model.safetensors   weights (never unpickled)
    tokenizer.json      Hugging Face tokenizers format
    trainer_state.pt    only for resuming: optimizer, scheduler, RNG states, step (written by training); with
                        ``train.ema`` also ``"ema"``: the average and the raw weights training continues from
                        (model.safetensors then holds the average: tokenloom.training.ema)
    checksums.json      the SHA-256 of every other file: every loader checks the files it reads against it (a
                        damaged one is a one-line :class:`~tokenloom.errors.ChecksumError` naming it; a checkpoint
                        without it, from before checksums, loads as it is), ``--resume`` all of them first

A LoRA run's checkpoint (``train.lora``) holds ``adapter.safetensors`` + ``adapter.json`` in place of
``model.safetensors``: the adapter, and where its frozen base weights are (another checkpoint, by path, or the run's
``<run>/base``) with their SHA-256, checked when they are read. :func:`load_model` / :func:`load_weights` give the
base with the adapter merged (:func:`adapter_state`).

A training run directory holds its checkpoint in ``<run>/checkpoint/``. Each checkpoint is written to
``checkpoint.tmp`` and swapped in by renames, so a crash never leaves a half-written checkpoint: at any
moment ``checkpoint`` (or, mid-swap, ``checkpoint.old``) is complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .checksums import CHECKSUM_FILE, check_file, read_checksums, verified, verify_file, write_checksums
from .config import from_dict, load_yaml, save_yaml
from .errors import CheckpointError, ConfigError
from .files import sha256_file
from .models.factory import create_model, model_config_from_dict
from .nn.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterSpec, is_adapter, read_adapter, read_adapter_spec
from .nn.quantized import QUANTIZED_KINDS, QuantizationConfig, quantize_model
from .packaged import where_bundled

CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE, STATE_FILE = "config.yaml", "model.safetensors", "tokenizer.json", \
    "trainer_state.pt"


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory holding one -> the checkpoint directory."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}{where_bundled(path)}")
    for candidate in (path, path / "checkpoint", path / "checkpoint.old"):
        if (candidate / CONFIG_FILE).is_file():
            return candidate
    if (path / "config.json").is_file():  # train.init_from, generate, ... of a Hugging Face model: say how
        raise CheckpointError(f"{path} is a Hugging Face model directory, not a tokenloom checkpoint (no "
                              f"{CONFIG_FILE}): convert it first with `tokenloom import hf {path} --out DIR`")
    raise CheckpointError(f"{path} is not a checkpoint directory (no {CONFIG_FILE} in it or in "
                          f"{path / 'checkpoint'})")


def state_dict_for_saving(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, shared (tied) weights stored once."""
    seen: dict[int, str] = {}
    out = {}
    for name, tensor in state.items():
        key = tensor.data_ptr()
        if key in seen and tensor.numel() > 0:
            continue
        seen[key] = name
        out[name] = tensor.detach().contiguous().cpu()
    return out


def write_checkpoint(directory: str | Path, model: nn.Module | None, config: dict[str, Any], tokenizer: Any = None,
                     extra: Callable[[Path], None] | None = None, dtype: torch.dtype | None = None,
                     state_dict: dict[str, torch.Tensor] | None = None, weights: bool = True) -> Path:
    """Write a complete checkpoint to ``directory`` atomically (temp dir + renames).

    ``extra(tmp_dir)`` may add files (the trainer's state) before the swap. ``dtype`` stores floating
    weights in another precision (e.g. bf16 for a small bundled checkpoint). ``state_dict`` replaces
    the model's own (the trainer's float32 master weights); ``model`` may then be None. ``weights=False`` writes no
    ``model.safetensors`` (a LoRA checkpoint: ``extra`` writes the adapter files).
    """
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    old = directory.with_name(directory.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        if weights:
            tensors = state_dict_for_saving(state_dict if state_dict is not None else model.state_dict())
            if dtype is not None:
                tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
            save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        save_yaml(config, tmp / CONFIG_FILE)
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER_FILE)
        if extra is not None:
            extra(tmp)
        write_checksums(tmp)
        for f in tmp.iterdir():  # make the files durable before they become visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if directory.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
        os.replace(tmp, directory)
    except BaseException:  # a failed write (disk full, read-only, Ctrl-C) leaves the previous checkpoint in place
        if old.exists() and not directory.exists():
            with contextlib.suppress(OSError):
                os.replace(old, directory)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return directory


def checkpoint_damage(path: str | Path) -> str | None:
    """Why the checkpoint at ``path`` is damaged (a file missing, or its bytes not those written), or None when
    it is intact. Checkpoints written before checksums existed (no ``checksums.json``) count as intact. The files
    found intact are not hashed again by the loaders that read them next (:func:`tokenloom.checksums.verified`)."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        return f"{path} has no {CONFIG_FILE}"
    try:
        sums = read_checksums(path)
    except CheckpointError as err:
        return str(err)
    for name, expected in (sums or {}).items():
        if not (path / name).is_file():
            return f"{path / name} is missing"
        try:
            verify_file(path / name, expected)
        except CheckpointError as err:
            return str(err)
    return None


def read_config(path: str | Path) -> dict[str, Any]:
    """The ``config.yaml`` of a checkpoint (or run) directory as a dict; a missing or unreadable one is a one-line
    ``CheckpointError``."""
    ckpt = resolve_checkpoint(path)
    check_file(ckpt, CONFIG_FILE)
    try:
        return load_yaml(ckpt / CONFIG_FILE)
    except ConfigError as err:
        raise CheckpointError(f"corrupt checkpoint config: {err}") from None


def load_model(path: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = torch.float32) -> tuple[nn.Module, dict[str, Any]]:
    """(model in eval mode, the checkpoint's config dict). Errors are one-line :class:`CheckpointError`. A quantised
    checkpoint (a ``quantization`` section) gives the float model's skeleton with its layers replaced by quantised
    ones, into which the stored integer weights are loaded as they are (never re-quantised); its kernels are
    ``dequantize`` until :func:`tokenloom.nn.quantized.select_kernels` measures better ones. Every file read is
    checked against the checkpoint's ``checksums.json`` (:mod:`tokenloom.checksums`): the weights' SHA-256 computed
    while the model is built and loaded."""
    ckpt = resolve_checkpoint(path)
    config = read_config(ckpt)
    try:
        family, model_config = model_config_from_dict(config.get("model", {}))
        quantization = stored_quantization(config)
    except ConfigError as err:
        raise CheckpointError(f"{ckpt / CONFIG_FILE}: {err}") from None
    with verified(ckpt, WEIGHTS_FILE):  # hashed alongside the model's construction and the copy of its weights
        model = create_model(family, model_config, init=False)  # every weight is loaded next
        if quantization is not None:
            try:
                quantize_model(model, quantization, quantize_weights=False)
            except ConfigError as err:
                raise CheckpointError(f"{ckpt / CONFIG_FILE}: {err}") from None
        load_weights(model, ckpt)
        if dtype is not None:
            model.to(dtype)
    return model.to(device).eval(), config


def load_weights(model: nn.Module, path: str | Path, fresh: Callable[[str], bool] | None = None) -> None:
    """Load ``model.safetensors`` of a checkpoint into ``model``, checking names and shapes; tensors whose names
    ``fresh`` accepts may be absent from the checkpoint (they keep their initial values). A LoRA checkpoint gives
    its base weights with the adapter merged (:func:`adapter_state`). The files are checked against the
    checkpoint's ``checksums.json``: a damaged one is a one-line :class:`CheckpointError` naming it (``model`` may
    then hold some of its bytes: discard it)."""
    ckpt = resolve_checkpoint(path)
    if is_adapter(ckpt):
        spec, base, tensors = adapter_state(ckpt)
        load_state(model, merged_adapter_state(spec, base, tensors), f"{ckpt} (base + adapter)", fresh)
        return
    with verified(ckpt, WEIGHTS_FILE):  # hashed while the tensors are copied into the model
        load_state(model, read_weights(ckpt), str(ckpt / WEIGHTS_FILE), fresh)


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's ``model.safetensors``; a missing or corrupt file (one that does not match the
    checkpoint's ``checksums.json``, where it has one: :func:`tokenloom.checksums.verified`) is a one-line error."""
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"checkpoint is missing its weights: {weights}")
    with verified(path, WEIGHTS_FILE):
        try:
            return load_file(str(weights))
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{weights} is truncated or corrupt ({str(err).splitlines()[0]})") from None


# --- LoRA checkpoints: an adapter and a reference to its frozen base --------------------------------------------------

BASE_DIR = "base"  # <run>/base: the frozen base of a LoRA run that started from no float checkpoint on disk


def weights_fingerprint(path: str | Path) -> str:
    """The SHA-256 of a checkpoint's ``model.safetensors``: its ``checksums.json`` entry where it has one (what the
    damage check verifies), else hashed now."""
    ckpt = Path(path)
    manifest = ckpt / CHECKSUM_FILE
    if manifest.is_file():
        with contextlib.suppress(OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            digest = json.loads(manifest.read_text(encoding="utf-8")).get(WEIGHTS_FILE)
            if isinstance(digest, str):
                return digest
    weights = ckpt / WEIGHTS_FILE
    try:
        return sha256_file(weights)
    except OSError as err:
        raise CheckpointError(f"cannot read {weights}: {err.strerror or err}") from None


def base_reference(path: str | Path, *, in_run: bool = False) -> dict[str, Any]:
    """How a LoRA checkpoint's ``adapter.json`` names its base: the checkpoint at ``path`` (as given and absolute),
    or with ``in_run`` the run's own ``<run>/base``; with the SHA-256 of its weights."""
    ckpt = resolve_checkpoint(path)
    if in_run:
        return {"kind": "run", "path": BASE_DIR, "sha256": weights_fingerprint(ckpt)}
    return {"kind": "checkpoint", "path": str(path), "resolved": str(ckpt.resolve()),
            "sha256": weights_fingerprint(ckpt)}


def adapter_base(path: str | Path, spec: AdapterSpec | None = None) -> Path:
    """The checkpoint directory holding the frozen base weights of the LoRA checkpoint at ``path``: the one
    ``adapter.json`` names (absolute, then as given, relative to here), or for a run's own base ``<run>/base`` next
    to the checkpoint (``<run>/checkpoint``, ``<run>/history/step-N``, ``<run>/best``); its weights' SHA-256 must be
    the recorded one. One-line :class:`CheckpointError` otherwise."""
    ckpt = resolve_checkpoint(path)
    if spec is None:
        check_file(ckpt, ADAPTER_CONFIG)
        spec = read_adapter_spec(ckpt)
    base = spec.base if isinstance(spec.base, dict) else {}
    meta = ckpt / ADAPTER_CONFIG
    if base.get("kind") == "run":
        candidates = [ckpt.parent / BASE_DIR, ckpt.parent.parent / BASE_DIR]
    elif base.get("kind") == "checkpoint":
        candidates = [Path(p) for p in (base.get("resolved"), base.get("path")) if isinstance(p, str)]
    else:
        raise CheckpointError(f"{meta} names no base checkpoint (base: {base!r})")
    found = [c for c in candidates if (c / WEIGHTS_FILE).is_file()]
    if not found:
        raise CheckpointError(f"{meta}: its base checkpoint is not found (looked in "
                              f"{', '.join(map(str, dict.fromkeys(candidates)))}); the adapter needs the exact "
                              "weights it was trained on")
    for candidate in found:
        if weights_fingerprint(candidate) == base.get("sha256"):
            return candidate
    raise CheckpointError(f"{meta}: the base checkpoint {found[0]} has other weights than the adapter was trained on "
                          f"(SHA-256 {weights_fingerprint(found[0])[:12]}..., recorded {str(base.get('sha256'))[:12]}"
                          "...); use the base it was trained on")


def adapter_state(path: str | Path) -> tuple[AdapterSpec, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(settings, base weights, adapter tensors) of the LoRA checkpoint at ``path``: the base float (as stored,
    not yet quantised for a QLoRA adapter), under the plain model's names; the adapter under
    :func:`tokenloom.nn.lora.lora_state_dict`'s."""
    ckpt = resolve_checkpoint(path)
    spec, tensors = read_checked_adapter(ckpt)
    return spec, read_weights(adapter_base(ckpt, spec)), tensors


def read_checked_adapter(path: str | Path) -> tuple[AdapterSpec, dict[str, torch.Tensor]]:
    """:func:`tokenloom.nn.lora.read_adapter` of the checkpoint at ``path``, its files (``adapter.json``,
    ``adapter.safetensors``) first checked against its ``checksums.json``."""
    ckpt = resolve_checkpoint(path)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        check_file(ckpt, name)
    return read_adapter(ckpt)


def merged_adapter_state(spec: AdapterSpec, base: dict[str, torch.Tensor],
                         tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain model's weights an adapter stands for: each adapted layer's ``W + (alpha / rank) * B @ A`` in
    float32 (a QLoRA adapter's quantised base layers first quantised and dequantised as in training: merging into a
    quantised base dequantises it), the rest of ``base`` as it is."""
    from .nn.int_kernels import dequantize, quantize_weight

    state = dict(base)
    quantized = spec.quantized_base or {}
    for name in quantized.get("layers", []):
        key = f"{name}.weight"
        if key not in state:
            raise CheckpointError(f"adapter.json: quantized_base names {name}, which the base weights lack")
        stored = quantize_weight(state[key].float(), int(quantized["bits"]), int(quantized.get("group_size", 128)))
        state[key] = dequantize(stored, torch.float32)
    scale = float(spec.alpha) / spec.rank
    for name in spec.modules:
        key, a, b = f"{name}.weight", tensors.get(f"{name}.lora_A.weight"), tensors.get(f"{name}.lora_B.weight")
        if key not in state or a is None or b is None:
            raise CheckpointError(f"adapter.json names the adapted layer {name}, but the base or the adapter lacks "
                                  "its tensors")
        state[key] = state[key].float() + (b.float() @ a.float()) * scale
    state.update((key, t) for key, t in tensors.items() if not key.endswith((".lora_A.weight", ".lora_B.weight")))
    return state  # (with the parameters trained in full beside the adapters: a task's new head)


def load_state(model: nn.Module, state: dict[str, torch.Tensor], source: str,
               fresh: Callable[[str], bool] | None = None) -> None:
    """Copy ``state`` into ``model``'s tensors (casting to their dtype), after checking that the names
    match (tied copies may be left out, and names ``fresh`` accepts) and every shape agrees; errors name
    ``source``."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state and not _is_tied(model, k, state)
               and not (fresh is not None and fresh(k))]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise CheckpointError(f"{source} does not match its config: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(f"{source}: {name} has shape {tuple(tensor.shape)}, the config needs "
                                  f"{tuple(expected[name].shape)}")
    with torch.no_grad():
        for name, tensor in state.items():
            expected[name].copy_(tensor)


def _is_tied(model: nn.Module, name: str, state: dict[str, torch.Tensor]) -> bool:
    """True when ``name`` shares storage with a saved parameter (tied embeddings)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if name not in params:
        return False
    ptr = params[name].data_ptr()
    return any(p.data_ptr() == ptr and other in state for other, p in params.items() if other != name)


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer, with the end-of-text token its config names (``tokenizer.eos_token``)."""
    from .data.tokenizers import Tokenizer

    ckpt = resolve_checkpoint(path)
    section = read_config(ckpt).get("tokenizer") or {}
    eos = section.get("eos_token") if isinstance(section, dict) else None
    if eos is not None and not isinstance(eos, str):
        raise CheckpointError(f"{ckpt / CONFIG_FILE}: tokenizer.eos_token must be a token (a string) or null, "
                              f"got {eos!r}")
    check_file(ckpt, TOKENIZER_FILE)
    tokenizer = Tokenizer.from_file(ckpt / TOKENIZER_FILE, eos_token=eos)
    for key in ("chat_template", "bos_token"):  # the chat template the checkpoint records (tokenloom.data.chat)
        value = section.get(key) if isinstance(section, dict) else None
        if value is not None and not isinstance(value, str):
            raise CheckpointError(f"{ckpt / CONFIG_FILE}: tokenizer.{key} must be a string or null, got {value!r}")
        setattr(tokenizer, key, value)
    tokenizer.origin = str(ckpt)  # named by encoding errors: "the tokenizer of runs/x/checkpoint knows ..."
    return tokenizer


def stored_quantization(config: dict[str, Any]) -> QuantizationConfig | None:
    """The ``quantization`` section of a checkpoint's config as a :class:`~tokenloom.nn.quantized.QuantizationConfig`,
    or None for a float checkpoint; a bad section is a one-line :class:`ConfigError`."""
    section = config.get("quantization")
    return None if section is None else from_dict(QuantizationConfig, section, prefix="quantization")


def refuse_quantized(path: str | Path, what: str) -> None:
    """A one-line :class:`~tokenloom.errors.TrainingError` when the checkpoint at ``path`` is quantised: ``what``
    (resuming, fine-tuning, ...) needs float weights."""
    from .errors import TrainingError

    ckpt = resolve_checkpoint(path)
    quantization = stored_quantization(read_config(ckpt))
    if quantization is not None:
        raise TrainingError(f"{ckpt} is a quantised checkpoint ({quantization.describe()}): {what} needs float "
                            "weights; use the float checkpoint it was made from")


def stored_dtype(path: str | Path) -> torch.dtype | None:
    """The dtype a checkpoint's floating weights are stored in (the first floating tensor's of its
    ``model.safetensors``), or None when unreadable (:func:`load_model` says why)."""
    from safetensors import safe_open

    floats = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    try:
        with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no iteration
                dtype = floats.get(f.get_slice(name).get_dtype())
                if dtype is not None:
                    return dtype
    except (SafetensorError, OSError):
        return None
    return None


def quantize_checkpoint(source: str | Path, out: str | Path, quantization: QuantizationConfig,
                        force: bool = False) -> tuple[Path, int, int]:
    """Write a weight-only quantised copy of the float checkpoint ``source`` to ``out`` (config.yaml with a
    ``quantization`` section, the quantised model.safetensors, tokenizer.json), atomically like every checkpoint.
    The layers left float keep the dtype ``source`` stores; the quantised layers' scales, zeros and biases are
    float32. Refuses (one line) an ``out`` that holds files unless ``force``, and a source already quantised.
    Returns (out, bytes of the source's model.safetensors, bytes of the new one)."""
    ckpt = resolve_checkpoint(source)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise CheckpointError(f"{out} already exists and is not empty; choose another --out or pass --force")
    if out.resolve() == ckpt.resolve():
        raise CheckpointError(f"--out {out} is the source checkpoint itself; write the quantised copy elsewhere")
    config = read_config(ckpt)
    found = stored_quantization(config)
    if found is not None:
        raise CheckpointError(f"{ckpt} is already quantised ({found.describe()}); quantise its float checkpoint")
    model, _ = load_model(ckpt)
    quantize_model(model, quantization)
    keep = stored_dtype(ckpt) or torch.float32
    quantized = {f"{name}.{buffer}" for name, module in model.named_modules() if isinstance(module, QUANTIZED_KINDS)
                 for buffer, _ in module.named_buffers(recurse=False)}
    state = {name: t if name in quantized or not t.is_floating_point() else t.to(keep)
             for name, t in state_dict_for_saving(model.state_dict()).items()}  # tied weights stored once
    tokenizer = None
    if (ckpt / TOKENIZER_FILE).is_file():
        tokenizer = load_tokenizer(ckpt)
    if force and out.exists() and not out.is_dir():
        out.unlink()
    write_checkpoint(out, None, {**config, "quantization": quantization.as_dict()}, tokenizer=tokenizer,
                     state_dict=state)
    return out, (ckpt / WEIGHTS_FILE).stat().st_size, (out / WEIGHTS_FILE).stat().st_size


def merge_adapter_checkpoint(source: str | Path, out: str | Path, force: bool = False) -> tuple[Path, AdapterSpec]:
    """Write the LoRA checkpoint ``source`` as a standalone full checkpoint at ``out``: its base with the adapter
    merged (:func:`merged_adapter_state`; a QLoRA adapter's quantised base dequantised), float32, its config
    (``train.lora`` off, ``merged_adapter`` recording what was merged) and tokenizer, no trainer state. Refuses (one
    line) a source that holds no adapter and an ``out`` that holds files unless ``force``."""
    ckpt = resolve_checkpoint(source)
    if not is_adapter(ckpt):
        raise CheckpointError(f"{ckpt} holds no LoRA adapter ({ADAPTER_CONFIG}); it is a full checkpoint already")
    out = Path(out)
    if out.resolve() == ckpt.resolve():
        raise CheckpointError(f"--out {out} is the adapter checkpoint itself; write the merged copy elsewhere")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise CheckpointError(f"{out} already exists and is not empty; choose another --out or pass --force")
    check_file(ckpt, ADAPTER_CONFIG)
    spec = read_adapter_spec(ckpt)
    model, config = load_model(ckpt)
    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    config = {**config, "train": {**train, "lora": {**(train.get("lora") or {}), "rank": 0, "quantize_base": None}},
              "merged_adapter": {"from": str(ckpt), "rank": spec.rank, "alpha": spec.alpha,
                                 "modules": len(spec.modules), "quantized_base": spec.quantized_base}}
    tokenizer = load_tokenizer(ckpt) if (ckpt / TOKENIZER_FILE).is_file() else None
    if force and out.exists() and not out.is_dir():
        out.unlink()
    write_checkpoint(out, model, config, tokenizer)
    return out, spec

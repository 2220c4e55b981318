"""Hugging Face checkpoints in and out: the converter design every model family shares.

A family's converter (:class:`HFConverter`, registered in ``HF_CONVERTERS``) is three small, local pieces:

* ``config_from_hf(hf: dict) -> config`` and ``config_to_hf(config) -> dict``: the model settings of a
  ``config.json`` as a tokenloom config dataclass and back, raising :class:`ConfigError` that names every
  setting the other side cannot express;
* ``rules(config) -> list[Rule]``: the mapping table. Each :class:`Rule` pairs one tokenloom tensor with
  one or more Hugging Face tensors and names an operation from ``OPS`` (``copy``, ``transpose``,
  ``concat``); a table is data, not code, and the same table converts in both directions;
* ``hf_defaults``: the values ``transformers`` assumes for ``config.json`` keys it leaves out.

Everything here works on plain dicts: a ``config.json`` mapping and a ``{name: tensor}`` state dict.
Reading a model directory and writing one therefore need neither ``transformers`` nor any code from the
checkpoint: safetensors is preferred, and a ``pytorch_model.bin`` is read with ``weights_only=True``.
Only :func:`to_hf` (which returns a ``transformers`` model object) imports ``transformers``.

Entry points::

    model = from_hf("path/to/hf-dir")            # or a transformers model object
    hf_model = to_hf(model)                       # a transformers model with the same weights
    import_hf("path/to/hf-dir", "runs/imported")  # a tokenloom checkpoint directory
    export_hf("runs/shakes", "exported/")         # config.json + model.safetensors + tokenizer files

Adding a family (Marian, ViT, Swin, ...) is one converter class with its table, registered under a
name, and a parity test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..checkpoint import load_model, load_state, resolve_checkpoint, stored_dtype, write_checkpoint
from ..data.tokenizers import Tokenizer
from ..errors import CheckpointError, ConfigError
from ..models.factory import create_model, model_config_to_dict
from ..models.options import LINEAR_ATTENTION
from ..nn.quantized import is_quantized
from ..registry import Registry
from .hub import resolve_hf_model

HF_CONFIG_FILE = "config.json"
_SAFETENSORS, _SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
_PICKLE, _PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ---- the mapping table ------------------------------------------------------------------------------

class Op(NamedTuple):
    """How one rule's tensors convert: HF tensors -> tokenloom tensor, and back."""

    to_ours: Callable[[list[Tensor], Rule], Tensor]
    to_hf: Callable[[Tensor, Rule], list[Tensor]]


OPS: Registry[Op] = Registry("conversion op")
OPS.register("copy")(Op(lambda ts, rule: ts[0], lambda t, rule: [t]))
# HF Conv1D (GPT-2) stores (in, out), the transpose of nn.Linear's (out, in)
OPS.register("transpose")(Op(lambda ts, rule: ts[0].t(), lambda t, rule: [t.t()]))
# several HF tensors stacked along dim 0 (separate q, k, v projections -> one fused projection)
OPS.register("concat")(Op(lambda ts, rule: torch.cat(ts, dim=0),
                          lambda t, rule: list(torch.split(t, list(rule.split), dim=0))))


# a (1, N) HF row (Marian's final_logits_bias) <-> a tokenloom (N,) vector
OPS.register("row")(Op(lambda ts, rule: ts[0].reshape(-1), lambda t, rule: [t.reshape(1, -1)]))


def _only_zeros(ts: list[Tensor], rule: Rule) -> None:
    if ts[0].device.type != "meta" and ts[0].count_nonzero():
        raise CheckpointError(f"tensor {rule.hf[0]} holds non-zero values, but the model has no place for it "
                              f"(a bias of a model without biases)")


# an HF tensor with no tokenloom counterpart that must be zero (the biases of a bias-free model exported
# to a layout that has them); ``ours`` is empty, ``split`` holds its shape, ``t`` is a dtype/device reference
OPS.register("zeros")(Op(_only_zeros, lambda t, rule: [torch.zeros(rule.split, dtype=t.dtype, device=t.device)]))


@dataclass(frozen=True)
class Rule:
    """One tokenloom tensor <-> HF tensor(s). ``split`` holds the dim-0 sizes of ``concat``'s parts
    (the shape of a ``zeros`` rule's tensor, whose ``ours`` is empty)."""

    ours: str
    hf: tuple[str, ...]
    op: str = "copy"
    split: tuple[int, ...] = ()


def rule(ours: str, hf: str | Iterable[str], op: str = "copy", split: Iterable[int] = ()) -> Rule:
    """One weight-mapping rule of a converter: our name, the Hugging Face name(s), and the operation between them."""
    return Rule(ours, (hf,) if isinstance(hf, str) else tuple(hf), op, tuple(split))


def per_layer(num_layers: int, rules: Iterable[Rule]) -> list[Rule]:
    """Expand ``{i}`` in the names of ``rules`` for every layer index."""
    rules = list(rules)
    return [Rule(r.ours.format(i=i), tuple(n.format(i=i) for n in r.hf), r.op, r.split)
            for i in range(num_layers) for r in rules]


def speedrun_problems(config: Any, display: str) -> list[str]:
    """The GPT model options no exported decoder architecture here expresses: ``qk_norm`` (its norm weights would
    be dropped and the attention changed), ``logit_softcap`` (the file would give uncapped logits),
    ``value_embeddings`` and ``unet_skips`` (their tables and scalars would be dropped)."""
    problems = []
    if config.qk_norm:
        problems.append(f"qk_norm=True ({display} has no query/key norms)")
    if config.logit_softcap is not None:
        problems.append(f"logit_softcap={config.logit_softcap} ({display} has no logit soft-capping)")
    if config.value_embeddings:
        problems.append(f"value_embeddings={config.value_embeddings} ({display} has no value embeddings)")
    if config.unet_skips:
        problems.append(f"unet_skips=True ({display} has no skip connections between layers)")
    return problems


class HFConverter:
    """A model family's link to Hugging Face (see the module docstring). Subclass and register an
    instance: ``HF_CONVERTERS.register("gpt2")(GPT2Converter())``."""

    family: str = "gpt"  # tokenloom model family (MODELS)
    model_types: tuple[str, ...] = ()  # config.json ``model_type`` values this converter reads
    architecture: str = ""  # the transformers class it exports, e.g. "GPT2LMHeadModel"
    base_prefix: str = ""  # prefix that checkpoints saved from the headless base model lack ("transformer.")
    hf_defaults: dict[str, Any] = {}  # transformers' defaults for config.json keys that may be left out
    # (name in checkpoints, name in the installed transformers' modules) substring pairs, applied in order: the
    # table uses the checkpoint names (what save_pretrained writes); transformers 5 renamed some modules (ViT,
    # Swin) and renames the tensors as it loads them
    renames: tuple[tuple[str, str], ...] = ()

    def config_from_hf(self, hf: dict[str, Any]) -> Any:
        raise NotImplementedError

    def config_to_hf(self, config: Any) -> dict[str, Any]:
        raise NotImplementedError

    def rules(self, config: Any) -> list[Rule]:
        raise NotImplementedError

    def ignored(self, config: Any) -> list[str]:
        """Regexes of HF tensor names that carry nothing tokenloom needs (buffers, tied copies)."""
        return []


HF_CONVERTERS: Registry[HFConverter] = Registry("Hugging Face converter")


def _converters() -> list[HFConverter]:
    return [HF_CONVERTERS.get(name) for name in HF_CONVERTERS]


def _supported() -> str:
    return ", ".join(f"{c.architecture} ({', '.join(c.model_types)})" for c in _converters())


def find_converter(hf_config: dict[str, Any]) -> HFConverter:
    """The converter for a ``config.json`` mapping, by ``model_type`` (then ``architectures``)."""
    model_type = hf_config.get("model_type")
    architectures = hf_config.get("architectures") or []
    for conv in _converters():
        if model_type in conv.model_types or conv.architecture in architectures:
            return conv
    what = f"architecture {architectures[0]!r}" if architectures else "an architecture"
    raise ConfigError(f"unsupported Hugging Face model: {what} (model_type {model_type!r}); "
                      f"supported: {_supported()}")


def converter_for(family: str, config: Any) -> HFConverter:
    """The first converter of ``family`` that can express ``config``; the error names every reason."""
    attention = getattr(config, "attention", "sdpa")
    if attention in LINEAR_ATTENTION:  # the weights would load, and HF would compute exact attention with them
        raise ConfigError(f"attention {attention!r} has no Hugging Face equivalent (its models use exact softmax "
                          "attention); only models with attention sdpa or math can be exported")
    reasons = []
    for conv in _converters():
        if conv.family != family:
            continue
        try:
            conv.config_to_hf(config)
            return conv
        except ConfigError as err:
            reasons.append(f"{conv.architecture}: {err}")
    if not reasons:
        raise ConfigError(f"no Hugging Face converter for the model family {family!r}; supported: {_supported()}")
    raise ConfigError("no Hugging Face architecture expresses this model: " + " | ".join(reasons))


# ---- state dict conversion --------------------------------------------------------------------------

def _meta_state(family: str, config: Any) -> tuple[dict[str, Tensor], list[str]]:
    """The model's tensors on the meta device (names and shapes, no memory, no initialisation), and the
    names a converter must cover: every tensor once, tied copies (``lm_head`` = ``tok_embed``) left out."""
    with torch.device("meta"):
        model = create_model(family, config, init=False)  # init on meta is slow (decompositions) and moot
    every = dict(model.named_parameters(remove_duplicate=False))
    unique = dict(model.named_parameters())
    state = model.state_dict()
    return state, [n for n in state if n not in every or n in unique]


def _check_rules(conv: HFConverter, rules: list[Rule], state: dict[str, Tensor], needed: list[str]) -> None:
    """A converter's table must cover every tensor of the model exactly once."""
    covered = [r.ours for r in rules if r.ours]
    missing = [n for n in needed if n not in covered]
    unknown = [n for n in covered if n not in state]
    if missing or unknown or len(set(covered)) != len(covered):
        raise RuntimeError(f"{type(conv).__name__}'s table does not match the model: not covered {missing[:3]}, "
                           f"unknown {unknown[:3]}")


def hf_to_ours(conv: HFConverter, config: Any, hf_state: dict[str, Tensor],
               source: str = "the weights") -> dict[str, Tensor]:
    """Convert an HF state dict to tokenloom names and layouts, checking every name and shape first.

    Missing and unexpected tensors and shape mismatches raise :class:`CheckpointError` naming the HF
    tensor and both shapes; ``source`` names the file in those messages.
    """
    rules = conv.rules(config)
    ours_meta, needed = _meta_state(conv.family, config)
    _check_rules(conv, rules, ours_meta, needed)
    hf_state = _with_base_prefix(conv, rules, hf_state)
    expected: dict[str, torch.Size] = {}
    ref = next(iter(ours_meta.values()))
    for r in rules:
        for name, t in zip(r.hf, OPS.get(r.op).to_hf(ours_meta[r.ours] if r.ours else ref, r), strict=True):
            expected[name] = t.shape
    ignored = [re.compile(p) for p in conv.ignored(config)]
    hf_state = _checkpoint_names(conv, hf_state, expected)
    missing = [n for n in expected if n not in hf_state]
    unexpected = [n for n in hf_state if n not in expected and not any(p.fullmatch(n) for p in ignored)]
    if missing or unexpected:
        parts = ([f"missing {', '.join(missing[:3])}" + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else "")]
                 if missing else [])
        parts += ([f"unexpected {', '.join(unexpected[:3])}"
                   + (f" (+{len(unexpected) - 3} more)" if len(unexpected) > 3 else "")] if unexpected else [])
        raise CheckpointError(f"{source} do not match config.json: {'; '.join(parts)}")
    for name, shape in expected.items():
        got = hf_state[name].shape
        if got != shape:
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(got)}, config.json implies "
                                  f"{tuple(shape)}")
    out = {}
    for r in rules:
        t = OPS.get(r.op).to_ours([hf_state[n] for n in r.hf], r)
        if r.ours:
            out[r.ours] = t.contiguous()
    return out


def ours_to_hf(conv: HFConverter, config: Any, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Convert a tokenloom state dict to HF names and layouts (tied copies are left out, like HF does)."""
    out: dict[str, Tensor] = {}
    ref = next(iter(state.values()))
    for r in conv.rules(config):
        for name, t in zip(r.hf, OPS.get(r.op).to_hf(state[r.ours] if r.ours else ref, r), strict=True):
            out[name] = t.contiguous()
    return out


def _checkpoint_names(conv: HFConverter, hf_state: dict[str, Tensor], expected: Iterable[str]) -> dict[str, Tensor]:
    """A state dict in a newer transformers' module names (a model object's ``state_dict()``) -> the checkpoint
    names the table uses (``conv.renames`` undone); names that are already right stay."""
    if not conv.renames:
        return hf_state
    expected = set(expected)
    out = {}
    for name, tensor in hf_state.items():
        if name not in expected:
            old = name
            for checkpoint_name, module_name in reversed(conv.renames):
                old = old.replace(module_name, checkpoint_name)
            name = old if old in expected else name
        out[name] = tensor
    return out


def _module_names(conv: HFConverter, state: dict[str, Tensor], own: Iterable[str]) -> dict[str, Tensor]:
    """Checkpoint names (the table's) -> the names of a transformers model whose ``state_dict()`` keys are
    ``own`` (``conv.renames`` applied where the model uses the newer names)."""
    if not conv.renames:
        return state
    own = set(own)
    out = {}
    for name, tensor in state.items():
        if name not in own:
            new = name
            for checkpoint_name, module_name in conv.renames:
                new = new.replace(checkpoint_name, module_name)
            name = new if new in own else name
        out[name] = tensor
    return out


def _with_base_prefix(conv: HFConverter, rules: list[Rule], hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Checkpoints saved from the headless model (``GPT2Model``) name tensors without the base prefix."""
    prefix = conv.base_prefix
    if not prefix or any(n.startswith(prefix) for n in hf_state):
        return hf_state
    needs = {n for r in rules for n in r.hf if n.startswith(prefix)}
    return {prefix + n if prefix + n in needs else n: t for n, t in hf_state.items()}


# ---- reading a Hugging Face directory ---------------------------------------------------------------

def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face model directory (or a hub name in the local cache,
    :func:`~tokenloom.interop.hub.resolve_hf_model`), read as JSON (no code runs); else a one-line error."""
    directory = resolve_hf_model(directory)
    path = directory / HF_CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {HF_CONFIG_FILE}: not a Hugging Face model directory")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _load_safetensors(path: Path) -> dict[str, Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path} is truncated or corrupt ({str(err).splitlines()[0]})") from None


def _load_pickle(path: Path) -> dict[str, Tensor]:
    """A ``pytorch_model.bin`` loaded with ``weights_only=True``: tensors only, never arbitrary code."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):  # the legacy (pre-1.6) format cannot be memory-mapped
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        detail = str(err).strip().splitlines()
        hint = next((line for line in detail if "GLOBAL" in line or "Unsupported" in line), detail[0] if detail else "")
        raise CheckpointError(f"refusing to load {path}: it needs arbitrary code to unpickle "
                              f"({hint.strip()[:160]}); convert it to safetensors with the tool that made it") from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise CheckpointError(f"{path} is truncated or corrupt ({str(err).splitlines()[0][:160]})") from None
    if not isinstance(state, dict) or not all(isinstance(t, Tensor) for t in state.values()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors")
    return state


def _load_sharded(directory: Path, index_name: str, loader: Callable[[Path], dict[str, Tensor]]) -> dict[str, Tensor]:
    index_path = directory / index_name
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index_path} is not a valid shard index ({err})") from None
    state: dict[str, Tensor] = {}
    for shard in dict.fromkeys(weight_map.values()):
        path = directory / shard
        if not path.is_file():
            raise CheckpointError(f"shard {shard} named in {index_path} is missing")
        state.update(loader(path))
    return state


def read_hf_weights(directory: str | Path) -> tuple[dict[str, Tensor], str]:
    """(state dict, file name) of a model directory; safetensors first, then ``pytorch_model.bin``."""
    directory = resolve_hf_model(directory)
    if (directory / _SAFETENSORS).is_file():
        return _load_safetensors(directory / _SAFETENSORS), _SAFETENSORS
    if (directory / _SAFETENSORS_INDEX).is_file():
        return _load_sharded(directory, _SAFETENSORS_INDEX, _load_safetensors), _SAFETENSORS_INDEX
    if (directory / _PICKLE).is_file():
        return _load_pickle(directory / _PICKLE), _PICKLE
    if (directory / _PICKLE_INDEX).is_file():
        return _load_sharded(directory, _PICKLE_INDEX, _load_pickle), _PICKLE_INDEX
    raise CheckpointError(f"{directory} has no weights ({_SAFETENSORS}, {_PICKLE} or a sharded index)")


def _special_token(directory: Path, hf_config: dict[str, Any], tokenizer: Tokenizer, name: str) -> str | None:
    """The text of the eos/bos token: config.json's ``<name>_token_id``, else tokenizer_config.json's."""
    token_id = hf_config.get(f"{name}_token_id")
    if isinstance(token_id, list):
        token_id = token_id[0] if token_id else None
    if isinstance(token_id, int):
        token = tokenizer.backend.id_to_token(token_id)
        if token is not None:
            return token
    path = directory / "tokenizer_config.json"
    if path.is_file():
        try:
            value = json.loads(path.read_text(encoding="utf-8")).get(f"{name}_token")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and tokenizer.backend.token_to_id(value) is not None:
            return value
    return None


def read_hf_tokenizer(directory: str | Path, hf_config: dict[str, Any] | None = None) -> Tokenizer | None:
    """The directory's ``tokenizer.json`` as a :class:`Tokenizer` (eos from the config), or None."""
    directory = resolve_hf_model(directory)
    if not (directory / "tokenizer.json").is_file():
        return None
    tokenizer = Tokenizer.from_file(directory / "tokenizer.json")
    eos = _special_token(directory, hf_config or {}, tokenizer, "eos")
    return tokenizer.with_eos(eos) if eos is not None else tokenizer


def read_hf_chat_template(directory: str | Path) -> str | None:
    """The directory's chat template (a Jinja string): ``tokenizer_config.json``'s ``chat_template`` (a string, or
    the ``default`` entry of a list of named ones), else ``chat_template.jinja`` or ``chat_template.json`` (newer
    transformers save it apart); None when there is none."""
    directory = resolve_hf_model(directory)
    candidates: list[Any] = []
    for name in ("tokenizer_config.json", "chat_template.json"):
        path = directory / name
        if path.is_file():
            try:
                candidates.append(json.loads(path.read_text(encoding="utf-8")).get("chat_template"))
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
                raise CheckpointError(f"{path}: not a JSON object ({err})") from None
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        candidates.append(jinja.read_text(encoding="utf-8"))
    for value in candidates:
        if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            value = named.get("default")
        if isinstance(value, str) and value.strip():
            return value
    return None


# ---- import -----------------------------------------------------------------------------------------

def _hf_source(model_or_dir: Any) -> tuple[dict[str, Any], dict[str, Tensor], str, Path | None]:
    """(config.json mapping, HF state dict, source name, directory or None) of a directory or model object."""
    if isinstance(model_or_dir, (str, os.PathLike)):
        directory = resolve_hf_model(model_or_dir)  # a directory, or a hub name in the local cache
        hf_config = read_hf_config(directory)
        find_converter(hf_config)  # an unsupported architecture is named before any weights are read
        state, name = read_hf_weights(directory)
        return hf_config, state, str(directory / name), directory
    if isinstance(model_or_dir, nn.Module) and hasattr(model_or_dir, "config"):
        return model_or_dir.config.to_dict(), model_or_dir.state_dict(), "the model's weights", None
    raise TypeError(f"from_hf takes a model directory or a transformers model, got {type(model_or_dir).__name__}")


def convert_from_hf(model_or_dir: Any, **overrides: Any) -> tuple[HFConverter, Any, dict[str, Tensor]]:
    """(converter, tokenloom config, tokenloom state dict) of an HF directory or model object."""
    hf_config, hf_state, source, _ = _hf_source(model_or_dir)
    conv = find_converter(hf_config)
    config = conv.config_from_hf({**conv.hf_defaults, **hf_config})
    if overrides:
        try:
            config = dataclasses.replace(config, **overrides)
        except TypeError as err:
            raise ConfigError(f"invalid override: {err}") from None
    return conv, config, hf_to_ours(conv, config, hf_state, source)


def from_hf(model_or_dir: Any, *, dtype: torch.dtype | None = None, **overrides: Any) -> nn.Module:
    """A tokenloom model with the weights of a Hugging Face model directory or ``transformers`` model.

    A model object keeps its device and train/eval mode; a directory gives an eval-mode CPU model.
    ``dtype`` casts (default: the weights' own dtype). ``overrides`` are config fields that do not change
    the weights (``attention="math"``, ``dropout=0.1``, ``max_seq_len=...``).
    """
    conv, config, state = convert_from_hf(model_or_dir, **overrides)
    model = create_model(conv.family, config, init=False)  # every weight is loaded next
    ref = next(iter(state.values()))
    # straight to the final dtype (load_state casts the weights): buffers built in float32 at construction,
    # like RoPE's cos/sin tables, must not pass through a lower precision on the way
    model.to(device=ref.device, dtype=dtype or (ref.dtype if ref.is_floating_point() else None))
    load_state(model, state, "the converted weights")
    training = model_or_dir.training if isinstance(model_or_dir, nn.Module) else False
    return model.train(training)


def _check_out(out: Path, force: bool) -> None:
    """Refuse to overwrite data unless ``force``; with it, a plain file in the way is removed."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise CheckpointError(f"{out} already exists and is not empty; choose another --out or pass --force")
    if force and out.exists() and not out.is_dir():
        out.unlink()


def import_hf(directory: str | Path, out: str | Path, *, dtype: torch.dtype | None = None,
              force: bool = False) -> Path:
    """Write a tokenloom checkpoint directory (config.yaml, model.safetensors, tokenizer.json when the
    source has one) from a Hugging Face model directory, or a hub name (``gpt2``, ``org/name``) already in the local
    Hugging Face cache (:func:`~tokenloom.interop.hub.resolve_hf_model`; nothing is downloaded). Returns ``out``."""
    name, out = os.fspath(directory), Path(out)
    directory = resolve_hf_model(directory)
    _check_out(out, force)
    hf_config = read_hf_config(directory)
    conv, config, state = convert_from_hf(directory)
    tokenizer = read_hf_tokenizer(directory, hf_config)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"{directory / 'tokenizer.json'} has {tokenizer.vocab_size} ids but the model only "
                              f"{config.vocab_size}")
    run_config: dict[str, Any] = {"model": model_config_to_dict(conv.family, config),
                                  "source": {"format": "huggingface", "path": str(directory.resolve()),
                                             **({} if Path(name).is_dir() else {"name": name}),  # a hub name
                                             "model_type": hf_config.get("model_type"),
                                             "architecture": (hf_config.get("architectures") or [None])[0]}}
    if tokenizer is not None and tokenizer.eos_token is not None:
        run_config["tokenizer"] = {"eos_token": tokenizer.eos_token}
    chat_template = read_hf_chat_template(directory) if tokenizer is not None else None
    if chat_template is not None:  # the model's own chat template (sft, generate --chat and the server use it)
        section = run_config.setdefault("tokenizer", {})
        section["chat_template"] = chat_template
        bos = _special_token(directory, hf_config, tokenizer, "bos")
        if bos is not None:
            section["bos_token"] = bos
    if force and out.exists() and not (out / "config.yaml").is_file():
        shutil.rmtree(out)
    return write_checkpoint(out, None, run_config, tokenizer=tokenizer, dtype=dtype, state_dict=state)


# ---- export -----------------------------------------------------------------------------------------

def hf_config_of(model: nn.Module, family: str | None = None, tokenizer: Tokenizer | None = None,
                 dtype: torch.dtype | None = None) -> tuple[HFConverter, dict[str, Any]]:
    """(converter, complete config.json mapping) for a tokenloom model."""
    config = model.config
    family = family or _family_of(model)
    conv = converter_for(family, config)
    hf = {"architectures": [conv.architecture], "model_type": conv.model_types[0], **conv.config_to_hf(config)}
    dtype = dtype or next(model.parameters()).dtype
    hf["torch_dtype"] = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    if tokenizer is not None and tokenizer.eos_id is not None:
        hf["bos_token_id"] = hf["eos_token_id"] = tokenizer.eos_id
    return conv, hf


def _family_of(model: nn.Module) -> str:
    from ..models.registry import MODELS

    for name in MODELS.names():
        if isinstance(model, MODELS.get(name)[1]):
            return name
    raise ConfigError(f"{type(model).__name__} is not a registered tokenloom model")


def to_hf(model: nn.Module, *, attn_implementation: str | None = None) -> nn.Module:
    """A ``transformers`` model with exactly ``model``'s weights, dtype, device and train/eval mode."""
    transformers = _transformers()
    conv, hf = hf_config_of(model)
    hf.pop("architectures")
    model_type = hf.pop("model_type")
    if attn_implementation is not None:
        hf["attn_implementation"] = attn_implementation
    hf_model = getattr(transformers, conv.architecture)(transformers.AutoConfig.for_model(model_type, **hf))
    ref = next(model.parameters())
    hf_model.to(device=ref.device, dtype=ref.dtype)
    state = _module_names(conv, ours_to_hf(conv, model.config, model.state_dict()), hf_model.state_dict())
    ignored = [re.compile(p) for p in conv.ignored(model.config)]
    tied = {id(p) for n, p in hf_model.named_parameters(remove_duplicate=False) if n in state}
    for name, tensor in hf_model.state_dict(keep_vars=True).items():  # what transformers computes itself
        if name not in state and any(p.fullmatch(name) for p in ignored) and id(tensor) not in tied:
            state[name] = tensor.detach()  # (sinusoid tables); tied copies are left to load_state
    load_state(hf_model, state, "the converted weights")
    return hf_model.train(model.training)


def export_hf(model_or_checkpoint: nn.Module | str | Path, out: str | Path, *, tokenizer: Tokenizer | None = None,
              dtype: torch.dtype | None = None, force: bool = False) -> Path:
    """Write a Hugging Face model directory (config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json when there is a tokenizer) that ``AutoModelForCausalLM.from_pretrained`` loads.

    ``model_or_checkpoint`` is a tokenloom model or checkpoint directory (its tokenizer comes along).
    The directory appears whole or not at all (written beside it, then renamed).
    """
    out = Path(out)
    _check_out(out, force)
    if isinstance(model_or_checkpoint, nn.Module):
        model = model_or_checkpoint
    else:
        ckpt = resolve_checkpoint(model_or_checkpoint)
        model, _ = load_model(ckpt, dtype=stored_dtype(ckpt))
        if tokenizer is None and (ckpt / "tokenizer.json").is_file():
            from ..checkpoint import load_tokenizer

            tokenizer = load_tokenizer(ckpt)
    if is_quantized(model):
        raise CheckpointError("the model is weight-only quantised; export needs float weights (export the float "
                              "checkpoint it was made from)")
    conv, hf = hf_config_of(model, tokenizer=tokenizer, dtype=dtype)
    state = ours_to_hf(conv, model.config, model.state_dict())
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(tmp / _SAFETENSORS),
              metadata={"format": "pt"})
    (tmp / HF_CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if tokenizer is not None:
        tokenizer.save(tmp / "tokenizer.json")
        tok_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                      "model_max_length": model.config.max_seq_len,
                                      "clean_up_tokenization_spaces": False}
        if tokenizer.eos_token is not None:
            tok_config["eos_token"] = tok_config["bos_token"] = tokenizer.eos_token
        if tokenizer.bos_token is not None:
            tok_config["bos_token"] = tokenizer.bos_token
        if tokenizer.chat_template is not None:  # as a Jinja string (the default template written out as one)
            from ..data.chat import jinja_source

            tok_config["chat_template"] = jinja_source(tokenizer.chat_template, tokenizer)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("a transformers model object needs `transformers`: pip install 'tokenloom[parity]'") from err
    return transformers

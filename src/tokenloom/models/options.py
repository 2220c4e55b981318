"""Checks, derived fields and presets shared by the model configs (GPT, encoder-decoder, ViT, Swin)."""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from ..config import check, check_choice
from ..errors import ConfigError
from ..nn import ATTENTION_BACKENDS, BLOCKS, MLPS, NORMS, POSITIONS
from ..nn.attention import backend_options
from ..nn.mlp import swiglu_hidden_dim
from ..nn.positions import check_rope_scaling
from ..registry import did_you_mean


def check_layer_options(config: Any) -> None:
    """Validate a config's layer options (heads, dropout, MLP, norm, placement, attention backend) and set its
    derived ``head_dim`` and ``mlp_hidden`` (the MLP width the model builds: ``mlp_hidden_dim``, else
    ``mlp_ratio * embed_dim``, 2/3 of it for swiglu rounded up to a multiple of 8). A config without a
    ``num_kv_heads`` field (vision models) has as many key/value heads as query heads."""
    check(config.embed_dim % config.num_heads == 0,
          f"embed_dim={config.embed_dim} must be divisible by num_heads={config.num_heads}")
    num_kv_heads = getattr(config, "num_kv_heads", None)
    if num_kv_heads is not None:
        check(num_kv_heads >= 1 and config.num_heads % num_kv_heads == 0,
              f"num_kv_heads={num_kv_heads} must divide num_heads={config.num_heads}")
    check(0.0 <= config.dropout < 1.0, f"dropout must be in [0, 1), got {config.dropout}")
    check(config.attention_dropout is None or 0.0 <= config.attention_dropout < 1.0,
          f"attention_dropout must be in [0, 1), got {config.attention_dropout}")
    check(0 < config.mlp_ratio < math.inf, f"mlp_ratio must be a finite number > 0, got {config.mlp_ratio}")
    check(config.mlp_hidden_dim is None or config.mlp_hidden_dim >= 1,
          f"mlp_hidden_dim must be a positive integer or null, got {config.mlp_hidden_dim}")
    norm_eps = getattr(config, "norm_eps", 1e-5)
    check(0 < norm_eps < 1, f"norm_eps must be in (0, 1), got {norm_eps}")
    rope_base = getattr(config, "rope_base", 10000.0)
    check(rope_base > 1, f"rope_base must be > 1 (the RoPE frequency base), got {rope_base}")
    check_choice("norm", config.norm, NORMS)
    check_choice("norm_placement", config.norm_placement, BLOCKS)
    check_choice("mlp", config.mlp, MLPS)
    check_choice("attention", config.attention, ATTENTION_BACKENDS)
    backend_options(config.attention, getattr(config, "attention_options", None))  # the backend validates its own
    config.head_dim = config.embed_dim // config.num_heads
    if config.mlp_hidden_dim is not None:
        config.mlp_hidden = config.mlp_hidden_dim
    else:
        try:
            two_layer = int(config.mlp_ratio * config.embed_dim)
        except OverflowError:  # the product is beyond the float range
            two_layer = 0
        check(two_layer >= 1, f"mlp_ratio={config.mlp_ratio} x embed_dim={config.embed_dim} must give an MLP width "
                              f"of at least 1 and within the float range")
        config.mlp_hidden = swiglu_hidden_dim(two_layer) if config.mlp == "swiglu" else two_layer


def check_block_options(config: Any, causal: bool = True) -> None:
    """:func:`check_layer_options` plus the sequence models' position scheme (``position``, RoPE settings) and
    what the linear-time attention backends cannot do: a score bias (alibi, t5), and for linformer a ``causal``
    model (one whose attention is causal anywhere)."""
    check_layer_options(config)
    check_choice("position", config.position, POSITIONS)
    if config.attention in LINEAR_ATTENTION:
        check(config.position not in ("alibi", "t5", "xl"), f"attention {config.attention!r} cannot add the score "
              f"bias of position {config.position!r}; use rope, sinusoidal, learned or none")
    check(not (causal and config.attention == "linformer"), "attention 'linformer' is non-causal (its projections "
          "mix all positions) and this model attends causally; use performer or sdpa")
    if config.position == "rope":
        check(config.head_dim % 2 == 0, f"position 'rope' needs an even head_dim, got {config.head_dim}")
        check_rope_scaling(config.rope_scaling)
    else:
        check(config.rope_scaling is None,
              f"rope_scaling is set but position is {config.position!r}; it applies to 'rope' only")


LINEAR_ATTENTION = ("performer", "linformer")


MEMORY_POSITIONS = ("xl", "alibi", "t5", "none")  # schemes whose scores use offsets computed at attention time


def check_memory_options(config: Any) -> None:
    """``memory_len`` (Transformer-XL's segment memory): >= 0; with a memory, a position scheme that keys computed
    in an earlier segment still fit (:data:`MEMORY_POSITIONS`: the keys carry no absolute position), no sliding
    window (the memory is the extra context) and no gradient checkpointing (its recomputation would write the
    memory twice)."""
    memory = config.memory_len
    check(isinstance(memory, int) and not isinstance(memory, bool) and memory >= 0,
          f"memory_len must be a non-negative integer, got {memory!r}")
    if memory:
        check(config.position in MEMORY_POSITIONS, f"memory_len={memory} needs a relative position scheme "
              f"({', '.join(MEMORY_POSITIONS)}); position {config.position!r} puts absolute positions in the keys")
        check(config.attention_window is None, f"memory_len={memory} and attention_window="
              f"{config.attention_window} cannot be combined: the memory is the context beyond the segment")
        check(not config.gradient_checkpointing, f"memory_len={memory} cannot be combined with "
              "gradient_checkpointing (recomputing a block would write its memory twice)")
        check(config.attention not in LINEAR_ATTENTION, f"memory_len needs attention sdpa or math, got "
              f"{config.attention!r}")


def check_speedrun_options(config: Any) -> None:
    """The speedrun's stack options (:mod:`tokenloom.nn.speedrun`): ``value_embeddings`` an integer in
    0 .. num_layers (tables feed the first and the last k layers), ``unet_skips`` a bool, with at least 2 layers
    (one half to keep, one to receive)."""
    k, layers = config.value_embeddings, config.num_layers
    check(isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= layers,
          f"value_embeddings must be an integer in 0..num_layers={layers}, got {k!r}")
    check(isinstance(config.unet_skips, bool), f"unet_skips must be true or false, got {config.unet_skips!r}")
    check(not config.unet_skips or layers >= 2, f"unet_skips=True needs num_layers >= 2, got {layers}")


def check_window_options(config: Any, window_field: str = "attention_window",
                         global_field: str = "attention_global") -> None:
    """The sliding-window fields named ``window_field`` (None or a positive number of positions) and
    ``global_field`` (0 .. the window; only with a window): GPT's causal ``attention_window`` /
    ``attention_global``, the encoder-decoder's bidirectional ``encoder_attention_window`` /
    ``encoder_attention_global``. A window needs an exact softmax backend (sdpa or math: the linear-time ones
    attend globally by construction). A causal window of at least the context attends to all of it (as full
    attention would; in GPT it then only limits decoding past ``max_seq_len``); a bidirectional one does where
    its half ``W // 2`` reaches from the first position to the last (``W // 2 >= length - 1``)."""
    window, extra = getattr(config, window_field), getattr(config, global_field)
    check(window is None or (isinstance(window, int) and not isinstance(window, bool) and window >= 1),
          f"{window_field} must be a positive integer or null, got {window!r}")
    check(isinstance(extra, int) and not isinstance(extra, bool) and extra >= 0,
          f"{global_field} must be a non-negative integer, got {extra!r}")
    if window is None:
        check(extra == 0, f"{global_field}={extra} needs an {window_field}")
        return
    check(extra <= window, f"{global_field}={extra} must not exceed {window_field}={window}")
    check(config.attention in ("sdpa", "math"), f"{window_field} needs attention sdpa or math (the exact "
          f"softmax); {config.attention!r} attends to every position by construction")


def attention_options(config: Any, max_len: int) -> dict:
    """What each attention layer of a model takes: the config's ``attention_options`` section (the backend's own
    options) and ``max_len``, the longest key sequence (Linformer's projection length)."""
    return dict(max_len=max_len, **(getattr(config, "attention_options", None) or {}))


# keys that old configs held at the top level (before 2026-12-02), now in ``attention_options``:
# old key -> (the backend it applied to, its name in that backend's options)
MOVED_ATTENTION_KEYS = {"performer_features": ("performer", "features"), "performer_redraw": ("performer", "redraw"),
                        "linformer_k": ("linformer", "k")}


def migrate_model_section(data: dict[str, Any]) -> dict[str, Any]:
    """A ``model:`` mapping with renamed keys moved to where they live now, so old ``config.yaml`` files (bundled
    checkpoints, users' runs) still load: ``performer_features`` / ``performer_redraw`` / ``linformer_k`` go into
    ``attention_options`` when the model uses that backend (an explicit ``attention_options`` entry wins), and are
    dropped otherwise (they were the unused defaults every saved config carried)."""
    moved = [key for key in MOVED_ATTENTION_KEYS if key in data]
    if not moved:
        return data
    data = dict(data)
    options = dict(data.get("attention_options") or {})
    for key in moved:
        value = data.pop(key)
        backend, name = MOVED_ATTENTION_KEYS[key]
        if data.get("attention", "sdpa") == backend:
            options.setdefault(name, value)
    data["attention_options"] = options or None
    return data


def check_image_options(config: Any) -> tuple[int, int]:
    """Validate a vision config's ``image_size`` (an int or a (height, width) pair; a YAML list becomes a
    tuple), ``patch_size``, ``in_channels`` and ``num_classes``; returns the image size as (height, width)."""
    size = config.image_size
    if isinstance(size, list):
        size = config.image_size = tuple(size)
    valid = isinstance(size, int) or (isinstance(size, tuple) and len(size) == 2
                                      and all(isinstance(v, int) for v in size))
    hw = (size, size) if isinstance(size, int) else size
    check(valid and min(hw) >= 1,
          f"image_size must be a positive integer or a (height, width) pair, got {config.image_size!r}")
    for name in ("patch_size", "in_channels", "num_classes"):
        value = getattr(config, name)
        check(isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value!r}")
    return hw


def from_preset(cls: type, presets: dict[str, dict], kind: str, name: str, overrides: dict[str, Any]) -> Any:
    """``cls(**presets[name], **overrides)``; an unknown name is a :class:`ConfigError` listing the ``kind``
    presets and the closest match (every config's ``from_name``)."""
    if name not in presets:
        raise ConfigError(f"unknown {kind} preset {name!r}{did_you_mean(name, presets)}; known: {', '.join(presets)}")
    return cls(**{**presets[name], **overrides})


def init_vision_linear(module: nn.Module) -> None:
    """ViT's and Swin's initialisation of a linear layer (timm, Hugging Face): weights from a normal truncated
    to +-2 with std 0.02, zero bias; other modules untouched. Use with ``model.apply``."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)

"""Checks and derived fields shared by the model configs (GPT, encoder-decoder): the block options."""

from __future__ import annotations

from typing import Any

from ..config import check, check_choice
from ..nn import ATTENTION_BACKENDS, BLOCKS, MLPS, NORMS, POSITIONS
from ..nn.mlp import swiglu_hidden_dim
from ..nn.positions import check_rope_scaling


def check_block_options(config: Any) -> None:
    """Validate a config's block options (names, heads, dropout, RoPE) and set its derived ``head_dim``
    and ``mlp_hidden`` (the MLP width the model builds: ``mlp_hidden_dim``, else ``mlp_ratio * embed_dim``,
    2/3 of it for swiglu rounded up to a multiple of 8)."""
    check(config.embed_dim % config.num_heads == 0,
          f"embed_dim={config.embed_dim} must be divisible by num_heads={config.num_heads}")
    if config.num_kv_heads is not None:
        check(config.num_kv_heads >= 1 and config.num_heads % config.num_kv_heads == 0,
              f"num_kv_heads={config.num_kv_heads} must divide num_heads={config.num_heads}")
    check(0.0 <= config.dropout < 1.0, f"dropout must be in [0, 1), got {config.dropout}")
    check(config.attention_dropout is None or 0.0 <= config.attention_dropout < 1.0,
          f"attention_dropout must be in [0, 1), got {config.attention_dropout}")
    check(config.mlp_ratio > 0, f"mlp_ratio must be positive, got {config.mlp_ratio}")
    check(config.mlp_hidden_dim is None or config.mlp_hidden_dim >= 1,
          f"mlp_hidden_dim must be a positive integer or null, got {config.mlp_hidden_dim}")
    check_choice("position", config.position, POSITIONS)
    check_choice("norm", config.norm, NORMS)
    check_choice("norm_placement", config.norm_placement, BLOCKS)
    check_choice("mlp", config.mlp, MLPS)
    check_choice("attention", config.attention, ATTENTION_BACKENDS)
    config.head_dim = config.embed_dim // config.num_heads
    if config.position == "rope":
        check(config.head_dim % 2 == 0, f"position 'rope' needs an even head_dim, got {config.head_dim}")
        check_rope_scaling(config.rope_scaling)
    else:
        check(config.rope_scaling is None,
              f"rope_scaling is set but position is {config.position!r}; it applies to 'rope' only")
    if config.mlp_hidden_dim is not None:
        config.mlp_hidden = config.mlp_hidden_dim
    else:
        two_layer = int(config.mlp_ratio * config.embed_dim)
        config.mlp_hidden = swiglu_hidden_dim(two_layer) if config.mlp == "swiglu" else two_layer

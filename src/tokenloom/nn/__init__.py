"""Building blocks: attention and its backends, KV cache, positions, norms, MLPs, blocks, masks."""

from .attention import ATTENTION_BACKENDS, MultiHeadAttention
from .block import BLOCKS, PostNormBlock, PreNormBlock, create_block
from .kv_cache import KVCache
from .mlp import MLPS, create_mlp
from .norms import NORMS, LayerNorm, RMSNorm, create_norm
from .positions import (
    POSITIONS,
    ROPE_SCALINGS,
    Position,
    apply_rotary,
    check_rope_scaling,
    create_position,
    rope_frequencies,
)

__all__ = [
    "ATTENTION_BACKENDS", "BLOCKS", "MLPS", "NORMS", "POSITIONS", "ROPE_SCALINGS", "KVCache", "LayerNorm",
    "MultiHeadAttention", "Position", "PostNormBlock", "PreNormBlock", "RMSNorm", "apply_rotary",
    "check_rope_scaling", "create_block", "create_mlp", "create_norm", "create_position", "rope_frequencies",
]

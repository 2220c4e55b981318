"""Building blocks: attention and its backends, KV cache, positions, norms, MLPs, blocks, masks, patch
embedding and window helpers for vision models, encoding long inputs in overlapping chunks, adaptive computation
time (halting per position)."""

from .act import ACTResult, ACTState, HaltingUnit, act_step, adaptive_computation
from .attention import ATTENTION_BACKENDS, Context, MultiHeadAttention
from .block import BLOCKS, PostNormBlock, PreNormBlock, create_block
from .chunking import Chunks, encode_chunks, encode_in_chunks, fuse_chunks, pool_chunks, split_chunks
from .kv_cache import KVCache, LayerCache, MemoryLayer, RaggedView, StaticKVCache, StaticView
from .mlp import MLPS, create_mlp
from .norms import NORMS, LayerNorm, RMSNorm, create_norm
from .patch_embed import PatchEmbed, patchify, resample_grid, sincos_2d, unpatchify
from .positions import (
    POSITIONS,
    ROPE_SCALINGS,
    Position,
    apply_rotary,
    check_rope_scaling,
    create_position,
    rope_frequencies,
)
from .windows import relative_position_index, shifted_window_mask, window_partition, window_reverse

__all__ = [
    "ACTResult", "ACTState", "HaltingUnit", "act_step", "adaptive_computation",
    "ATTENTION_BACKENDS", "BLOCKS", "MLPS", "NORMS", "POSITIONS", "ROPE_SCALINGS", "Chunks", "Context", "KVCache",
    "LayerCache", "LayerNorm", "MemoryLayer", "RaggedView", "StaticKVCache", "StaticView",
    "MultiHeadAttention", "PatchEmbed", "Position", "PostNormBlock", "PreNormBlock", "RMSNorm", "apply_rotary",
    "check_rope_scaling", "create_block", "create_mlp", "create_norm", "create_position", "encode_chunks",
    "encode_in_chunks", "fuse_chunks", "patchify", "pool_chunks", "relative_position_index", "resample_grid",
    "rope_frequencies", "shifted_window_mask", "sincos_2d", "split_chunks", "unpatchify", "window_partition",
    "window_reverse",
]

"""Attention rollout (Abnar & Zuidema 2020): how much each input token flows into each output position through
all layers, from the per-layer attention maps. For a ViT: the class token's row over the patches, as a heat
map on the image."""

from __future__ import annotations

import torch
from torch import Tensor


def attention_rollout(maps: list[Tensor], residual: bool = True, head_fusion: str = "mean") -> Tensor:
    """``maps``: per layer, in order, (B, H, T, T) probabilities -> (B, T, T) rollout ``R = A_L ... A_1`` with
    ``A_l = 0.5 * fuse_heads(P_l) + 0.5 * I`` (the residual path; ``residual=False``: ``A_l = fuse(P_l)``),
    rows renormalised; ``head_fusion`` ``mean``, ``max`` or ``min`` over heads."""
    if not maps:
        raise ValueError("attention_rollout needs at least one layer's attention map")
    fuse = {"mean": lambda p: p.mean(1), "max": lambda p: p.amax(1), "min": lambda p: p.amin(1)}.get(head_fusion)
    if fuse is None:
        raise ValueError(f"head_fusion must be mean, max or min, got {head_fusion!r}")
    rollout = None
    for probs in maps:
        a = fuse(probs.float())  # (B, T, T)
        if residual:
            a = 0.5 * a + 0.5 * torch.eye(a.shape[-1], device=a.device)
        a = a / a.sum(-1, keepdim=True)
        rollout = a if rollout is None else a @ rollout
    return rollout

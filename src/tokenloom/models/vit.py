"""Vision Transformer (Dosovitskiy et al. 2020): an image as a sequence of patch tokens.

Shape legend: B batch, H/W image height/width, P patch size, Gh/Gw patch grid, N = Gh * Gw patches,
T = N (+1 with a class token) tokens, C embed_dim, K num_classes.

images (B, in_channels, H, W) -> patch embedding (B, N, C) -> [class token] + positions -> L blocks of the
spine (``create_block``: pre- or post-norm attention + MLP) -> final norm -> pooling (the class token, or the
mean of the patch tokens) -> classifier (B, K).

Positions: ``learned`` (one vector per token of the training grid, the class token included; an image of
another size gets the grid part resized bicubically, as Hugging Face's ``interpolate_pos_encoding``) or
``sincos2d`` (fixed 2-D sin-cos, MAE; computed for any grid; the class token gets none).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..config import check
from ..nn import create_block, create_norm
from ..nn.dropout import Dropout
from ..nn.patch_embed import PatchEmbed, resample_grid, sincos_2d
from ..registry import did_you_mean
from .options import attention_options, check_image_options, check_layer_options, from_preset, init_vision_linear
from .registry import MODELS

POOLS = ("cls", "mean")
VIT_POSITIONS = ("learned", "sincos2d")


@dataclass
class ViTConfig:
    """A Vision Transformer (``model:`` with ``family: vit``): patches, a class token (or mean pooling), blocks."""

    image_size: int | tuple[int, int] = 224  # training image size (H, W): learned positions cover its grid
    patch_size: int = 16  # side P of the square patches; H and W must be multiples of it
    in_channels: int = 3  # image channels (1 for MNIST)
    num_classes: int = 1000  # classifier outputs
    embed_dim: int = 768  # width of the token stream, C
    num_layers: int = 12  # Transformer blocks
    num_heads: int = 12  # attention heads
    mlp_ratio: float = 4.0  # MLP hidden width = mlp_ratio * embed_dim
    mlp_hidden_dim: int | None = None  # exact MLP hidden width; None = from mlp_ratio
    mlp: str = "gelu"  # gelu (exact) | gelu_tanh | relu | silu | swiglu
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-6  # epsilon of every norm layer (Hugging Face checkpoints: 1e-12)
    norm_placement: str = "pre"  # pre | post
    dropout: float = 0.0  # dropout on embeddings, attention probabilities and residual branches
    attention_dropout: float | None = None  # dropout on attention probabilities; None = dropout
    pool: str = "cls"  # cls (a class token, classified) | mean (mean of the patch tokens, no class token)
    position: str = "learned"  # learned | sincos2d
    qkv_bias: bool = True  # bias on the query/key/value projection (the other linear layers always have one)
    attention: str = "sdpa"  # attention backend: sdpa (fused) | math | performer | linformer
    attention_options: dict | None = None  # the backend's own options: performer {features, redraw}, linformer {k}
    head_dim: int = field(init=False, default=0)  # derived: embed_dim // num_heads
    mlp_hidden: int = field(init=False, default=0)  # derived: the MLP hidden width the model builds
    grid_size: tuple[int, int] = field(init=False, default=(0, 0))  # derived: patch grid of image_size

    def __post_init__(self) -> None:
        height, width = check_image_options(self)
        for name in ("embed_dim", "num_layers", "num_heads"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value!r}")
        check(height % self.patch_size == 0 and width % self.patch_size == 0,
              f"image_size={self.image_size!r} must be a multiple of patch_size={self.patch_size}")
        check(self.pool in POOLS, f"pool must be one of {', '.join(POOLS)}, got {self.pool!r}")
        check(self.position in VIT_POSITIONS,
              f"position must be one of {', '.join(VIT_POSITIONS)}{did_you_mean(self.position, VIT_POSITIONS)}, "
              f"got {self.position!r}")
        check(self.position != "sincos2d" or self.embed_dim % 4 == 0,
              f"position 'sincos2d' needs embed_dim divisible by 4, got {self.embed_dim}")
        check(self.norm_eps > 0, f"norm_eps must be positive, got {self.norm_eps}")
        check_layer_options(self)
        self.grid_size = (height // self.patch_size, width // self.patch_size)

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens before the patches: 1 (the class token) with ``pool='cls'``, else 0."""
        return 1 if self.pool == "cls" else 0

    @classmethod
    def from_name(cls, name: str, **overrides) -> ViTConfig:
        """A preset by name (see ``VIT_PRESETS``) with fields overridden."""
        return from_preset(cls, VIT_PRESETS, "ViT", name, overrides)


VIT_PRESETS: dict[str, dict] = {
    # 28x28 digits: a 7x7 grid of 4x4 patches
    "vit-mnist-tiny": dict(image_size=28, patch_size=4, in_channels=1, num_classes=10, embed_dim=128, num_layers=6,
                           num_heads=4, mlp_ratio=2.0),
    # the DeiT / timm sizes at 224x224 with 16x16 patches
    "vit-tiny": dict(embed_dim=192, num_layers=12, num_heads=3),
    "vit-small": dict(embed_dim=384, num_layers=12, num_heads=6),
    "vit-base": dict(embed_dim=768, num_layers=12, num_heads=12),
}


class ViT(nn.Module):
    """Patch embedding + positions -> blocks -> final norm -> pooling -> classifier; (B, C_in, H, W) -> (B, K)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.patch_embed = PatchEmbed(c.in_channels, c.embed_dim, c.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim)) if c.pool == "cls" else None
        num_patches = c.grid_size[0] * c.grid_size[1]
        if c.position == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, c.num_prefix_tokens + num_patches, c.embed_dim))
        else:
            self.pos_embed = None
            self.register_buffer("pos_table", sincos_2d(c.grid_size, c.embed_dim)[None], persistent=False)
        self.embed_dropout = Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            create_block(c.norm_placement, c.embed_dim, c.num_heads, hidden_dim=c.mlp_hidden, mlp=c.mlp,
                         norm=c.norm, attention=c.attention, dropout=c.dropout, bias=True, norm_eps=c.norm_eps,
                         attention_dropout=c.attention_dropout,
                         attention_options=attention_options(c, c.num_prefix_tokens + num_patches))
            for _ in range(c.num_layers))
        if not c.qkv_bias:
            for block in self.blocks:
                block.attn.qkv_proj.register_parameter("bias", None)
        # post-norm blocks end in a norm already; pre-norm needs one before the head
        self.final_norm = create_norm(c.norm, c.embed_dim, eps=c.norm_eps) if c.norm_placement == "pre" \
            else nn.Identity()
        self.head = nn.Linear(c.embed_dim, c.num_classes)
        self.apply(init_vision_linear)
        if self.pos_embed is not None:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)

    def positions(self, grid: tuple[int, int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """(1, T, C) learned positions for a (Gh, Gw) grid (class token included; resized bicubically when
        the grid is not the training one), or (1, N, C) sin-cos positions of the patches."""
        if self.pos_embed is None:
            if tuple(grid) == tuple(self.config.grid_size):
                return self.pos_table
            return sincos_2d(grid, self.config.embed_dim).to(device=device, dtype=dtype)[None]
        k = self.config.num_prefix_tokens
        if tuple(grid) == tuple(self.config.grid_size):
            return self.pos_embed
        patches = resample_grid(self.pos_embed[:, k:], self.config.grid_size, grid)  # (1, N', C)
        return torch.cat((self.pos_embed[:, :k], patches), dim=1)

    def forward_features(self, images: Tensor, class_token_only: bool = False) -> Tensor:
        """images (B, C_in, H, W) -> (B, T, C) tokens after the final norm (the class token first, if any).
        ``class_token_only`` (with ``pool='cls'``): the last block computes the class token alone (all tokens
        still serve as its keys and values) -> (B, 1, C), what the classifier reads, for ~1/L less work."""
        x, grid = self.patch_embed(images)  # (B, N, C)
        B = x.shape[0]
        pos = self.positions(grid, x.dtype, x.device)
        if self.cls_token is not None:
            if self.pos_embed is None:
                x = x + pos
                x = torch.cat((self.cls_token.expand(B, -1, -1).to(x.dtype), x), dim=1)  # (B, 1 + N, C)
            else:
                x = torch.cat((self.cls_token.expand(B, -1, -1).to(x.dtype), x), dim=1) + pos  # (B, 1 + N, C)
        else:
            x = x + pos
        x = self.embed_dropout(x)
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            x, _ = block(x, queries=1 if class_token_only and i == last else None)
        return self.final_norm(x)

    def forward_head(self, features: Tensor) -> Tensor:
        """(B, T, C) -> (B, K) logits: the class token's features, or the mean of the patch tokens."""
        pooled = features[:, 0] if self.config.pool == "cls" else features.mean(dim=1)
        return self.head(pooled)

    def forward(self, images: Tensor) -> Tensor:
        """images (B, C_in, H, W) float -> (B, K) logits."""
        return self.forward_head(self.forward_features(images, class_token_only=self.config.pool == "cls"))


MODELS.register("vit")((ViTConfig, ViT))

"""Swin Transformer (Liu et al. 2021): hierarchical vision Transformer with shifted-window attention.

Shape legend: B batch, Gh/Gw patch-grid height/width of a stage, L = Gh * Gw tokens, C width of a stage
(embed_dim * 2^stage), nH heads, D head_dim, M window size, N = M * M tokens per window, nW windows per image,
K num_classes.

images (B, in_channels, H, W) -> patch embedding (+ LayerNorm) -> stages of Swin blocks, each stage but the last
ending in a patch merging (2x2 neighbours concatenated in the order x0 = (0, 0), x1 = (1, 0), x2 = (0, 1),
x3 = (1, 1), LayerNorm, Linear 4C -> 2C) -> final LayerNorm -> mean over tokens -> classifier.

A Swin block is pre-norm (the spine's one body, :func:`tokenloom.nn.block.pre_norm`, with window attention bound
as its attention sublayer): ``x = x + attn(norm1(x)); x = x + mlp(norm2(x))``, where attention runs inside
M x M windows with a learned relative position bias ((2M - 1)^2 x nH table), and every second block of a
stage rolls the map by M // 2 first (shifted windows, with a -100 mask between tokens that were not neighbours
before the roll). Like Hugging Face's ``SwinLayer``: a map whose sides are not multiples of the window is
padded with zeros (after norm1) and cropped after attention; a stage whose smaller side is <= M uses one
window of that side and no shift. (A window smaller than M reads the central rows of the bias table; Hugging
Face cannot run that case.) The patch embedding's and the patch merging's LayerNorms use eps 1e-5, as there;
``norm_eps`` sets the blocks' and the final norm's.

Window attention takes q, k and v as strided views of the fused projection (no copies); an unshifted block
makes one backend call over all B * nW windows with the (1, nH, N, N) position bias broadcast, a shifted block
one call per window position over the batch with that window's bias + shift mask: no (B * nW, nH, N, N) mask
is built (measured faster than folding the windows into the heads, which needs a copy of q, k and v). Where
attention is computed explicitly (CPU training, the ``math`` backend) a shifted block is one call over
(B, nW, nH, N, D) with the mask broadcast.

On a map the windows tile exactly, a stage keeps its tokens in window layout: norms, MLPs and residuals are per
token, so each block needs one gather (from the previous block's layout to its own) where the reference code
rolls, partitions, reverses and rolls back; a single-window stage without shift needs none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..config import check, check_choice
from ..nn import ATTENTION_BACKENDS, MLPS, LayerNorm, MultiHeadAttention, create_mlp
from ..nn.attention import NO_CONTEXT, Context, explicit_training, partition_views
from ..nn.block import has_forward_hooks, pre_norm
from ..nn.dropout import Dropout, DropPath
from ..nn.patch_embed import PatchEmbed
from ..nn.windows import (
    additive_window_mask,
    permute_tokens,
    relative_position_index,
    shifted_window_mask,
    window_order,
    window_partition,
    window_reverse,
)
from .options import check_image_options, from_preset, init_vision_linear
from .registry import MODELS

EMBED_NORM_EPS = 1e-5  # the patch embedding's and the patch merging's LayerNorm (torch's default, as in HF)


@dataclass
class SwinConfig:
    """A Swin Transformer (``model:`` with ``family: swin``): stages of windowed attention with shifted windows and
    patch merging between them."""

    image_size: int | tuple[int, int] = 224  # training image size (H, W); other sizes work too
    patch_size: int = 4  # side of the square patches of the first stage
    in_channels: int = 3  # image channels (1 for MNIST)
    num_classes: int = 1000  # classifier outputs
    embed_dim: int = 96  # width of the first stage; doubles at every patch merging
    depths: list[int] = field(default_factory=lambda: [2, 2, 6, 2])  # Swin blocks per stage
    num_heads: list[int] = field(default_factory=lambda: [3, 6, 12, 24])  # attention heads per stage
    window_size: int = 7  # side M of the attention windows
    mlp_ratio: float = 4.0  # MLP hidden width = int(mlp_ratio * stage width)
    mlp: str = "gelu"  # MLP activation (gelu | gelu_tanh | relu | silu)
    qkv_bias: bool = True  # bias on the query/key/value projection
    dropout: float = 0.0  # dropout after the patch embedding, on attention and MLP outputs
    attention_dropout: float | None = None  # dropout on attention probabilities; None = dropout
    drop_path: float = 0.0  # stochastic depth of the last block, rising linearly from 0 at the first
    norm_eps: float = 1e-5  # epsilon of the blocks' and the final LayerNorm
    attention: str = "sdpa"  # attention backend: sdpa | math
    stage_dims: list[int] = field(init=False, default_factory=list)  # derived: width of each stage
    num_features: int = field(init=False, default=0)  # derived: width of the last stage (the classifier's input)

    def __post_init__(self) -> None:
        check_image_options(self)
        self.depths, self.num_heads = list(self.depths), list(self.num_heads)
        for name in ("embed_dim", "window_size"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value!r}")
        check(len(self.depths) >= 1 and all(d >= 1 for d in self.depths),
              f"depths must be a non-empty list of positive integers, got {self.depths!r}")
        check(len(self.num_heads) == len(self.depths),
              f"num_heads={self.num_heads!r} must give one head count per stage (depths={self.depths!r})")
        self.stage_dims = [self.embed_dim * 2 ** i for i in range(len(self.depths))]
        for i, (dim, heads) in enumerate(zip(self.stage_dims, self.num_heads, strict=True)):
            check(heads >= 1 and dim % heads == 0,
                  f"num_heads[{i}]={heads} must divide stage {i}'s width {dim} (embed_dim * 2^{i})")
        self.num_features = self.stage_dims[-1]
        check(self.mlp_ratio > 0, f"mlp_ratio must be positive, got {self.mlp_ratio}")
        check(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        check(self.attention_dropout is None or 0.0 <= self.attention_dropout < 1.0,
              f"attention_dropout must be in [0, 1), got {self.attention_dropout}")
        check(0.0 <= self.drop_path < 1.0, f"drop_path must be in [0, 1), got {self.drop_path}")
        check(self.norm_eps > 0, f"norm_eps must be positive, got {self.norm_eps}")
        check_choice("mlp", self.mlp, MLPS)
        check_choice("attention", self.attention, ATTENTION_BACKENDS)
        check(self.attention in ("sdpa", "math"), f"attention {self.attention!r} cannot add Swin's relative position "
              "bias inside its windows (and windows of 49 tokens gain nothing from linear attention); use sdpa or math")

    @classmethod
    def from_name(cls, name: str, **overrides) -> SwinConfig:
        """A preset by name (see ``SWIN_PRESETS``) with fields overridden."""
        return from_preset(cls, SWIN_PRESETS, "Swin", name, overrides)


SWIN_PRESETS: dict[str, dict] = {
    # 28x28 digits: a 14x14 grid of 2x2 patches, one 7x7-window stage, merged to 7x7 (one window, no shift)
    "swin-mnist-tiny": dict(image_size=28, patch_size=2, in_channels=1, num_classes=10, embed_dim=64,
                            depths=[2, 2], num_heads=[2, 4], window_size=7, mlp_ratio=2.0),
    "swin-tiny": dict(image_size=224, patch_size=4, embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                      window_size=7, drop_path=0.2),
    "swin-small": dict(image_size=224, patch_size=4, embed_dim=96, depths=[2, 2, 18, 2], num_heads=[3, 6, 12, 24],
                       window_size=7, drop_path=0.3),
}


def stage_window(grid: tuple[int, int], window: int) -> tuple[int, int]:
    """(window, shift) a stage uses on a (Gh, Gw) map: (M, M // 2), or (min(Gh, Gw), 0) when the smaller side
    is <= M (Hugging Face's and the reference code's rule)."""
    side = min(grid)
    return (side, 0) if side <= window else (window, window // 2)


class SwinWindowAttention(MultiHeadAttention):
    """Multi-head self-attention inside windows, with a learned relative position bias table ((2M - 1)^2, nH).
    The projections and the backend are :class:`MultiHeadAttention`'s."""

    def __init__(self, dim: int, num_heads: int, window: int, *, qkv_bias: bool = True, dropout: float = 0.0,
                 backend: str = "sdpa") -> None:
        super().__init__(dim, num_heads, bias=True, dropout=dropout, backend=backend)
        if not qkv_bias:
            self.qkv_proj.register_parameter("bias", None)
        self.window = window
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, num_heads))
        self.register_buffer("relative_position_index", relative_position_index(window), persistent=False)

    def position_bias(self, window: int) -> Tensor:
        """(nH, N, N) bias of an M' x M' window, M' <= M (M' < M reads the table's central rows)."""
        index = self.relative_position_index if window == self.window else \
            relative_position_index(window, self.window, device=self.relative_position_index.device)
        N = window * window
        return self.relative_position_bias_table[index.view(-1)].view(N, N, -1).permute(2, 0, 1)  # (nH, N, N)

    def forward(self, windows: Tensor, bias: Tensor, shift_mask: Tensor | None = None,
                need_weights: bool = False, residual: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """windows (B, nW, N, C), position bias (nH, N, N), additive shift mask (nW, 1, N, N) or None ->
        (B, nW, N, C) (+ ``residual``, fused into the output projection in eval-mode inference), and the
        probabilities (B, nW, nH, N, N) when ``need_weights`` and the backend gives them.

        q, k and v are strided views of the fused projection (no copies). Without a shift mask one backend call
        covers all B * nW windows with the bias broadcast. With one, where attention is computed explicitly
        (the ``math`` backend, CPU training) one call over (B, nW, nH, N, D) broadcasts the (nW, nH, N, N)
        bias + mask; elsewhere (the fused kernel) each window position is a call over the batch with its own
        (1, nH, N, N) mask, so no (B * nW, nH, N, N) mask is ever built."""
        B, nW, N, C = windows.shape
        H, D = self.num_heads, self.head_dim
        qkv = self.qkv_proj(windows).view(B, nW, N, 3, H, D)
        dropout = self.dropout if self.training else 0.0
        if shift_mask is None:
            q, k, v = partition_views(  # each (B*nW, nH, N, D)
                qkv, lambda t: t.view(B * nW, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0))
            out, weights = self.backend(q, k, v, bias[None].to(q.dtype), False, dropout, need_weights)
            out = out.transpose(1, 2).reshape(B, nW, N, C)  # (B*nW, nH, N, D) -> (B, nW, N, C)
            weights = weights.view(B, nW, H, N, N) if weights is not None else None
            return self.project(out, residual), weights
        mask = (bias + shift_mask).to(qkv.dtype)  # (nW, nH, N, N)
        if self.backend_name == "math" or explicit_training(qkv, N):
            q, k, v = partition_views(qkv, lambda t: t.permute(3, 0, 1, 4, 2, 5).unbind(0))  # each (B, nW, nH, N, D)
            out, weights = self.backend(q, k, v, mask, False, dropout, need_weights)
            return self.project(out.transpose(2, 3).reshape(B, nW, N, C), residual), weights
        outs, probs = [], []
        for w in range(nW):
            q, k, v = qkv[:, w].permute(2, 0, 3, 1, 4).unbind(0)  # each (B, nH, N, D)
            out, p = self.backend(q, k, v, mask[w:w + 1], False, dropout, need_weights)
            outs.append(out.transpose(1, 2))  # (B, N, nH, D)
            probs.append(p)
        out = torch.stack(outs, dim=1).reshape(B, nW, N, C)
        weights = torch.stack(probs, dim=1) if probs[0] is not None else None
        return self.project(out, residual), weights


class SwinBlock(nn.Module):
    """Pre-norm window attention + MLP on a (B, L, C) token map of a (Gh, Gw) grid; shifted or not."""

    def __init__(self, dim: int, num_heads: int, window: int, *, shifted: bool, mlp_hidden: int, mlp: str = "gelu",
                 qkv_bias: bool = True, dropout: float = 0.0, attention_dropout: float | None = None,
                 drop_path: float = 0.0, norm_eps: float = 1e-5, attention: str = "sdpa") -> None:
        super().__init__()
        self.shifted = shifted
        self.norm1 = LayerNorm(dim, eps=norm_eps)
        self.attn = SwinWindowAttention(dim, num_heads, window, qkv_bias=qkv_bias, backend=attention,
                                        dropout=dropout if attention_dropout is None else attention_dropout)
        self.norm2 = LayerNorm(dim, eps=norm_eps)
        self.mlp = create_mlp(mlp, dim, mlp_hidden, dropout=dropout)
        self.resid_dropout = Dropout(dropout)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: Tensor, grid: tuple[int, int], window: int, shift: int,
                shift_mask: Tensor | None) -> Tensor:
        """x (B, L, C) on a (Gh, Gw) grid -> (B, L, C). ``window``/``shift`` come from :func:`stage_window`
        (``shift`` 0 for an unshifted block); ``shift_mask`` (nW, 1, N, N) is the additive shift mask or None.
        (A stage whose map is a multiple of the window runs its blocks in the window layout instead:
        :meth:`forward_windows`.)"""
        B, L, C = x.shape
        Gh, Gw = grid

        def attn(h: Tensor, ctx: Context, residual: Tensor) -> Tensor:
            h = h.view(B, Gh, Gw, C)
            pad_b, pad_r = -Gh % window, -Gw % window
            if pad_b or pad_r:
                h = F.pad(h, (0, 0, 0, pad_r, 0, pad_b))  # zeros right and bottom: (B, Hp, Wp, C)
            Hp, Wp = Gh + pad_b, Gw + pad_r
            if shift:
                h = torch.roll(h, shifts=(-shift, -shift), dims=(1, 2))
            nW, N = (Hp // window) * (Wp // window), window * window
            windows = window_partition(h, window).view(B, nW, N, C)  # (B, nW, N, C)
            out, _ = self.attn(windows, self.attn.position_bias(window), shift_mask)  # (B, nW, N, C)
            h = window_reverse(out, window, Hp, Wp)  # (B, Hp, Wp, C)
            if shift:
                h = torch.roll(h, shifts=(shift, shift), dims=(1, 2))
            if pad_b or pad_r:
                h = h[:, :Gh, :Gw]
            return residual + self.drop_path(self.resid_dropout(h.reshape(B, L, C)))

        return pre_norm(x, NO_CONTEXT, attn, None, self._mlp(fused=False), self.norm1, None, self.norm2)

    def forward_windows(self, x: Tensor, window: int, shift_mask: Tensor | None) -> Tensor:
        """The same block on tokens already in its window layout, x (B, nW, N, C) -> (B, nW, N, C): norms, MLP
        and residuals act per token, so only attention needs the windows, and no roll / partition / reverse
        copies are made. In eval mode the residual adds are fused into the output projections."""
        fused = not self.training and not has_forward_hooks(self)
        bias = self.attn.position_bias(window)

        def attn(h: Tensor, ctx: Context, residual: Tensor) -> Tensor:
            if fused:
                return self.attn(h, bias, shift_mask, residual=residual)[0]
            return residual + self.drop_path(self.resid_dropout(self.attn(h, bias, shift_mask)[0]))

        return pre_norm(x, NO_CONTEXT, attn, None, self._mlp(fused), self.norm1, None, self.norm2)

    def _mlp(self, fused: bool):
        """The MLP sublayer ``(h, residual) -> residual + mlp(h)`` (fused, or through drop-path)."""
        if fused:
            return lambda h, residual: self.mlp.add_to(residual, h)
        return lambda h, residual: residual + self.drop_path(self.mlp(h))


class PatchMerging(nn.Module):
    """(B, Gh * Gw, C) -> (B, ceil(Gh/2) * ceil(Gw/2), 2C): 2x2 neighbours concatenated (x0, x1, x2, x3 =
    offsets (0, 0), (1, 0), (0, 1), (1, 1) as (row, column)), LayerNorm, Linear without bias. Odd sides are
    padded with zeros first."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = LayerNorm(4 * dim, eps=EMBED_NORM_EPS)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: Tensor, grid: tuple[int, int]) -> tuple[Tensor, tuple[int, int]]:
        B, L, C = x.shape
        Gh, Gw = grid
        x = x.view(B, Gh, Gw, C)
        if Gh % 2 or Gw % 2:
            x = F.pad(x, (0, 0, 0, Gw % 2, 0, Gh % 2))
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        new_grid = (x.shape[1], x.shape[2])
        x = x.view(B, new_grid[0] * new_grid[1], 4 * C)  # (B, L / 4, 4C)
        return self.reduction(self.norm(x)), new_grid


class SwinStage(nn.Module):
    """Swin blocks alternating unshifted / shifted windows, then (all stages but the last) a patch merging."""

    def __init__(self, dim: int, depth: int, num_heads: int, window: int, drop_paths: list[float],
                 downsample: bool, config: SwinConfig) -> None:
        super().__init__()
        c = config
        self.window = window
        self.blocks = nn.ModuleList(
            SwinBlock(dim, num_heads, window, shifted=i % 2 == 1, mlp_hidden=int(c.mlp_ratio * dim), mlp=c.mlp,
                      qkv_bias=c.qkv_bias, dropout=c.dropout, attention_dropout=c.attention_dropout,
                      drop_path=drop_paths[i], norm_eps=c.norm_eps, attention=c.attention)
            for i in range(depth))
        self.downsample = PatchMerging(dim) if downsample else None

    def forward(self, x: Tensor, grid: tuple[int, int]) -> tuple[Tensor, tuple[int, int]]:
        """x (B, L, C) on ``grid`` -> the stage's output and its grid (halved after a patch merging)."""
        window, shift = stage_window(grid, self.window)
        shift_mask = None
        Hp, Wp = -(-grid[0] // window) * window, -(-grid[1] // window) * window
        if shift and len(self.blocks) > 1:  # one mask for every shifted block of the stage
            allowed = shifted_window_mask(Hp, Wp, window, shift, device=x.device)  # (nW, N, N)
            dtype = self.blocks[0].attn.relative_position_bias_table.dtype
            shift_mask = additive_window_mask(allowed, dtype)[:, None]  # (nW, 1, N, N)
        if (Hp, Wp) == tuple(grid):
            x = self._blocks_in_windows(x, grid, window, shift, shift_mask)
        else:  # padded windows: each block pads, partitions and crops
            for block in self.blocks:
                x = block(x, grid, window, shift if block.shifted else 0, shift_mask if block.shifted else None)
        if self.downsample is not None:
            x, grid = self.downsample(x, grid)
        return x, grid

    def _blocks_in_windows(self, x: Tensor, grid: tuple[int, int], window: int, shift: int,
                           shift_mask: Tensor | None) -> Tensor:
        """The blocks on a map that the windows tile exactly: the tokens are gathered into the first block's
        window layout, from one block's layout into the next's (one gather, where the reference rolls,
        partitions, reverses and rolls back), and back to row-major order at the end."""
        B, L, C = x.shape
        N = window * window
        plain = torch.arange(L, device=x.device)
        orders = {s: window_order(*grid, window, s, device=x.device) for s in {0, shift}}
        current = plain  # x[:, j] holds token current[j]
        for block in self.blocks:
            order = orders[shift if block.shifted else 0]  # the block's layout: slot j holds token order[j]
            if not torch.equal(order, current):
                x = permute_tokens(x, torch.argsort(current)[order])
                current = order
            x = block.forward_windows(x.view(B, L // N, N, C), window,
                                      shift_mask if block.shifted else None).view(B, L, C)
        if not torch.equal(current, plain):
            x = permute_tokens(x, torch.argsort(current))
        return x


class Swin(nn.Module):
    """Patch embedding -> stages -> final norm -> mean pooling -> classifier; (B, C_in, H, W) -> (B, K)."""

    def __init__(self, config: SwinConfig) -> None:
        super().__init__()
        self.config = c = config
        self.patch_embed = PatchEmbed(c.in_channels, c.embed_dim, c.patch_size, pad=True)
        self.embed_norm = LayerNorm(c.embed_dim, eps=EMBED_NORM_EPS)
        self.embed_dropout = Dropout(c.dropout)
        total = sum(c.depths)
        rates = [c.drop_path * i / max(total - 1, 1) for i in range(total)]  # linear, as in HF and timm
        starts = [sum(c.depths[:i]) for i in range(len(c.depths))]
        self.stages = nn.ModuleList(
            SwinStage(dim, depth, heads, c.window_size, rates[start:start + depth], i < len(c.depths) - 1, c)
            for i, (dim, depth, heads, start) in enumerate(zip(c.stage_dims, c.depths, c.num_heads, starts,
                                                                strict=True)))
        self.final_norm = LayerNorm(c.num_features, eps=c.norm_eps)
        self.head = nn.Linear(c.num_features, c.num_classes)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        init_vision_linear(module)
        if isinstance(module, SwinWindowAttention):
            nn.init.trunc_normal_(module.relative_position_bias_table, std=0.02)

    def forward_features(self, images: Tensor) -> Tensor:
        """images (B, C_in, H, W) -> (B, L, C) tokens of the last stage after the final norm."""
        x, grid = self.patch_embed(images)  # (B, Gh*Gw, embed_dim)
        x = self.embed_dropout(self.embed_norm(x))
        for stage in self.stages:
            x, grid = stage(x, grid)
        return self.final_norm(x)

    def forward_head(self, features: Tensor) -> Tensor:
        """(B, L, C) -> (B, K) logits: mean over the tokens, then the classifier."""
        return self.head(features.mean(dim=1))

    def forward(self, images: Tensor) -> Tensor:
        """images (B, C_in, H, W) float -> (B, K) logits."""
        return self.forward_head(self.forward_features(images))


MODELS.register("swin")((SwinConfig, Swin))

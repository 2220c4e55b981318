"""Images to patch tokens, and position tables over a 2-D patch grid.

Shape legend: B batch, C image channels, H/W image height/width, P patch size, Gh/Gw patch grid height/width,
N = Gh * Gw patches, D embed_dim.

* :class:`PatchEmbed`: a Conv2d with kernel = stride = P, (B, C, H, W) -> (B, N, D) tokens in row-major grid
  order, and the grid size. With ``pad=True`` (Swin) an image whose sides are not multiples of P is padded with
  zeros on the right and bottom first; without it (ViT) such an image is refused.
* :func:`patchify` / :func:`unpatchify`: the same cut as plain reshapes, (B, C, H, W) <-> (B, N, P*P*C).
* :func:`sincos_2d`: fixed 2-D sin-cos positions for any grid (MAE); :func:`resample_grid`: learned grid
  positions resized bicubically to another grid (Hugging Face ``interpolate_pos_encoding``, timm
  ``resample_abs_pos_embed``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..errors import DataError


def to_2tuple(value: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    """``7`` -> ``(7, 7)``; a pair stays a pair."""
    if isinstance(value, int):
        return (value, value)
    h, w = value
    return (int(h), int(w))


def check_images(images: Tensor, in_channels: int) -> None:
    """Raise a one-line :class:`DataError` unless ``images`` is a float (B, in_channels, H, W) batch."""
    if images.ndim != 4:
        raise DataError(f"images must be a (batch, channels, height, width) tensor, got shape {tuple(images.shape)}")
    if images.shape[1] != in_channels:
        raise DataError(f"images have {images.shape[1]} channel(s), the model expects in_channels={in_channels} "
                        f"(shape {tuple(images.shape)})")
    if not images.is_floating_point():
        raise DataError(f"images must be floating point (scaled pixel values), got {images.dtype}")


class PatchEmbed(nn.Module):
    """(B, C, H, W) images -> (B, N, D) patch tokens and the (Gh, Gw) grid; one Conv2d, kernel = stride = P."""

    def __init__(self, in_channels: int, embed_dim: int, patch_size: int, *, pad: bool = False,
                 bias: bool = True) -> None:
        super().__init__()
        self.in_channels, self.patch_size, self.pad = in_channels, patch_size, pad
        self.proj = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def grid_size(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid of an H x W image (rounded up when padding, else H and W must be multiples of P)."""
        P = self.patch_size
        if self.pad:
            return (-(-height // P), -(-width // P))
        if height % P or width % P:
            raise DataError(f"image size {height}x{width} is not a multiple of patch_size={P}; resize or crop "
                            f"the images, or use a model that pads (swin)")
        return (height // P, width // P)

    def forward(self, images: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """images (B, C, H, W) -> tokens (B, N, D), (Gh, Gw)."""
        check_images(images, self.in_channels)
        H, W = images.shape[-2:]
        grid = self.grid_size(H, W)
        P = self.patch_size
        if images.dtype != self.proj.weight.dtype and not torch.is_autocast_enabled(images.device.type):
            images = images.to(self.proj.weight.dtype)  # e.g. float32 pixels into a bfloat16 model
        if self.pad and (H % P or W % P):
            images = F.pad(images, (0, grid[1] * P - W, 0, grid[0] * P - H))  # zeros right and bottom
        x = self.proj(images)  # (B, D, Gh, Gw)
        return x.flatten(2).transpose(1, 2), grid  # (B, N, D)


def patchify(images: Tensor, patch_size: int) -> Tensor:
    """(B, C, H, W) -> (B, N, P*P*C): each patch's pixels in (row, column, channel) order, patches row-major.
    H and W must be multiples of P."""
    B, C, H, W = images.shape
    P = patch_size
    x = images.reshape(B, C, H // P, P, W // P, P)  # (B, C, Gh, P, Gw, P)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(B, (H // P) * (W // P), P * P * C)


def unpatchify(patches: Tensor, patch_size: int, grid: tuple[int, int]) -> Tensor:
    """The inverse of :func:`patchify`: (B, N, P*P*C) and the (Gh, Gw) grid -> (B, C, Gh*P, Gw*P)."""
    B, N, K = patches.shape
    P = patch_size
    Gh, Gw = grid
    C = K // (P * P)
    x = patches.reshape(B, Gh, Gw, P, P, C)  # (B, Gh, Gw, P, P, C)
    return x.permute(0, 5, 1, 3, 2, 4).reshape(B, C, Gh * P, Gw * P)


def sincos_2d(grid: tuple[int, int], dim: int, base: float = 10000.0) -> Tensor:
    """(Gh * Gw, dim) fixed positions for a row-major patch grid (MAE's ``get_2d_sincos_pos_embed``): the first
    half of the features encodes the column, the second half the row, each as [sin | cos] of
    position * base^(-i / (dim/4)); computed in float64, returned as float32. ``dim`` must be a multiple of 4."""
    if dim % 4:
        raise ValueError(f"2-D sin-cos positions need a dim divisible by 4, got {dim}")
    Gh, Gw = grid
    omega = 1.0 / base ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))  # (dim/4,)
    rows = torch.arange(Gh, dtype=torch.float64).repeat_interleave(Gw)  # (N,): row of each patch
    cols = torch.arange(Gw, dtype=torch.float64).repeat(Gh)  # (N,): column of each patch

    def one_axis(pos: Tensor) -> Tensor:
        angles = pos[:, None] * omega[None]  # (N, dim/4)
        return torch.cat((angles.sin(), angles.cos()), dim=1)  # (N, dim/2)

    return torch.cat((one_axis(cols), one_axis(rows)), dim=1).float()


def resample_grid(positions: Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int]) -> Tensor:
    """Learned grid positions (..., Gh*Gw, D) for ``old_grid`` -> (..., Gh'*Gw', D) for ``new_grid``, by bicubic
    interpolation (align_corners=False, no antialiasing: Hugging Face's ``interpolate_pos_encoding``). The
    same grid returns ``positions`` itself."""
    if tuple(old_grid) == tuple(new_grid):
        return positions
    *lead, N, D = positions.shape
    x = positions.reshape(1, *old_grid, D).permute(0, 3, 1, 2)  # (1, D, Gh, Gw)
    x = F.interpolate(x, size=tuple(new_grid), mode="bicubic", align_corners=False)
    return x.permute(0, 2, 3, 1).reshape(*lead, new_grid[0] * new_grid[1], D)  # (..., N', D)

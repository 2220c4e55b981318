"""Batched image augmentations written with torch ops only, driven by a ``torch.Generator``.

Every function takes float images (B, C, H, W) with pixels in [0, 1] (before normalisation; 0 is the
background that padding and erasing fill in) and draws all its randomness from ``generator``, so a run
that saves and restores the generator's state gets the same augmented batches. A component at zero
strength is skipped and draws nothing: it is the identity.

* :func:`random_crop` -- zero-pad each side by ``padding`` pixels, cut a random H x W window per image.
* :func:`random_hflip` -- mirror half of the images.
* :func:`random_affine` -- small random rotation, translation and scale (``F.affine_grid`` +
  ``F.grid_sample``, bilinear, zeros outside).
* :func:`random_erasing` -- with probability p, blank one random rectangle per image (Zhong et al. 2017).
* :func:`mix_batch` -- mixup (Zhang et al. 2017) or cutmix (Yun et al. 2019) over the batch, paired with
  the batch reversed; returns soft targets (B, K) that sum to 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from ..config import check


@dataclass
class AugmentConfig:
    """Training-time augmentation (``data.augment``); every default is off."""

    crop_padding: int = 0  # random crop after zero-padding each side by this many pixels
    hflip: bool = False  # mirror half of the images (not for digits or text)
    rotation: float = 0.0  # max rotation in degrees: uniform in [-rotation, rotation]
    translate: float = 0.0  # max shift as a fraction of the width / height
    scale: float = 0.0  # max zoom change: scale uniform in [1 - scale, 1 + scale]
    erasing: float = 0.0  # probability of erasing one rectangle per image
    erasing_area: list[float] = field(default_factory=lambda: [0.02, 0.2])  # its area, fraction of the image
    mixup_alpha: float = 0.0  # mixup lambda ~ Beta(alpha, alpha); 0 = off
    cutmix_alpha: float = 0.0  # cutmix lambda ~ Beta(alpha, alpha); 0 = off (both on: each batch picks one)
    mix_prob: float = 1.0  # probability that a batch is mixed at all

    def __post_init__(self) -> None:
        check(self.crop_padding >= 0, f"data.augment.crop_padding must be >= 0, got {self.crop_padding}")
        check(0 <= self.rotation <= 180, f"data.augment.rotation must be in [0, 180] degrees, got {self.rotation}")
        check(0 <= self.translate < 1, f"data.augment.translate must be in [0, 1), got {self.translate}")
        check(0 <= self.scale < 1, f"data.augment.scale must be in [0, 1), got {self.scale}")
        check(0 <= self.erasing <= 1, f"data.augment.erasing must be a probability, got {self.erasing}")
        check(len(self.erasing_area) == 2 and 0 < self.erasing_area[0] <= self.erasing_area[1] < 1,
              f"data.augment.erasing_area must be [min, max] with 0 < min <= max < 1, got {self.erasing_area}")
        for name in ("mixup_alpha", "cutmix_alpha"):
            check(getattr(self, name) >= 0, f"data.augment.{name} must be >= 0, got {getattr(self, name)}")
        check(0 <= self.mix_prob <= 1, f"data.augment.mix_prob must be a probability, got {self.mix_prob}")

    @property
    def mixes(self) -> bool:
        return (self.mixup_alpha > 0 or self.cutmix_alpha > 0) and self.mix_prob > 0


def _uniform(n: int, low: float, high: float, generator: torch.Generator) -> Tensor:
    return low + (high - low) * torch.rand(n, generator=generator, dtype=torch.float64)


def random_crop(x: Tensor, padding: int, generator: torch.Generator) -> Tensor:
    """Zero-pad by ``padding`` on each side, then take a random H x W window per image. (B, C, H, W)."""
    if padding <= 0:
        return x
    B, C, H, W = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    dy = torch.randint(0, 2 * padding + 1, (B,), generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (B,), generator=generator)
    rows = (dy[:, None] + torch.arange(H))[:, :, None].expand(B, H, W)  # (B, H, W)
    cols = (dx[:, None] + torch.arange(W))[:, None, :].expand(B, H, W)
    index = (rows * (W + 2 * padding) + cols).view(B, 1, H * W).expand(B, C, H * W).to(x.device)
    return padded.flatten(2).gather(2, index).view(B, C, H, W)


def random_hflip(x: Tensor, generator: torch.Generator, p: float = 0.5) -> Tensor:
    """Mirror each image left-right with probability ``p``. (B, C, H, W)."""
    flip = (torch.rand(x.shape[0], generator=generator) < p).to(x.device).view(-1, 1, 1, 1)
    return torch.where(flip, x.flip(-1), x)


def random_affine(x: Tensor, generator: torch.Generator, *, rotation: float = 0.0, translate: float = 0.0,
                  scale: float = 0.0) -> Tensor:
    """Rotate by up to ``rotation`` degrees, shift by up to ``translate`` of the size and zoom by up to
    ``scale`` (each uniform, per image), sampling bilinearly with zeros outside. (B, C, H, W)."""
    if rotation == 0 and translate == 0 and scale == 0:
        return x
    B = x.shape[0]
    angle = _uniform(B, -rotation, rotation, generator) * (math.pi / 180)
    zoom = _uniform(B, 1 - scale, 1 + scale, generator)
    shift = _uniform(2 * B, -translate, translate, generator).view(B, 2) * 2  # normalised coords span 2
    cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom  # the grid maps output -> input: inverse zoom
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta.to(x.device, torch.float32), list(x.shape), align_corners=False)  # (B, H, W, 2)
    return F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="zeros", align_corners=False).to(x.dtype)


def _boxes(B: int, H: int, W: int, area: Tensor, aspect: Tensor, generator: torch.Generator) -> tuple[Tensor, ...]:
    """Per image a box of ``area`` (fraction) and ``aspect`` (h / w) at a random centre, clipped: its
    row and column masks (B, H), (B, W)."""
    h = (area * H * W * aspect).sqrt().round().clamp(1, H).long()
    w = (area * H * W / aspect).sqrt().round().clamp(1, W).long()
    cy = (torch.rand(B, generator=generator) * H).long()
    cx = (torch.rand(B, generator=generator) * W).long()
    y0, x0 = (cy - h // 2).clamp(0, H), (cx - w // 2).clamp(0, W)
    y1, x1 = (y0 + h).clamp(0, H), (x0 + w).clamp(0, W)
    rows = (torch.arange(H) >= y0[:, None]) & (torch.arange(H) < y1[:, None])
    cols = (torch.arange(W) >= x0[:, None]) & (torch.arange(W) < x1[:, None])
    return rows, cols


def random_erasing(x: Tensor, p: float, generator: torch.Generator, area: tuple[float, float] = (0.02, 0.2),
                   value: float = 0.0) -> Tensor:
    """With probability ``p`` per image, set one random rectangle (area fraction in ``area``, aspect ratio
    log-uniform in [0.3, 3.3]) to ``value``. (B, C, H, W)."""
    if p <= 0:
        return x
    B, _, H, W = x.shape
    apply = torch.rand(B, generator=generator) < p
    frac = _uniform(B, area[0], area[1], generator)
    aspect = _uniform(B, math.log(0.3), math.log(3.3), generator).exp()
    rows, cols = _boxes(B, H, W, frac, aspect, generator)
    mask = (rows[:, :, None] & cols[:, None, :] & apply[:, None, None]).to(x.device)  # (B, H, W)
    return x.masked_fill(mask[:, None], value)


def augment(x: Tensor, config: AugmentConfig, generator: torch.Generator) -> Tensor:
    """Crop, flip, affine jitter, erasing (in that order; the disabled ones skipped). (B, C, H, W)."""
    x = random_crop(x, config.crop_padding, generator)
    if config.hflip:
        x = random_hflip(x, generator)
    x = random_affine(x, generator, rotation=config.rotation, translate=config.translate, scale=config.scale)
    return random_erasing(x, config.erasing, generator, tuple(config.erasing_area))


def _beta(alpha: float, generator: torch.Generator) -> float:
    """One Beta(alpha, alpha) draw, seeded from ``generator`` (torch's Beta takes no generator)."""
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator))
    return float(np.random.default_rng(seed).beta(alpha, alpha))


def mix_batch(x: Tensor, labels: Tensor, num_classes: int, config: AugmentConfig,
              generator: torch.Generator) -> tuple[Tensor, Tensor | None]:
    """Mixup or cutmix of the batch with itself reversed: (images (B, C, H, W), soft targets (B, K) summing
    to 1), or (x, None) when this batch is not mixed (mixing off, or skipped with ``1 - mix_prob``)."""
    if not config.mixes:
        return x, None
    if config.mix_prob < 1 and float(torch.rand(1, generator=generator)) >= config.mix_prob:
        return x, None
    use_cutmix = config.cutmix_alpha > 0 and (
        config.mixup_alpha == 0 or float(torch.rand(1, generator=generator)) < 0.5)
    lam = _beta(config.cutmix_alpha if use_cutmix else config.mixup_alpha, generator)
    other = x.flip(0)
    if use_cutmix:
        B, _, H, W = x.shape
        rows, cols = _boxes(1, H, W, torch.tensor([1 - lam], dtype=torch.float64),
                            torch.ones(1, dtype=torch.float64), generator)
        box = (rows[0, :, None] & cols[0, None, :]).to(x.device)  # (H, W)
        x = torch.where(box, other, x)
        lam = 1 - float(box.sum()) / (H * W)  # the area actually pasted
    else:
        x = lam * x + (1 - lam) * other
    onehot = F.one_hot(labels, num_classes).to(torch.float32)
    return x, lam * onehot + (1 - lam) * onehot.flip(0)

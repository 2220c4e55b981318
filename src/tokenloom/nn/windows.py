"""Window attention helpers (Swin): partition a feature map into windows and back, the shifted-window mask,
the relative position index.

Shape legend: B batch, H/W feature-map height/width (multiples of the window), C channels, M window size,
N = M * M tokens per window, nW = (H / M) * (W / M) windows per image.

All are pure functions of their arguments (timm's ``window_partition`` style); they match the reference Swin
code and Hugging Face's ``SwinLayer`` operation for operation.
"""

from __future__ import annotations

import torch
from torch import Tensor


def window_partition(x: Tensor, window: int) -> Tensor:
    """(B, H, W, C) -> (B * nW, N, C): non-overlapping M x M windows, row-major over the windows of each image
    (image-major over the batch), tokens row-major inside a window."""
    B, H, W, C = x.shape
    x = x.reshape(B, H // window, window, W // window, window, C)  # (B, H/M, M, W/M, M, C)
    return x.transpose(2, 3).reshape(B * (H // window) * (W // window), window * window, C)


def window_reverse(windows: Tensor, window: int, height: int, width: int) -> Tensor:
    """The inverse of :func:`window_partition`: (B * nW, N, C) (or (B * nW, M, M, C)) -> (B, H, W, C)."""
    C = windows.shape[-1]
    x = windows.reshape(-1, height // window, width // window, window, window, C)  # (B, H/M, W/M, M, M, C)
    return x.transpose(2, 3).reshape(-1, height, width, C)


def window_order(height: int, width: int, window: int, shift: int = 0,
                 device: torch.device | str | None = None) -> Tensor:
    """(H * W,) long: for each slot of the window layout (windows row-major, tokens row-major inside), the
    row-major index of its token on the (H, W) map, after a roll by ``-shift`` (a shifted block's layout):
    ``x[:, window_order(...)]`` == ``window_partition(roll(x), window)`` flattened over the windows."""
    index = torch.arange(height * width, device=device).view(1, height, width, 1)
    if shift:
        index = torch.roll(index, shifts=(-shift, -shift), dims=(1, 2))
    return window_partition(index, window).reshape(-1)


class _PermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(1, index)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(1, inverse), None, None


def permute_tokens(x: Tensor, index: Tensor) -> Tensor:
    """``x[:, index]`` for a permutation ``index`` of dim 1 of x (B, L, ...), whose gradient is the inverse
    permutation's gather (not a scatter-add)."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x.index_select(1, index)
    return _PermuteTokens.apply(x, index, torch.argsort(index))


def shift_regions(height: int, width: int, window: int, shift: int, device: torch.device | str | None = None) -> Tensor:
    """(H, W) region labels of a feature map rolled by ``-shift`` (the reference Swin's ``img_mask``): each axis
    is cut into [0, L - M), [L - M, L - shift), [L - shift, L) -> 0, 1, 2, and a position's label is
    3 * row region + column region. Tokens of one window may attend to each other only within a label."""
    def axis(length: int) -> Tensor:
        idx = torch.arange(length, device=device)
        return (idx >= length - window).long() + (idx >= length - shift).long()

    return axis(height)[:, None] * 3 + axis(width)[None, :]


def shifted_window_mask(height: int, width: int, window: int, shift: int,
                        device: torch.device | str | None = None) -> Tensor | None:
    """The shifted-window attention mask as booleans (nW, N, N): True where query i and key j of a window of
    the rolled (H, W) map lie in the same region (may attend). None when ``shift`` is 0 (no mask needed).

    Swin adds -100 to the scores of the False pairs (:func:`additive_window_mask`); the reference code builds
    exactly these pairs from :func:`shift_regions`."""
    if shift <= 0:
        return None
    labels = shift_regions(height, width, window, shift, device)  # (H, W)
    windows = window_partition(labels[None, :, :, None], window).squeeze(-1)  # (nW, N)
    return windows[:, :, None] == windows[:, None, :]  # (nW, N, N)


def additive_window_mask(allowed: Tensor, dtype: torch.dtype, value: float = -100.0) -> Tensor:
    """A boolean window mask -> 0 where allowed, ``value`` elsewhere (Swin's -100, not -inf: every row keeps
    its own token, and Hugging Face and the reference code use -100)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, value)


def relative_position_index(window: int, table_window: int | None = None, device: torch.device | str | None = None
                            ) -> Tensor:
    """(N, N) long: row of the relative position bias table ((2T - 1)^2 rows, T = ``table_window``, default M)
    for query i and key j of an M x M window: (dy + T - 1) * (2T - 1) + (dx + T - 1) with (dy, dx) = the
    offset of i from j. With M = T this is the reference Swin's ``relative_position_index``; a smaller window
    (a stage whose resolution is below the window) reads the table's central rows."""
    T = window if table_window is None else table_window
    coords = torch.stack(torch.meshgrid(torch.arange(window, device=device), torch.arange(window, device=device),
                                        indexing="ij")).flatten(1)  # (2, N): (row, column) of each token
    rel = coords[:, :, None] - coords[:, None, :] + (T - 1)  # (2, N, N), shifted to start at 0
    return rel[0] * (2 * T - 1) + rel[1]

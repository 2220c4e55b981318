"""PNG plots of attention and training (matplotlib with the file-only Agg backend, imported when drawing; a
missing matplotlib is a one-line :class:`~tokenloom.errors.ConfigError` naming the ``viz`` extra).

Every function takes tensors / lists already on the CPU, writes ``path`` and returns it.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import Tensor

from ..errors import ConfigError
from ..metric_scope import scoped_name

MAX_LABELS = 48  # token labels drawn on an axis at most (longer sequences: every k-th)


def pyplot() -> ModuleType:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ConfigError("plots need matplotlib: pip install 'tokenloom[viz]'") from err
    return plt


def _labels(ax, tokens: list[str] | None, axis: str, size: int) -> None:
    if not tokens:
        return
    step = max(1, math.ceil(size / MAX_LABELS))
    ticks = list(range(0, size, step))
    shown = [repr(tokens[i])[1:-1] if i < len(tokens) else "" for i in ticks]
    if axis == "x":
        ax.set_xticks(ticks, shown, rotation=90, fontsize=6)
    else:
        ax.set_yticks(ticks, shown, fontsize=6)


def plot_head_grid(maps: dict[int, Tensor], path: str | Path, query_tokens: list[str] | None = None,
                   key_tokens: list[str] | None = None, title: str = "", heads: list[int] | None = None) -> Path:
    """One row per layer (``maps``: layer -> (H, Tq, Tk) probabilities of one sequence), one column per head
    (``heads``: a subset), token labels on the axes (queries down, keys across)."""
    plt = pyplot()
    layers = sorted(maps)
    H = maps[layers[0]].shape[0]
    heads = list(range(H)) if heads is None else heads
    Tq, Tk = maps[layers[0]].shape[-2:]
    cell = 1.6 + 0.05 * max(Tq, Tk)
    fig, axes = plt.subplots(len(layers), len(heads), figsize=(cell * len(heads), cell * len(layers)),
                             squeeze=False)
    for r, layer in enumerate(layers):
        for c, head in enumerate(heads):
            ax = axes[r][c]
            ax.imshow(maps[layer][head].float().numpy(), cmap="viridis", vmin=0.0, aspect="auto",
                      interpolation="nearest")
            ax.set_title(f"layer {layer} head {head}", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
            if r == len(layers) - 1:
                _labels(ax, key_tokens, "x", Tk)
            if c == 0:
                _labels(ax, query_tokens, "y", Tq)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_alignment(probs: Tensor, path: str | Path, source_tokens: list[str] | None = None,
                   target_tokens: list[str] | None = None, title: str = "cross-attention") -> Path:
    """A (Tt, Ts) cross-attention map (e.g. averaged over heads): target tokens down, source tokens across."""
    plt = pyplot()
    Tt, Ts = probs.shape
    fig, ax = plt.subplots(figsize=(2 + 0.3 * Ts, 2 + 0.3 * Tt))
    shown = ax.imshow(probs.float().numpy(), cmap="Greys", vmin=0.0, vmax=float(probs.max()), aspect="auto",
                      interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])
    _labels(ax, source_tokens, "x", Ts)
    _labels(ax, target_tokens, "y", Tt)
    ax.set_xlabel("source")
    ax.set_ylabel("target")
    ax.set_title(title)
    fig.colorbar(shown, ax=ax, fraction=0.046)
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_rollout(image: Tensor, heat: Tensor, path: str | Path, title: str = "attention rollout") -> Path:
    """The image (C, H, W) or (H, W) beside it with the (gh, gw) rollout heat map overlaid (upsampled)."""
    import torch.nn.functional as F

    plt = pyplot()
    img = image.float()
    if img.dim() == 3:
        img = img[0] if img.shape[0] == 1 else img.permute(1, 2, 0)
    img = (img - img.min()) / (img.max() - img.min()).clamp(min=1e-8)
    heat = heat.float()
    up = F.interpolate(heat[None, None], size=img.shape[:2], mode="bilinear", align_corners=False)[0, 0]
    fig, axes = plt.subplots(1, 2, figsize=(6, 3))
    cmap = "gray" if img.dim() == 2 else None
    axes[0].imshow(img.numpy(), cmap=cmap)
    axes[0].set_title("image")
    axes[1].imshow(img.numpy(), cmap=cmap)
    axes[1].imshow(up.numpy(), cmap="jet", alpha=0.5)
    axes[1].set_title(title)
    for ax in axes:
        ax.axis("off")
    fig.tight_layout()
    return _save(fig, plt, path)


def plot_diagnostics(values: Tensor, path: str | Path, title: str = "normalised entropy per head") -> Path:
    """A (layers, heads) table of one statistic as a heat map with the values written in."""
    plt = pyplot()
    L, H = values.shape
    fig, ax = plt.subplots(figsize=(1.5 + 0.6 * H, 1.2 + 0.45 * L))
    ax.imshow(values.float().numpy(), cmap="magma", vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(L):
        for j in range(H):
            ax.text(j, i, f"{float(values[i, j]):.2f}", ha="center", va="center", fontsize=7, color="cyan")
    ax.set_xticks(range(H), [str(h) for h in range(H)])
    ax.set_yticks(range(L), [str(i) for i in range(L)])
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.tight_layout()
    return _save(fig, plt, path)


CURVES = (("loss", ("loss", "val_loss")), ("learning rate", ("lr",)), ("tokens/s", ("tokens_per_s",)))


def plot_curves(runs: dict[str, list[dict]], path: str | Path, x: str = "step") -> Path:
    """Training curves of several runs on shared axes: loss (train solid, validation dashed), learning rate,
    throughput; ``runs``: name -> the rows of its ``metrics.jsonl``. Panels no run logged are left out."""
    plt = pyplot()
    panels = [(label, keys) for label, keys in CURVES
              if any(key in row for rows in runs.values() for row in rows for key in keys)]
    if not panels:
        raise ConfigError("no loss, lr or tokens_per_s values in the metrics of " + ", ".join(runs))
    many = len(runs) > 4  # one shared legend under the panels (a colour per run; solid train, dashed validation)
    width = 5 * len(panels)  # inches; a legend entry at 7 pt: about 4.6 pt per character plus the line sample
    columns = max(1, min(len(runs), int(72 * width // (4.6 * (max(map(len, runs), default=1) + 10)))))
    legend_rows = -(-len(runs) // columns) if many else 0
    height = 3.6 + 0.2 * legend_rows
    fig, axes = plt.subplots(1, len(panels), figsize=(width, height), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "-.", ":"]  # with more runs than colours, the next runs change line style too
    for ax, (label, keys) in zip(axes[0], panels, strict=True):
        for n, (name, rows) in enumerate(runs.items()):
            for key in keys:
                points = [(row[x], row[key]) for row in rows if key in row and x in row]
                if points:
                    xs, ys = zip(*points, strict=True)
                    val = key.startswith("val_")
                    shown = scoped_name(key, next(r for r in reversed(rows) if key in r))  # val_loss[whole split]
                    ax.plot(xs, ys, color=colors[n % len(colors)],
                            linestyle="--" if val else styles[(n // len(colors)) % len(styles)],
                            marker="o" if val else None, markersize=3,
                            label=f"{name} {shown}" if len(keys) > 1 and not many else name)
        ax.set_xlabel(x)
        ax.set_ylabel(label)
        if label == "learning rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.grid(alpha=0.3)
        if not many:
            ax.legend(fontsize=7)
    if many:
        handles: dict[str, Any] = {}
        for ax in axes[0]:
            for handle, name in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(name, handle)
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=columns, fontsize=7,
                   frameon=False, title="solid: train, dashed: validation (first train.eval_batches batches)",
                   title_fontsize=7)
        fig.tight_layout(rect=(0, (0.25 + 0.2 * legend_rows) / height, 1, 1))
    else:
        fig.tight_layout()
    return _save(fig, plt, path)


GLYPHS = {"\n": "\u21b5", "\t": "\u2192", "\r": "\u2190"}  # what a ponder map draws for these characters


def plot_ponder(pieces: list[str], ponder: Tensor, path: str | Path, title: str = "ponder",
                width: int = 100) -> Path:
    """The text laid out in lines as it is written (lines longer than ``width`` characters wrapped), each character
    a cell coloured by its token's ponder count (``ponder`` (T,), one per piece of ``pieces``), with a colour bar; a
    newline is drawn as an arrow at the end of its line."""
    import numpy as np

    plt = pyplot()
    cells: list[tuple[int, int, str, float]] = []  # (row, column, character, ponder)
    row = col = 0
    for piece, value in zip(pieces, ponder.float().tolist(), strict=True):
        for ch in piece:
            if col >= width:
                row, col = row + 1, 0
            cells.append((row, col, GLYPHS.get(ch, ch), value))
            row, col = (row + 1, 0) if ch == "\n" else (row, col + 1)
    rows = max(r for r, _, _, _ in cells) + 1
    cols = max(c for _, c, _, _ in cells) + 1
    grid = np.full((rows, cols), np.nan)
    for r, c, _, value in cells:
        grid[r, c] = value
    low, high = float(np.nanmin(grid)), float(np.nanmax(grid))
    if high - low < 1e-6:
        low, high = low - 0.5, high + 0.5
    fig, ax = plt.subplots(figsize=(1.5 + 0.105 * cols, 0.9 + 0.19 * rows))
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")
    shown = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=low, vmax=high, aspect="auto",
                      interpolation="nearest")
    for r, c, ch, value in cells:
        if not ch.isspace():
            dark = (value - low) / (high - low) < 0.6
            ax.text(c, r, ch, ha="center", va="center", fontsize=7, family="monospace",
                    color="white" if dark else "black")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title)
    fig.colorbar(shown, ax=ax, fraction=0.03, pad=0.01, label="ponder N + R")
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

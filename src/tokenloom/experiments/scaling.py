"""Scaling-law fits: ``L(x) = a * x**-alpha + c`` for x = parameters N, compute C or tokens D.

The fit is the usual one for small sweeps (a handful of model sizes): for a fixed irreducible loss ``c`` the law is
a straight line in log-log space, ``log(L - c) = log(a) - alpha * log(x)``, so ``a`` and ``alpha`` come from ordinary
least squares. The offset ``c`` is then chosen to minimise the squared error of ``L`` itself (not of the logs, which
would over-weight the points closest to ``c``), by a coarse grid over ``[0, min(L))`` refined with golden-section
search. Uncertainty comes from a pairs bootstrap, because with 5-10 points the asymptotic standard errors of a
nonlinear fit are not worth much. numpy only; matplotlib is needed just for :func:`plot_fit`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError

_GRID_POINTS = 200
_GRID_CLOSEST = 1e-6  # the grid's last offset is min(y) * (1 - this)
_GOLDEN_ITERS = 60  # shrinks the bracket by 0.618**60 ~ 3e-13
_PARAMS = ("a", "alpha", "c")
_BATCH_ELEMENTS = 2_000_000  # bootstrap refits run in batches of about this many (resample, offset, point) cells


@dataclass
class PowerLawFit:
    """A fitted ``L(x) = a * x**-alpha + c`` with its goodness of fit and bootstrap intervals.

    ``ci`` maps "a", "alpha" and "c" to 95% percentile intervals (empty when no bootstrap was run); ``n_boot`` is
    the number of bootstrap resamples the intervals rest on (degenerate resamples are not counted).
    """

    a: float
    alpha: float
    c: float
    rmse: float
    n_points: int
    x_name: str
    ci: dict[str, tuple[float, float]] = field(default_factory=dict)
    n_boot: int = 0

    def predict(self, x: np.ndarray | float) -> np.ndarray:
        """The fitted loss at ``x`` (an array of the same shape; a 0-d array for a scalar)."""
        x = np.asarray(x, dtype=np.float64)
        return self.a * x ** (-self.alpha) + self.c

    def describe(self) -> str:
        """One line for humans, e.g. ``L(N) = 12.3 * N^-0.076 + 1.2  (alpha 95% CI [...], 7 points, ...)``."""
        law = f"L({self.x_name}) = {self.a:.3g} * {self.x_name}^-{self.alpha:.3g}"
        if self.c != 0.0:
            law += f" + {self.c:.3g}"
        notes = []
        if "alpha" in self.ci:
            lo, hi = self.ci["alpha"]
            notes.append(f"alpha 95% CI [{lo:.3g}, {hi:.3g}]")
        notes.append(f"{self.n_points} points")
        notes.append(f"{self.n_boot} bootstrap resamples" if self.n_boot else "no bootstrap")
        return f"{law}  ({', '.join(notes)})"

    def to_dict(self) -> dict[str, Any]:
        """Plain floats, ints, strings and lists only, so ``json.dumps`` takes it as is."""
        return {
            "a": float(self.a), "alpha": float(self.alpha), "c": float(self.c), "rmse": float(self.rmse),
            "n_points": int(self.n_points), "x_name": self.x_name, "n_boot": int(self.n_boot),
            "ci": {k: [float(lo), float(hi)] for k, (lo, hi) in self.ci.items()},
        }


def fit_power_law(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray, *, n_boot: int = 1000,
                  seed: int = 0, x_name: str = "N", fit_offset: bool = True) -> PowerLawFit:
    """Fit ``y = a * x**-alpha + c`` (``c`` fixed at 0 when ``fit_offset`` is False) with bootstrap 95% intervals.

    ``x`` must be positive and ``y`` positive (losses); there must be more distinct ``x`` values than parameters so
    that the fit is not an exact interpolation. Bad input raises :class:`ConfigError` with a one-line message.
    """
    xs, ys = _validate(x, y, x_name=x_name, fit_offset=fit_offset)
    if n_boot < 0:
        raise ConfigError(f"n_boot must be >= 0, got {n_boot}")
    a, alpha, c = _fit(xs, ys, fit_offset)
    rmse = math.sqrt(float(np.mean((a * xs ** (-alpha) + c - ys) ** 2)))
    ci, used = _bootstrap(xs, ys, n_boot=n_boot, seed=seed, fit_offset=fit_offset)
    return PowerLawFit(a=a, alpha=alpha, c=c, rmse=rmse, n_points=int(xs.size), x_name=x_name, ci=ci, n_boot=used)


def plot_fit(fits_and_points: Sequence[tuple[str, Any, Any, PowerLawFit]], path: str | Path, *, xlabel: str,
             ylabel: str = "loss", title: str | None = None) -> Path:
    """Log-log plot of each ``(label, x, y, fit)``: measured points and fitted curve, saved as a PNG at ``path``."""
    if not fits_and_points:
        raise ConfigError("plot_fit needs at least one (label, x, y, fit) series")
    from ..viz.plots import pyplot

    plt = pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    try:
        for i, (label, x, y, fit) in enumerate(fits_and_points):
            color = f"C{i}"
            xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
            ax.scatter(xs, ys, color=color, zorder=3, label=label)
            grid = np.geomspace(xs.min() / 1.5, xs.max() * 1.5, 200)
            ax.plot(grid, fit.predict(grid), color=color, lw=1.5, label=_curve_label(fit))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if title:
            ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=120)
    finally:
        plt.close(fig)
    return path


# --- input checks ---------------------------------------------------------------------------------------------


def _validate(x: Any, y: Any, *, x_name: str, fit_offset: bool) -> tuple[np.ndarray, np.ndarray]:
    """float64 1-d copies of ``x`` and ``y``, or ConfigError saying what is wrong with them."""
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if xs.ndim != 1 or ys.ndim != 1:
        raise ConfigError(f"x and y must be 1-d sequences, got shapes {xs.shape} and {ys.shape}")
    if xs.size != ys.size:
        raise ConfigError(f"x and y have different lengths ({xs.size} and {ys.size})")
    if not (np.all(np.isfinite(xs)) and np.all(np.isfinite(ys))):
        raise ConfigError("x and y must be finite (found nan or inf)")
    if np.any(xs <= 0):
        raise ConfigError(f"{x_name} must be > 0 for a power law, got {xs.min():g}")
    if np.any(ys <= 0):
        raise ConfigError(f"losses must be > 0 for a power-law fit, got {ys.min():g}")
    n_params = _n_params(fit_offset)
    distinct = np.unique(xs).size
    if distinct <= n_params:
        law = "L = a*N^-alpha + c" if fit_offset else "L = a*N^-alpha"
        raise ConfigError(f"a fit of {law.replace('N', x_name)} has {n_params} parameters and needs at least "
                          f"{n_params + 1} points with distinct {x_name}, got {distinct}")
    return xs, ys


def _n_params(fit_offset: bool) -> int:
    return 3 if fit_offset else 2


# --- the fit ---------------------------------------------------------------------------------------------------
#
# Everything below works on a batch of B data sets at once (shape (B, n)): the main fit is a batch of one, the
# bootstrap a batch of resamples, so the grid search and the golden-section refinement cost a few numpy calls
# rather than a Python loop per resample.


def _fit(xs: np.ndarray, ys: np.ndarray, fit_offset: bool) -> tuple[float, float, float]:
    """(a, alpha, c) for one already-validated data set."""
    a, alpha, c = _fit_batch(xs[None, :], ys[None, :], fit_offset)[0]
    return float(a), float(alpha), float(c)


def _fit_batch(xs: np.ndarray, ys: np.ndarray, fit_offset: bool) -> np.ndarray:
    """(B, 3) array of (a, alpha, c), one row per data set in the (B, n) arrays ``xs`` and ``ys``."""
    lx = np.log(xs)
    c = _best_offsets(lx, ys) if fit_offset else np.zeros(xs.shape[0])
    log_a, alpha, _ = _ols_given_offsets(lx, ys, c[:, None])
    return np.stack([np.exp(log_a[:, 0]), alpha[:, 0], c], axis=1)


def _ols_given_offsets(lx: np.ndarray, ys: np.ndarray, cs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each data set b and offset ``cs[b, m]`` (< min(ys[b])): OLS of log(y - c) on log(x), and the SSE of y.

    ``lx`` and ``ys`` are (B, n), ``cs`` is (B, M); returns ``(log_a, alpha, sse)``, each (B, M).
    """
    logs = np.log(ys[:, None, :] - cs[:, :, None])
    lx_mean = lx.mean(axis=1, keepdims=True)
    lx_c = lx - lx_mean
    centred = logs - logs.mean(axis=2, keepdims=True)
    slope = np.einsum("bmn,bn->bm", centred, lx_c) / np.sum(lx_c * lx_c, axis=1, keepdims=True)
    log_a = logs.mean(axis=2) - slope * lx_mean
    with np.errstate(over="ignore", invalid="ignore"):
        pred = np.exp(log_a[:, :, None] + slope[:, :, None] * lx[:, None, :]) + cs[:, :, None]
        sse = np.sum((pred - ys[:, None, :]) ** 2, axis=2)
    return log_a, -slope, np.where(np.isfinite(sse), sse, np.inf)


def _best_offsets(lx: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Per data set, the offset c in [0, min(y)) with the least SSE of y: a grid, then golden-section refinement.

    The grid runs from 0 and crowds geometrically towards min(y), where the SSE changes fastest; the refinement
    searches the bracket between the best grid point's neighbours.
    """
    y_min = ys.min(axis=1)
    steps = 1.0 - np.geomspace(1.0, _GRID_CLOSEST, _GRID_POINTS)  # 0, ..., 1 - 1e-6
    grid = y_min[:, None] * steps[None, :]
    sse = _ols_given_offsets(lx, ys, grid)[2]
    best = np.argmin(sse, axis=1)
    rows = np.arange(grid.shape[0])
    lo = grid[rows, np.maximum(best - 1, 0)]
    hi = grid[rows, np.minimum(best + 1, _GRID_POINTS - 1)]

    def objective(c: np.ndarray) -> np.ndarray:
        return _ols_given_offsets(lx, ys, c[:, None])[2][:, 0]

    refined = _golden_min(objective, lo, hi)
    return np.where(objective(refined) <= sse[rows, best], refined, grid[rows, best])


def _golden_min(f: Callable[[np.ndarray], np.ndarray], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Elementwise minimiser of ``f`` on ``[lo, hi]`` by golden-section search (one minimum per bracket assumed)."""
    inv_phi = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = hi - inv_phi * (hi - lo), lo + inv_phi * (hi - lo)
    f1, f2 = f(x1), f(x2)
    for _ in range(_GOLDEN_ITERS):
        left = f1 <= f2  # the minimum lies in [lo, x2]: drop (x2, hi]; otherwise drop [lo, x1)
        lo, hi = np.where(left, lo, x1), np.where(left, x2, hi)
        x1, x2 = np.where(left, hi - inv_phi * (hi - lo), x2), np.where(left, x1, lo + inv_phi * (hi - lo))
        f_new = f(np.where(left, x1, x2))
        f1, f2 = np.where(left, f_new, f2), np.where(left, f1, f_new)
    return np.where(f1 <= f2, x1, x2)


# --- bootstrap ------------------------------------------------------------------------------------------------


def _bootstrap(xs: np.ndarray, ys: np.ndarray, *, n_boot: int, seed: int,
               fit_offset: bool) -> tuple[dict[str, tuple[float, float]], int]:
    """95% percentile intervals from refits on (x, y) pairs resampled with replacement, and how many refits counted.

    Resamples with fewer distinct x values than the law has parameters are skipped: they do not determine the
    parameters at all. (With exactly that many the refit interpolates, which the percentiles tolerate.)
    """
    if n_boot == 0:
        return {}, 0
    idx = np.random.default_rng(seed).integers(0, xs.size, size=(n_boot, xs.size))
    bx, by = xs[idx], ys[idx]
    distinct = 1 + np.count_nonzero(np.diff(np.sort(bx, axis=1), axis=1), axis=1)
    keep = distinct >= _n_params(fit_offset)
    bx, by = bx[keep], by[keep]
    if bx.shape[0] == 0:
        return {}, 0
    batch = max(1, _BATCH_ELEMENTS // (_GRID_POINTS * xs.size))  # bounds the (batch, grid, n) temporaries
    values = np.concatenate([_fit_batch(bx[i:i + batch], by[i:i + batch], fit_offset)
                             for i in range(0, bx.shape[0], batch)])
    lo, hi = np.percentile(values, [2.5, 97.5], axis=0)
    return {name: (float(lo[k]), float(hi[k])) for k, name in enumerate(_PARAMS)}, int(values.shape[0])


# --- plotting -------------------------------------------------------------------------------------------------


def _curve_label(fit: PowerLawFit) -> str:
    """Legend text for a fitted curve: the exponent and, when bootstrapped, its interval."""
    text = f"fit: alpha={fit.alpha:.3g}"
    if "alpha" in fit.ci:
        lo, hi = fit.ci["alpha"]
        text += f" [{lo:.3g}, {hi:.3g}]"
    if fit.c != 0.0:
        text += f", c={fit.c:.3g}"
    return text

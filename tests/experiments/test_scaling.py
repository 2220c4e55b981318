"""Scaling-law fits: recovering known exponents, the bootstrap intervals, input checks, serialising and plotting."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from PIL import Image

from tokenloom.errors import ConfigError
from tokenloom.experiments.scaling import PowerLawFit, fit_power_law, plot_fit

X = np.geomspace(1e4, 1e7, 8)
A, ALPHA, C = 5.0, 0.3, 1.5


def law(x: np.ndarray) -> np.ndarray:
    """The synthetic ground truth the fits should recover."""
    return A * x ** -ALPHA + C


def noisy(rel_noise: float, seed: int = 0) -> np.ndarray:
    """``law(X)`` with seeded multiplicative Gaussian noise of relative size ``rel_noise``."""
    rng = np.random.default_rng(seed)
    return law(X) * (1.0 + rel_noise * rng.standard_normal(X.size))


def test_noise_free_data_gives_the_exact_law():
    fit = fit_power_law(X, law(X), n_boot=0)
    assert fit.alpha == pytest.approx(ALPHA, abs=1e-3)
    assert fit.c == pytest.approx(C, abs=1e-3)
    assert fit.a == pytest.approx(A, rel=1e-2)
    assert fit.rmse < 1e-9
    assert fit.ci == {} and fit.n_boot == 0


def test_noisy_data_recovers_the_exponent_and_offset():
    # 0.2% noise: at 1% the eight points over three decades cannot pin alpha to +-0.05 (its estimator's spread is
    # about 0.08 there), so the tolerance would be a coin toss; at 0.2% the spread is about 0.015.
    fit = fit_power_law(X, noisy(0.002), n_boot=300, seed=0)
    assert fit.alpha == pytest.approx(ALPHA, abs=0.05)
    assert fit.c == pytest.approx(C, abs=0.1)
    lo, hi = fit.ci["alpha"]
    assert lo < ALPHA < hi
    assert set(fit.ci) == {"a", "alpha", "c"}
    assert fit.n_boot == 300


def test_bootstrap_interval_covers_the_truth_at_one_percent_noise():
    fit = fit_power_law(X, noisy(0.01), n_boot=300, seed=0)
    lo, hi = fit.ci["alpha"]
    assert lo < ALPHA < hi
    assert fit.ci["c"][0] <= fit.c <= fit.ci["c"][1]
    assert hi - lo > 0.1  # 1% noise really does leave alpha uncertain, and the interval says so


def test_bootstrap_is_seeded():
    y = noisy(0.01)
    assert fit_power_law(X, y, n_boot=50, seed=3).ci == fit_power_law(X, y, n_boot=50, seed=3).ci
    assert fit_power_law(X, y, n_boot=50, seed=3).ci != fit_power_law(X, y, n_boot=50, seed=4).ci


def test_degenerate_resamples_are_skipped():
    # With 4 points about a third of the resamples hold at most 2 distinct N, too few for 3 parameters.
    x = X[::2]
    fit = fit_power_law(x, law(x), n_boot=300, seed=0)
    assert 100 < fit.n_boot < 300
    assert fit.ci["alpha"][0] == pytest.approx(ALPHA, abs=1e-3)


def test_without_offset_fits_a_pure_power_law():
    fit = fit_power_law(X, 3.0 * X ** -0.5, n_boot=20, fit_offset=False)
    assert fit.a == pytest.approx(3.0, rel=1e-6)
    assert fit.alpha == pytest.approx(0.5, rel=1e-6)
    assert fit.c == 0.0


@pytest.mark.parametrize(("x", "y", "match"), [
    (X[:2], law(X[:2]), "has 3 parameters and needs at least 4 points with distinct N, got 2"),
    (np.array([1e4, 1e4, 1e5, 1e5, 1e6]), law(np.array([1e4, 1e4, 1e5, 1e5, 1e6])), "needs at least 4 .* got 3"),
    (np.array([0.0, 1.0, 2.0, 3.0, 4.0]), np.ones(5), "must be > 0"),
    (-X, law(X), "must be > 0"),
    (X, law(X)[:-1], "different lengths"),
    (X, np.where(X > 1e6, np.nan, law(X)), "finite"),
])
def test_bad_input_is_a_config_error(x, y, match):
    with pytest.raises(ConfigError, match=match):
        fit_power_law(x, y, n_boot=0)


def test_too_few_points_without_offset_names_two_parameters():
    with pytest.raises(ConfigError, match="has 2 parameters and needs at least 3 points with distinct D, got 2"):
        fit_power_law(X[:2], law(X[:2]), fit_offset=False, x_name="D")


def test_predict_is_the_formula():
    fit = PowerLawFit(a=2.0, alpha=0.5, c=1.0, rmse=0.0, n_points=5, x_name="N")
    assert float(fit.predict(4.0)) == pytest.approx(2.0)
    x = np.array([1.0, 100.0, 1e4])
    np.testing.assert_allclose(fit.predict(x), 2.0 * x ** -0.5 + 1.0)


def test_to_dict_and_describe():
    fit = fit_power_law(X, noisy(0.002), n_boot=50, x_name="C")
    record = json.loads(json.dumps(fit.to_dict()))
    assert record["alpha"] == pytest.approx(fit.alpha) and record["x_name"] == "C"
    assert record["ci"]["alpha"] == list(fit.ci["alpha"])
    text = fit.describe()
    assert "alpha" in text and text.startswith("L(C) = ") and "50 bootstrap resamples" in text
    assert "\n" not in text


def test_plot_fit_writes_a_png(tmp_path):
    fit_n = fit_power_law(X, noisy(0.002), n_boot=20)
    fit_d = fit_power_law(X, 3.0 * X ** -0.5, n_boot=0, fit_offset=False)
    path = plot_fit([("L(N)", X, noisy(0.002), fit_n), ("pure", X, 3.0 * X ** -0.5, fit_d)],
                    tmp_path / "plots" / "scaling.png", xlabel="parameters N", title="test")
    assert path == tmp_path / "plots" / "scaling.png"
    assert path.read_bytes()[:4] == b"\x89PNG"
    with Image.open(path) as image:
        image.verify()


def test_plot_fit_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    fit = fit_power_law(X, law(X), n_boot=0)
    with pytest.raises(ConfigError, match=r"tokenloom\[viz\]"):
        plot_fit([("L(N)", X, law(X), fit)], tmp_path / "x.png", xlabel="N")

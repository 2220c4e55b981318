"""Every plot writes a valid PNG."""

import pytest
import torch

from tokenloom.errors import ConfigError
from tokenloom.viz import plots


def assert_png(path):
    from PIL import Image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.size[0] > 100 and image.size[1] > 100


def test_each_plot_writes_a_valid_png(tmp_path):
    probs = torch.softmax(torch.randn(2, 3, 6, 6), -1)
    labels = list("abcdef")
    assert_png(plots.plot_head_grid({0: probs[0], 2: probs[1]}, tmp_path / "grid.png", labels, labels, "t",
                                    heads=[0, 2]))
    assert_png(plots.plot_alignment(probs[0, 0, :4], tmp_path / "align.png", labels, labels[:4]))
    assert_png(plots.plot_rollout(torch.rand(1, 28, 28), torch.rand(7, 7), tmp_path / "rollout.png"))
    assert_png(plots.plot_rollout(torch.rand(3, 32, 32), torch.rand(4, 4), tmp_path / "rollout-rgb.png"))
    assert_png(plots.plot_diagnostics(torch.rand(3, 4), tmp_path / "sub" / "entropy.png"))
    runs = {"a": [{"step": s, "loss": 3 - s / 10, "lr": 1e-3, "tokens_per_s": 100.0} for s in range(1, 20)]
            + [{"step": 19, "val_loss": 1.5}], "b": [{"step": s, "loss": 2.0} for s in range(1, 5)]}
    assert_png(plots.plot_curves(runs, tmp_path / "curves.png"))


def test_curves_of_many_runs_share_one_legend_that_fits(tmp_path):
    import warnings

    names = [f"num_layers={d},norm_placement={p},warmup_steps={w},seed={s}"
             for d in (2, 6, 12) for p in ("pre", "post") for w in (0, 100) for s in (1, 2)]
    runs = {name: [{"step": s, "loss": 3 - s / (10 + i), "lr": 1e-3} for s in range(1, 20)]
            + [{"step": 19, "val_loss": 2.0 + i / 100}] for i, name in enumerate(names)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tight_layout warns when the legend does not fit
        path = plots.plot_curves(runs, tmp_path / "many.png")
    assert_png(path)
    from PIL import Image

    with Image.open(path) as image:  # taller than the panels alone: rows of legend below them
        assert image.size[1] > 3.6 * 110 * 1.5


def test_curves_without_any_known_metric_say_so(tmp_path):
    with pytest.raises(ConfigError, match="no loss, lr or tokens_per_s values in the metrics of a"):
        plots.plot_curves({"a": [{"step": 1, "val_acc": 0.5}]}, tmp_path / "c.png")

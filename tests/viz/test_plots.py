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


def test_the_validation_curve_is_named_by_the_part_of_the_split_it_covers(tmp_path, monkeypatch):
    labels = []
    save = plots._save

    def keep_labels(fig, plt, path):
        labels.extend(label for ax in fig.axes for label in ax.get_legend_handles_labels()[1])
        return save(fig, plt, path)

    monkeypatch.setattr(plots, "_save", keep_labels)
    rows = [{"step": s, "loss": 3 - s / 10} for s in range(1, 10)]
    scoped = rows + [{"step": 9, "val_loss": 2.0, "eval_batches": 20, "eval_split_batches": 28}]
    assert_png(plots.plot_curves({"a": scoped}, tmp_path / "c.png"))
    assert labels == ["a loss", "a val_loss[20 of 28 batches]"]
    labels.clear()
    plots.plot_curves({"a": rows + [{"step": 9, "val_loss": 2.0}]}, tmp_path / "old.png")  # an older metrics file
    assert labels == ["a loss", "a val_loss"]

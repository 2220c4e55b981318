"""ImageClassificationTask: datasets, batches, loss, evaluation, training through the Trainer, exact resume."""

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch.nn import functional as F

from tokenloom.checkpoint import load_model, read_config
from tokenloom.data.augment import AugmentConfig
from tokenloom.data.images import write_idx
from tokenloom.errors import ConfigError, DataError
from tokenloom.tasks.image import ImageClassificationTask, ImageDataConfig, load_image_dataset
from tokenloom.training import load_run_config, setup_run

REPO = Path(__file__).resolve().parents[2]
DIGITS = str(REPO / "data" / "digits")
TINY_VIT = {"family": "vit", "patch_size": 2, "embed_dim": 16, "num_layers": 1, "num_heads": 2, "mlp_ratio": 2.0}


def make_task(augment=None, label_smoothing=0.0, model=None, batch_size=16):
    data = ImageDataConfig(dataset="digits", dir=DIGITS, augment=augment or AugmentConfig())
    return ImageClassificationTask.setup(data, dict(model or TINY_VIT), Path("."), batch_size=batch_size, seq_len=None,
                                         label_smoothing=label_smoothing, eval_batches=None, seed=3)


def test_setup_takes_sizes_and_classes_from_the_data():
    task, model, tokenizer, section = make_task()
    assert tokenizer is None
    assert (section["image_size"], section["in_channels"], section["num_classes"]) == (8, 1, 10)
    assert model.config.num_classes == 10 and task.dataset.classes == [str(i) for i in range(10)]
    assert [task.dataset.size(s) for s in ("train", "val", "test")] == [1257, 180, 360]
    record = task.checkpoint_data()
    assert record["image_size"] == 8 and record["classes"][3] == "3" and len(record["mean"]) == 1
    with pytest.raises(ConfigError, match=r"model.num_classes=7 does not match the data \(10\)"):
        make_task(model={**TINY_VIT, "num_classes": 7})
    swin = {"family": "swin", "patch_size": 2, "embed_dim": 16, "depths": [1], "num_heads": [2], "window_size": 4}
    _, model, _, _ = make_task(model=swin)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


def test_loss_is_cross_entropy_with_label_smoothing():
    task, model, _, _ = make_task(label_smoothing=0.1)
    batch = task.get_batch(torch.Generator().manual_seed(0))
    assert batch.images.shape == (16, 1, 8, 8) and batch.targets is None
    loss, n = task.loss(model, batch)
    expected = F.cross_entropy(model(batch.images), batch.labels, label_smoothing=0.1)
    assert n == 16
    torch.testing.assert_close(loss, expected)


def test_soft_target_loss_is_the_smoothed_formula():
    task, model, _, _ = make_task(augment=AugmentConfig(mixup_alpha=0.4), label_smoothing=0.1)
    batch = task.get_batch(torch.Generator().manual_seed(0))
    assert batch.targets is not None and batch.targets.shape == (16, 10)
    loss, _ = task.loss(model, batch)
    smoothed = 0.9 * batch.targets + 0.1 / 10
    expected = -(smoothed * model(batch.images).log_softmax(-1)).sum(-1).mean()
    torch.testing.assert_close(loss, expected)


def test_epochs_cover_the_data_and_resume_exactly():
    task, _, _, _ = make_task(augment=AugmentConfig(crop_padding=1, rotation=5), batch_size=100)
    g = torch.Generator().manual_seed(5)
    seen = []
    for _ in range(task.batches_per_epoch):  # 12 batches of 100 of the 1,257 images
        batch = task.get_batch(g)
        seen += batch.labels.tolist()
    assert len(seen) == 1200 and task.epoch == 0
    state, g_state = task.state_dict(), g.get_state()
    expected = [task.get_batch(g) for _ in range(3)]  # crosses into epoch 1
    assert task.epoch == 1
    other, _, _, _ = make_task(augment=AugmentConfig(crop_padding=1, rotation=5), batch_size=100)
    other.load_state_dict(state)
    g.set_state(g_state)
    for want in expected:
        got = other.get_batch(g)
        assert torch.equal(got.images, want.images) and torch.equal(got.labels, want.labels)


def test_evaluate_reports_loss_accuracy_top5():
    task, model, _, _ = make_task()
    model.eval()
    metrics = task.evaluate(model, split="test")
    assert set(metrics) == {"test_loss", "test_acc", "test_top5"}
    logits, labels = task.logits(model, "test")
    assert logits.shape == (360, 10)
    assert metrics["test_acc"] == pytest.approx(100 * float((logits.argmax(1) == labels).float().mean()))
    assert metrics["test_loss"] == pytest.approx(float(F.cross_entropy(logits, labels)), rel=1e-5)
    with pytest.raises(DataError, match="nothing to evaluate"):
        task.logits(model, "test", max_batches=0)
    task.data.eval_batch_size = 100
    assert task.logits(model, "val", max_batches=1)[0].shape == (100, 10)


def test_mnist_and_folder_datasets(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 30), ("t10k", 7)):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", rng.integers(0, 10, n, dtype=np.uint8))
    data = load_image_dataset(ImageDataConfig(dataset="mnist", dir=str(tmp_path), val_size=5, image_size=14,
                                              in_channels=3))
    assert [data.size(s) for s in ("train", "val", "test")] == [25, 5, 7]
    assert data.images("train").shape == (25, 3, 14, 14) and len(data.mean) == 3
    with pytest.raises(DataError, match="leaves no MNIST training images"):
        load_image_dataset(ImageDataConfig(dataset="mnist", dir=str(tmp_path), val_size=30))

    from PIL import Image

    for split, count in (("train", 6), ("test", 2)):
        for cls in ("cat", "dog"):
            for i in range(count):
                (tmp_path / "pets" / split / cls).mkdir(parents=True, exist_ok=True)
                Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).save(
                    tmp_path / "pets" / split / cls / f"{i}.png")
    data = load_image_dataset(ImageDataConfig(dataset="folder", dir=str(tmp_path / "pets"), val_size=2))
    assert data.classes == ["cat", "dog"] and data.channels == 3 and data.image_size == (6, 6)
    assert [data.size(s) for s in ("train", "val", "test")] == [10, 2, 4]
    with pytest.raises(ConfigError, match="data.dir must name the image folder"):
        ImageDataConfig(dataset="folder")


def recipe(root: Path, **train):
    return {
        "task": "image_classification",
        "model": dict(TINY_VIT),
        "data": {"dataset": "digits", "dir": DIGITS, "eval_batch_size": 200,
                 "augment": {"crop_padding": 1, "rotation": 5.0, "mixup_alpha": 0.2, "mix_prob": 0.5}},
        "train": {"max_steps": 8, "batch_size": 32, "lr": 3e-3, "warmup_steps": 2, "eval_every": 4,
                  "eval_batches": 1, "checkpoint_every": 4, "log_every": 2, "label_smoothing": 0.1,
                  "precision": "fp32", "keep_best": "val_acc", **train},
    }


def run(config, run_dir, resume=False, overrides=()):
    trainer = setup_run(load_run_config(config, list(overrides)), run_dir, resume=resume, show_progress=False)
    return trainer, trainer.fit()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_trainer_resume_is_exact(tmp_path, precision):
    cfg = recipe(tmp_path, precision=precision)
    full, summary = run(cfg, tmp_path / "full")
    assert summary["step"] == 8 and 0 <= summary["val_acc"] <= 100 and "val_top5" in summary
    _, first = run(cfg, tmp_path / "split", overrides=["train.stop_after_steps=4"])
    assert first["stopped_by"] == "stop_after_steps"
    resumed, _ = run(load_run_config(read_config(tmp_path / "split")).to_dict(), tmp_path / "split", resume=True)
    for name, value in full.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name
    assert full.last_eval == resumed.last_eval


def test_training_learns_and_checkpoint_records_the_data(tmp_path):
    cfg = recipe(tmp_path, max_steps=80, eval_every=40, lr=5e-3)
    cfg["data"]["augment"] = {}
    cfg["model"].update(embed_dim=32, num_heads=4)
    trainer, summary = run(cfg, tmp_path / "r")
    assert summary["val_acc"] > 25  # 10 classes: chance is 10% (a ViT starts slowly: ~40% after 80 steps)
    config = read_config(tmp_path / "r")
    assert config["task"] == "image_classification" and config["data"]["classes"] == [str(i) for i in range(10)]
    assert config["data"]["image_size"] == 8 and config["data"]["in_channels"] == 1
    assert not (tmp_path / "r" / "checkpoint" / "tokenizer.json").exists()
    best = yaml.safe_load((tmp_path / "r" / "best" / "config.yaml").read_text())["best"]
    assert best["metric"] == "val_acc" and best["value"] >= summary["val_acc"] - 1e-9
    model, _ = load_model(tmp_path / "r")
    logits, labels = trainer.task.logits(model, "val")
    assert 100 * float((logits.argmax(1) == labels).float().mean()) == pytest.approx(summary["val_acc"])


def write_pngs(root: Path, classes=("a", "b"), per_class: int = 5, size=(6, 6), channels: int = 3) -> Path:
    from PIL import Image

    rng = np.random.default_rng(1)
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (*size, channels) if channels == 3 else size, dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


def test_folder_splits_the_folder_lacks_are_held_out(tmp_path):
    """Without val/ and test/ both come out of the training images (10% each, or data.val_size / test_size); a
    folder with val/ only gets a test split; one too small for a default test split gets none."""
    flat = write_pngs(tmp_path / "flat", per_class=10)
    data = load_image_dataset(ImageDataConfig(dataset="folder", dir=str(flat)))
    assert [data.size(s) for s in ("train", "val", "test")] == [16, 2, 2]
    data = load_image_dataset(ImageDataConfig(dataset="folder", dir=str(flat), val_size=3, test_size=5))
    assert [data.size(s) for s in ("train", "val", "test")] == [12, 3, 5]
    write_pngs(tmp_path / "split" / "train", per_class=10)
    write_pngs(tmp_path / "split" / "val", per_class=2)
    data = load_image_dataset(ImageDataConfig(dataset="folder", dir=str(tmp_path / "split"), val_size=7))
    assert [data.size(s) for s in ("train", "val", "test")] == [18, 4, 2]  # val/ given: val_size does not apply
    tiny = load_image_dataset(ImageDataConfig(dataset="folder", dir=str(write_pngs(tmp_path / "tiny", per_class=1))))
    assert sorted(tiny.splits) == ["train", "val"] and tiny.size("train") == 1
    data = load_image_dataset(ImageDataConfig(dataset="folder", dir=str(flat), val_size=17))
    assert [data.size(s) for s in ("train", "val", "test")] == [1, 17, 2]
    data = load_image_dataset(ImageDataConfig(dataset="folder", dir=str(flat), val_size=19))  # no room for a test
    assert sorted(data.splits) == ["train", "val"] and data.size("train") == 1
    with pytest.raises(DataError, match=r"its 20 training images cannot give 20 val images and keep any for "
                                        r"training \(data.val_size=20: set smaller\)"):
        load_image_dataset(ImageDataConfig(dataset="folder", dir=str(flat), val_size=20))
    with pytest.raises(ConfigError, match="data.test_size applies to the digits dataset and image folders"):
        ImageDataConfig(dataset="mnist", test_size=10)


def test_a_pinned_model_size_and_mode_are_what_the_images_become(tmp_path):
    """model.image_size / in_channels set in the recipe win: the folder's 6x6 RGB images become 8x8 grayscale (one
    warning); num_classes comes from the data."""
    folder = write_pngs(tmp_path / "imgs", per_class=10)
    data = ImageDataConfig(dataset="folder", dir=str(folder))
    with pytest.warns(UserWarning, match="converted to 8x8 L"):
        task, model, _, section = ImageClassificationTask.setup(
            data, {**TINY_VIT, "image_size": 8, "in_channels": 1}, Path("."), batch_size=4, seq_len=None,
            label_smoothing=0.0, eval_batches=None)
    assert task.dataset.image_size == (8, 8) and task.dataset.channels == 1
    assert (section["image_size"], section["in_channels"], section["num_classes"]) == (8, 1, 2)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 2)
    assert task.checkpoint_data()["image_size"] == 8


def test_a_folder_recipe_without_sizes_validates_and_trains(tmp_path):
    """A recipe leaving image_size, in_channels, num_classes, val_size and test_size to the data (left out or null),
    with a patch size that does not divide the ViT default (224): valid, and it trains."""
    folder = write_pngs(tmp_path / "imgs", per_class=10, size=(10, 10), channels=1)
    config = load_run_config({"task": "image_classification",
                              "model": {**TINY_VIT, "patch_size": 5, "num_classes": None},
                              "data": {"dataset": "folder", "dir": str(folder)},
                              "train": {"max_steps": 2, "batch_size": 4, "warmup_steps": 0, "eval_every": 0,
                                        "checkpoint_every": 0, "precision": "fp32"}})
    trainer, summary = run(config.to_dict(), tmp_path / "run")
    assert summary["step"] == 2
    assert (trainer.model.config.image_size, trainer.model.config.in_channels, trainer.model.config.num_classes) \
        == (10, 1, 2)

"""`tokenloom train | evaluate | classify` for image classification (a tiny ViT on the bundled digits)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tokenloom.cli.main import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    recipe = {
        "task": "image_classification",
        "model": {"family": "vit", "image_size": 8, "patch_size": 2, "in_channels": 1, "num_classes": 10,
                  "embed_dim": 32, "num_layers": 1, "num_heads": 4, "mlp_ratio": 2.0},
        "data": {"dataset": "digits", "dir": str(REPO / "data" / "digits"), "eval_batch_size": 200,
                 "augment": {"crop_padding": 1}},
        "train": {"max_steps": 40, "batch_size": 32, "lr": 5e-3, "warmup_steps": 4, "eval_every": 20,
                  "eval_batches": 2, "checkpoint_every": 20, "label_smoothing": 0.1, "precision": "fp32",
                  "keep_best": "val_acc"},
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(root / "recipe.yaml"), "--out", str(root / "run")]) == 0
    return root


@pytest.fixture(scope="module")
def pngs(trained):
    """The first four test images of the digits split as 8x8 PNGs, and one 16x16 RGB image."""
    from PIL import Image

    from tokenloom.tasks.image import ImageDataConfig, load_image_dataset

    data = load_image_dataset(ImageDataConfig(dataset="digits", dir=str(REPO / "data" / "digits")))
    paths = []
    for i in range(4):
        paths.append(trained / f"test{i}.png")
        Image.fromarray(data.images("test")[i, 0].numpy()).save(paths[-1])
    rgb = trained / "big.png"
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(rgb)
    return paths, rgb


def test_evaluate_test_split_json(trained, capsys):
    capsys.readouterr()
    assert main(["evaluate", str(trained / "run"), "--split", "test", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["split"] == "test" and result["count"] == 360
    assert 0 <= result["accuracy"] <= result["top5"] <= 100
    shown = (result["accuracy"], result["top5"], *result["per_class"].values())
    assert all(value == round(value, 4) for value in shown)  # percentages to 4 decimals, top-5 included
    assert len(result["confusion"]) == 10 and sum(map(sum, result["confusion"])) == 360
    assert set(result["per_class"]) == {str(i) for i in range(10)}
    if result["confusion_png"] is not None:  # drawn when matplotlib is installed
        assert Path(result["confusion_png"]) == trained / "run" / "checkpoint-confusion-test.png"
        assert Path(result["confusion_png"]).read_bytes()[:4] == b"\x89PNG"


def test_evaluate_text_and_output_path(trained, capsys):
    pytest.importorskip("matplotlib")
    capsys.readouterr()
    out_png = trained / "plots" / "cm.png"
    assert main(["evaluate", str(trained / "run" / "best"), "--split", "val", "--output", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert "accuracy" in out and "top-5" in out and "most confused with" in out
    assert f"confusion matrix: {out_png}" in out
    assert out_png.is_file()


def test_classify_matches_the_model_on_the_same_pixels(trained, pngs, capsys):
    from tokenloom.checkpoint import load_model, read_config
    from tokenloom.config import from_dict
    from tokenloom.tasks.image import ImageClassificationTask, ImageDataConfig, load_image_dataset

    paths, _ = pngs
    capsys.readouterr()
    assert main(["classify", str(trained / "run"), *map(str, paths), "--top", "3", "--json"]) == 0
    predictions = json.loads(capsys.readouterr().out)["predictions"]
    model, config = load_model(trained / "run")
    data = from_dict(ImageDataConfig, config["data"], prefix="data")
    task = ImageClassificationTask(load_image_dataset(data), data, batch_size=1)
    probs = task.logits(model, "test")[0][:4].softmax(-1)
    for p, item in zip(probs, predictions, strict=True):
        assert len(item["top"]) == 3 and item["label"] == str(int(p.argmax()))
        assert item["top"][0]["probability"] == pytest.approx(float(p.max()), abs=1e-5)
        values = [t["probability"] for t in item["top"]]
        assert values == sorted(values, reverse=True)
    assert read_config(trained / "run")["data"]["classes"][0] == "0"


def test_classify_text_and_conversion_warning(trained, pngs, capsys):
    paths, rgb = pngs
    capsys.readouterr()
    assert main(["classify", str(trained / "run"), str(paths[0]), str(rgb), "--top", "2"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith(f"{rgb}: ") and lines[1].count("%") == 2
    assert "warning: 1 image(s) converted to the model's 8x8 grayscale input (big.png: mode RGB -> L, size 16x16" \
        in captured.err


@pytest.mark.parametrize("args, message", [
    (["classify", "{run}", "{root}/big.png", "--mismatch", "error"], "big.png: mode RGB but expected L"),
    (["classify", "{run}", "{root}/nothing.png"], "image not found"),
    (["classify", "{run}", "{root}/recipe.yaml"], "cannot read image"),
    (["classify", "{run}", "{root}/test0.png", "--top", "0"], "--top must be >= 1"),
    (["evaluate", "{run}", "--split", "test2016"], "train, val or test"),
    (["evaluate", "{run}", "--metrics", "bleu"], "apply to translation models"),
    (["generate", "{run}"], "holds an image classifier"),
    (["train", "{root}/recipe.yaml", "--out", "{root}/other", "--sample", "10"], "--sample applies to language"),
    (["train", "{root}/recipe.yaml", "--out", "{root}/x", "--set", "model.num_classes=3"],
     "model.num_classes=3 does not match the data (10)"),
    (["train", "{root}/recipe.yaml", "--out", "{root}/x", "--set", "data.dataset=mnits"], "did you mean 'mnist'"),
])
def test_bad_input_is_one_line(trained, pngs, capsys, args, message):
    args = [a.format(run=trained / "run", root=trained) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_resume_through_the_cli(trained, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    assert main(["train", "--out", str(run), "--resume", "--set", "train.max_steps=44"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 44 and "val_acc" in records[-1]
    assert torch.load(run / "checkpoint" / "trainer_state.pt", weights_only=False)["task"]["offset"] > 0


def write_image_folder(root: Path, classes=("cat", "dog", "owl"), per_class: int = 8, size=(12, 12),
                       mode: str = "RGB") -> Path:
    """A folder of class subfolders of small random PNGs (Pillow, what the task reads them with)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    shape = (*size, 3) if mode == "RGB" else size
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(root / name / f"{i}.png")
    return root


FOLDER_RECIPE = {
    "task": "image_classification",
    "model": {"family": "vit", "patch_size": 4, "embed_dim": 16, "num_layers": 1, "num_heads": 2},  # no sizes
    "train": {"max_steps": 2, "batch_size": 4, "warmup_steps": 0, "eval_every": 0, "eval_batches": 1,
              "checkpoint_every": 0, "precision": "fp32"},
}


def test_an_image_folder_trains_with_sizes_and_classes_from_the_data(tmp_path, capsys):
    """A recipe pointing at a folder of class subfolders, with no image_size, in_channels, num_classes, val_size or
    test_size (issue 26): the model takes them from the images, val and test are held out of them (10% each)."""
    images = write_image_folder(tmp_path / "pets")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**FOLDER_RECIPE, "data": {"dataset": "folder", "dir": str(images)}}))
    assert main(["train", str(recipe), "--out", str(tmp_path / "run")]) == 0
    config = yaml.safe_load((tmp_path / "run" / "checkpoint" / "config.yaml").read_text())
    model = config["model"]
    assert (model["image_size"], model["in_channels"], model["num_classes"]) == (12, 3, 3)
    assert config["data"]["classes"] == ["cat", "dog", "owl"] and config["data"]["image_size"] == 12
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "run"), "--split", "test", "--json", "--no-plot"]) == 0
    assert json.loads(capsys.readouterr().out)["count"] == 2  # 24 images: val 2, test 2, train 20


@pytest.mark.parametrize("model, data, message", [
    ({"num_classes": 2}, {}, "model.num_classes=2 does not match the data (3)"),
    ({"patch_size": 5}, {}, "model.image_size=12 must be a multiple of patch_size=5 (model.image_size is the data's "
                            "image size, 12x12: set data.image_size"),
    ({"patch_size": 5}, {"image_size": 14}, "model.image_size=14 must be a multiple of patch_size=5"),
    ({"image_size": 8}, {"image_size": 16}, "model.image_size=8 does not match the data (16)"),
    ({}, {"val_size": 20, "test_size": 4}, "its 24 training images cannot give 20 val + 4 test images and keep any "
                                           "for training (data.val_size=20, data.test_size=4: set smaller)"),
])
@pytest.mark.filterwarnings("ignore:.*image\\(s\\) converted to")
def test_image_folder_mismatches_are_one_line(tmp_path, capsys, model, data, message):
    images = write_image_folder(tmp_path / "pets")
    recipe = {**FOLDER_RECIPE, "model": {**FOLDER_RECIPE["model"], **model},
              "data": {"dataset": "folder", "dir": str(images), **data}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    capsys.readouterr()
    assert main(["train", str(tmp_path / "recipe.yaml"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err and "Traceback" not in err

"""tokenloom viz attention | check | curves and tokenloom report, end to end (the report in headless Chromium)."""

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.viz.test_plots import assert_png
from tokenloom.cli.main import main

REPO = Path(__file__).resolve().parents[2]
SHAKES = REPO / "checkpoints" / "shakespeare-char"
DE_EN = REPO / "checkpoints" / "multi30k-de-en"
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\n\nJULIET:\nAy me.\n" * 60


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("viz-lm")
    (root / "corpus.txt").write_text(TEXT)
    recipe = {"model": {"num_layers": 2, "num_heads": 2, "embed_dim": 32, "max_seq_len": 64},
              "data": {"path": str(root / "corpus.txt")},
              "train": {"max_steps": 20, "batch_size": 8, "seq_len": 32, "lr": 3e-3, "warmup_steps": 5,
                        "eval_every": 10, "eval_batches": 2, "checkpoint_every": 10, "precision": "fp32"}}
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(root / "recipe.yaml"), "--out", str(root / "run")]) == 0
    return root / "run"


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory):
    from PIL import Image

    from tokenloom.tasks.image import ImageDataConfig, load_image_dataset

    root = tmp_path_factory.mktemp("viz-vit")
    recipe = {"task": "image_classification",
              "model": {"family": "vit", "image_size": 8, "patch_size": 2, "in_channels": 1, "num_classes": 10,
                        "embed_dim": 32, "num_layers": 2, "num_heads": 4, "mlp_ratio": 2.0},
              "data": {"dataset": "digits", "dir": str(REPO / "data" / "digits"), "eval_batch_size": 200},
              "train": {"max_steps": 10, "batch_size": 32, "lr": 5e-3, "warmup_steps": 2, "eval_every": 10,
                        "eval_batches": 1, "checkpoint_every": 10, "precision": "fp32"}}
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(root / "recipe.yaml"), "--out", str(root / "run")]) == 0
    data = load_image_dataset(ImageDataConfig(dataset="digits", dir=str(REPO / "data" / "digits")))
    Image.fromarray(data.images("test")[0, 0].numpy()).save(root / "digit.png")
    return root / "run", root / "digit.png"


def one_line_error(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err, err


def test_viz_attention_gpt_heads_grid(tmp_path, capsys):
    out = tmp_path / "att.png"
    assert main(["viz", "attention", str(SHAKES), "--text", "ROMEO: But soft", "--layers", "0", "3",
                 "--out", str(out)]) == 0
    assert_png(out)
    assert main(["viz", "attention", str(SHAKES), "--text", "ROMEO: But soft", "--layers", "-1", "--heads", "0",
                 "--out", str(out)]) == 0
    assert_png(out)


def test_viz_attention_cross_alignment_and_encoder(tmp_path, capsys):
    out = tmp_path / "align.png"
    assert main(["viz", "attention", str(DE_EN), "--source", "Ein Hund rennt.", "--cross", "--out", str(out)]) == 0
    assert "translation: A dog runs." in capsys.readouterr().out
    assert_png(out)
    assert main(["viz", "attention", str(DE_EN), "--source", "Ein Hund rennt.", "--target", "A dog runs.",
                 "--kind", "decoder", "--layers", "0", "--out", str(out)]) == 0
    assert_png(out)


def test_viz_attention_vit_rollout_and_grid(vit_run, tmp_path):
    run, digit = vit_run
    assert main(["viz", "attention", str(run), "--image", str(digit), "--rollout", "--out",
                 str(tmp_path / "r.png")]) == 0
    assert_png(tmp_path / "r.png")
    assert main(["viz", "attention", str(run), "--image", str(digit), "--out", str(tmp_path / "g.png")]) == 0
    assert_png(tmp_path / "g.png")


def test_viz_bad_input_is_one_line(tmp_path, capsys):
    one_line_error(capsys, ["viz", "attention", str(SHAKES), "--text", "abc", "--layers", "6"],
                   "layer 6 is out of range: the model has 6 self attention layers (0..5)")
    one_line_error(capsys, ["viz", "attention", str(SHAKES), "--text", "abc", "--heads", "9"],
                   "head 9 is out of range: the model has 6 heads (0..5)")
    one_line_error(capsys, ["viz", "attention", str(SHAKES), "--text", "x" * 300],
                   "--text is 300 tokens, longer than the model's context of 256")
    one_line_error(capsys, ["viz", "attention", str(SHAKES)], "a language model needs --text")
    one_line_error(capsys, ["viz", "attention", str(DE_EN), "--source", "Hund", "--cross", "--layers", "5"],
                   "layer 5 is out of range: the model has 3 cross attention layers (0..2)")
    one_line_error(capsys, ["viz", "curves", str(tmp_path)], f"{tmp_path} has no metrics.jsonl")


def test_viz_attention_truncates_when_asked(tmp_path, capsys):
    out = tmp_path / "long.png"
    assert main(["viz", "attention", str(SHAKES), "--text", "x" * 300, "--too-long", "truncate", "--layers", "0",
                 "--out", str(out)]) == 0
    assert "kept the first 256" in capsys.readouterr().err
    assert_png(out)


def test_viz_check_passes_and_writes_json(lm_run, tmp_path, capsys):
    assert main(["viz", "check", str(lm_run), "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert text.count("  ok") == 2
    results = json.loads((tmp_path / "head-diagnostics.json").read_text())
    assert [c["passed"] for c in results["causal"]] == [True, True]
    assert len(results["heads"]) == 4  # 2 layers x 2 heads
    assert_png(tmp_path / "head-entropy-self.png")


def test_viz_check_fails_on_a_broken_mask(lm_run, capsys, monkeypatch):
    import tokenloom.models.gpt as gpt_module

    monkeypatch.setattr(gpt_module, "plan_attention", lambda *args, **kwargs: (None, False, None))  # no causal mask
    assert main(["viz", "check", str(lm_run)]) == 1
    assert "LEAKS" in capsys.readouterr().out


def test_viz_curves_of_two_runs(lm_run, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 4.0 - s / 10}) + "\n"
                                                 for s in range(1, 10)) + '{"step": 10, "lo')  # a cut-off line
    assert main(["viz", "curves", str(lm_run), str(other), "--out", str(tmp_path / "c.png")]) == 0
    assert_png(tmp_path / "c.png")


def check_page(html_path: Path, sections: list[str]) -> None:
    """The report loads nothing from elsewhere and renders in headless Chromium: every image decoded, every
    section heading there, no console messages."""
    from tests.browser import run_page

    page = html_path.read_text(encoding="utf-8")
    assert not re.search(r'(src|href)="(?!data:|#)', page), "the report must not load anything from elsewhere"
    images = page.count("<img ")
    assert images >= 1
    (ok, total, headings), console = run_page(
        html_path.resolve().as_uri(),
        ["document.body.dataset.imagesOk", "document.body.dataset.imagesTotal",
         "Array.from(document.querySelectorAll('h2')).map((h) => h.textContent)"], wait_for_state=False)
    assert (ok, total) == (str(images), str(images)), console
    assert console == []
    for heading in sections:
        assert heading in headings


def test_report_renders_in_the_browser(lm_run, capsys):
    assert main(["report", str(lm_run), "--text", "ROMEO:"]) == 0
    report = lm_run / "report.html"
    assert f"wrote {report}" in capsys.readouterr().out
    check_page(report, ["Summary", "Training curves", "Samples", "Attention maps",
                        "Causal check and head diagnostics", "Config"])


def test_report_of_a_translation_and_an_image_model(vit_run, tmp_path):
    assert main(["report", str(DE_EN), "--out", str(tmp_path / "de.html")]) == 0
    page = (tmp_path / "de.html").read_text()
    assert "no curves:" in page and "A dog" in page  # the bundled checkpoint has no metrics.jsonl
    check_page(tmp_path / "de.html", ["Summary", "Samples", "Attention maps"])
    run, digit = vit_run
    assert main(["report", str(run), "--image", str(digit), "--out", str(tmp_path / "vit.html")]) == 0
    check_page(tmp_path / "vit.html", ["Summary", "Training curves", "Samples", "Attention maps"])


def test_the_page_check_catches_a_broken_image(lm_run, tmp_path):
    assert main(["report", str(lm_run), "--out", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text().replace("base64,iVBOR", "base64,XXXX", 1)
    (tmp_path / "broken.html").write_text(page)
    with pytest.raises(AssertionError):
        check_page(tmp_path / "broken.html", ["Summary"])


def test_the_reports_training_time_sums_every_resumed_segment():
    from tokenloom.cli.report import training_seconds

    first = [{"step": s, "loss": 1.0, "elapsed_s": e} for s, e in ((10, 1.5), (20, 3.0))]
    resumed = [{"step": s, "loss": 1.0, "elapsed_s": e} for s, e in ((30, 1.25), (40, 2.5))]
    assert training_seconds(first) == 3.0
    assert training_seconds(first + resumed) == 5.5  # 3.0 before the resume + 2.5 after it
    assert training_seconds([{"step": 1, "loss": 1.0}]) is None


def test_the_reports_summary_names_the_validation_figures_by_the_part_of_the_split_they_cover(tmp_path):
    import json
    from types import SimpleNamespace

    import torch

    from tokenloom.cli.report import summary

    records = [{"step": 10, "loss": 2.0}, {"step": 10, "val_loss": 1.345, "val_ppl": 3.84, "eval_batches": 20,
                                           "eval_split_batches": 28}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    loaded = SimpleNamespace(model=torch.nn.Linear(2, 2), config={"task": "lm"}, family="gpt")
    body = summary(loaded, tmp_path).body
    assert "val_loss[20 of 28 batches] (step 10)" in body and "val_ppl[20 of 28 batches] (step 10)" in body


def test_the_reports_summary_gives_the_final_step_where_validation_ran(tmp_path):
    """Training lines come every log_every steps, validation at the last step: a run of 574 steps logged its last
    loss at 570, and the summary's steps is 574 (as its validation rows say), the loss row naming its own step."""
    import json
    from types import SimpleNamespace

    import torch

    from tokenloom.cli.report import summary

    records = [{"step": 560, "loss": 2.1}, {"step": 570, "loss": 2.0}, {"step": 574, "val_loss": 1.9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    loaded = SimpleNamespace(model=torch.nn.Linear(2, 2), config={"task": "lm"}, family="gpt")
    body = summary(loaded, tmp_path).body
    assert 'steps</td><td class="text">574</td>' in body, body
    assert "last training loss (step 570)" in body and "val_loss (step 574)" in body

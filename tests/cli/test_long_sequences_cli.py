"""The long-sequence recipes end to end on a small corpus: train (two steps of a shrunk model), generate past the
context (the rolling cache, the Transformer-XL memory), evaluate (XL over streams with its memory), and the
one-line refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenloom.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\n\nJULIET:\nAy me.\n" * 80
SMALL = ["--set", "model.num_layers=1", "--set", "model.embed_dim=32", "--set", "model.num_heads=2",
         "--set", "train.max_steps=2", "--set", "train.eval_every=2", "--set", "train.eval_batches=1",
         "--set", "train.checkpoint_every=2", "--set", "train.precision=fp32"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("long")
    (root / "corpus.txt").write_text(TEXT)
    data = ["--set", f"data.path={root / 'corpus.txt'}"]
    assert main(["train", str(ROOT / "configs" / "shakespeare-char-swa.yaml"), "--out", str(root / "swa"),
                 *SMALL, *data, "--set", "train.batch_size=2"]) == 0
    assert main(["train", str(ROOT / "configs" / "shakespeare-char-xl.yaml"), "--out", str(root / "xl"),
                 *SMALL, *data, "--set", "train.batch_size=4"]) == 0
    return root


@pytest.mark.parametrize("run", ["swa", "xl"])
def test_generation_runs_past_the_context_in_one_run(runs, run, capsys):
    assert main(["generate", str(runs / run), "--prompt", "ROMEO:", "--max-new-tokens", "400", "--greedy"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ROMEO:") and len(out) >= len("ROMEO:") + 400  # past a context of 256 (swa) / 64 (xl)


def test_xl_evaluates_over_streams_with_its_memory(runs, capsys):
    assert main(["evaluate", str(runs / "xl")]) == 0
    assert "val_loss" in capsys.readouterr().out
    assert main(["evaluate", str(runs / "xl"), "--stride", "8"]) != 0
    err = capsys.readouterr().err
    assert "leave out --stride" in err and "Traceback" not in err


def test_a_window_with_a_linear_time_backend_is_refused_in_one_line(runs, capsys):
    assert main(["train", str(ROOT / "configs" / "shakespeare-char-swa.yaml"), "--out", str(runs / "bad"),
                 "--set", "model.attention=performer"]) != 0
    err = capsys.readouterr().err
    assert "attention_window needs attention sdpa or math" in err and "Traceback" not in err

"""``tokenloom quantize`` and ``--precision int8 | int4``: a quantised copy of a tiny checkpoint, the commands that run
it, and the one-line refusals."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from tokenloom import GPT, GPTConfig
from tokenloom.checkpoint import load_model, write_checkpoint
from tokenloom.cli.main import main
from tokenloom.data import create_tokenizer
from tokenloom.models.factory import model_config_to_dict
from tokenloom.nn.quantized import QuantizedLinear

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\n\nJULIET:\nAy me.\n" * 20


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize")
    (root / "text.txt").write_text(TEXT)
    tokenizer = create_tokenizer("char", TEXT)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, num_layers=2, num_heads=2, embed_dim=32, max_seq_len=32))
    write_checkpoint(root / "float", model, {"task": "lm", "model": model_config_to_dict("gpt", model.config),
                                             "data": {"path": str(root / "text.txt"), "val_fraction": 0.1}},
                     tokenizer)
    return root


def one_line_error(capsys, argv: list[str], message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_quantize_writes_a_smaller_checkpoint_that_generates(float_checkpoint, tmp_path, capsys):
    out = tmp_path / "int8"
    assert main(["quantize", str(float_checkpoint / "float"), "--bits", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "int8, blocks" in printed and "model.safetensors" in printed and "x smaller)" in printed
    assert yaml.safe_load((out / "config.yaml").read_text())["quantization"] == \
        {"bits": 8, "group_size": 128, "head": False, "embedding": False}
    sizes = [(path / "model.safetensors").stat().st_size for path in (out, float_checkpoint / "float")]
    assert sizes[0] < sizes[1]
    assert (out / "tokenizer.json").is_file()
    model, _ = load_model(out)
    assert isinstance(model.blocks[0].mlp.fc_in, QuantizedLinear)
    # $TOKENLOOM_PRECISION is fp32 in the tests: a quantised checkpoint takes auto or its own precision
    for precision in ("auto", "int8"):
        assert main(["generate", str(out), "--prompt", "RO", "--max-new-tokens", "5", "--greedy",
                     "--precision", precision]) == 0
        captured = capsys.readouterr()
        assert captured.out.startswith("RO") and "int8 weights: kernel " in captured.err
    one_line_error(capsys, ["generate", str(out), "--precision", "int4"], "holds int8 weights")
    one_line_error(capsys, ["generate", str(out), "--precision", "fp32"], "use --precision auto or int8")


def test_quantize_refuses_a_full_out_a_quantised_source_and_bad_groups(float_checkpoint, tmp_path, capsys):
    src = str(float_checkpoint / "float")
    out = tmp_path / "int4"
    assert main(["quantize", src, "--bits", "4", "--group-size", "32", "--head", "--embedding", "--out", str(out)]) == 0
    assert "int4 (group 32), blocks + head + embedding" in capsys.readouterr().out
    one_line_error(capsys, ["quantize", src, "--bits", "8", "--out", str(out)], "already exists and is not empty")
    assert main(["quantize", src, "--bits", "8", "--out", str(out), "--force"]) == 0
    capsys.readouterr()
    one_line_error(capsys, ["quantize", str(out), "--bits", "4", "--out", str(tmp_path / "again")], "already quantised")
    one_line_error(capsys, ["quantize", src, "--bits", "4", "--out", str(tmp_path / "g")],
                   "group_size=128 does not divide the input width 32")
    one_line_error(capsys, ["quantize", src, "--bits", "4", "--group-size", "48", "--out", str(tmp_path / "g")],
                   "quantization.group_size must be one of 32, 64, 128, 256")


def test_precision_int4_quantises_a_float_checkpoint_as_it_loads(float_checkpoint, capsys):
    assert main(["evaluate", str(float_checkpoint / "float"), "--precision", "int4", "--batches", "1", "--json"]) == 0
    captured = capsys.readouterr()
    assert "int4 weights: kernel " in captured.err and '"val_ppl"' in captured.out


def test_a_quantised_checkpoint_cannot_be_trained_from_or_exported(float_checkpoint, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(float_checkpoint / "float"), "--bits", "8", "--out", str(out)]) == 0
    recipe = {"model": {"num_layers": 2, "num_heads": 2, "embed_dim": 32, "max_seq_len": 32},
              "data": {"path": str(float_checkpoint / "text.txt")},
              "train": {"max_steps": 2, "batch_size": 2, "seq_len": 16, "precision": "fp32", "init_from": str(out)}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    capsys.readouterr()
    one_line_error(capsys, ["train", str(tmp_path / "recipe.yaml"), "--out", str(tmp_path / "run")],
                   "is a quantised checkpoint (int8, blocks): train.init_from (fine-tuning) needs float weights")
    one_line_error(capsys, ["export", str(out), "--out", str(tmp_path / "hf")], "export needs float weights")
    shutil.copytree(out, tmp_path / "run" / "checkpoint")  # a run whose checkpoint was replaced by a quantised one
    one_line_error(capsys, ["train", "--out", str(tmp_path / "run"), "--resume"],
                   "resuming a run needs float weights")

"""The translation task end to end on a tiny synthetic corpus: train, resume, best/averaged checkpoints,
``tokenloom translate`` and ``tokenloom evaluate`` for a translation model, and their bad input."""

import json
import random

import pytest
import yaml

from tokenloom.checkpoint import load_model, load_tokenizer, read_config
from tokenloom.cli.main import main

WORDS = "red blue green house dog cat runs sleeps the a big small".split()


def _corpus(root, name, n, seed):
    """'source' sentences and their 'translation': the same words reversed, upper-cased."""
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(2, 6))
        src.append(" ".join(words))
        tgt.append(" ".join(w.upper() for w in reversed(words)))
    (root / f"{name}.xx").write_text("\n".join(src) + "\n")
    (root / f"{name}.yy").write_text("\n".join(tgt) + "\n")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("translation")
    for name, n, seed in (("train", 400, 0), ("val", 30, 1), ("test", 20, 2)):
        _corpus(root, name, n, seed)
    recipe = {
        "task": "translation",
        "model": {"encoder_layers": 1, "decoder_layers": 1, "num_heads": 2, "embed_dim": 32, "dropout": 0.0,
                  "norm_placement": "pre"},
        "data": {"dir": str(root), "source_lang": "xx", "target_lang": "yy", "test": ["test"], "vocab_size": 300,
                 "max_source_len": 32, "max_target_len": 32, "max_tokens": 512, "bleu_sentences": 10},
        "train": {"max_steps": 12, "lr": 3e-3, "warmup_steps": 2, "schedule": "inverse_sqrt", "eval_every": 6,
                  "eval_batches": 2, "checkpoint_every": 4, "precision": "fp32", "label_smoothing": 0.1,
                  "keep_best": "val_loss", "average_last": 3},
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(root / "recipe.yaml"), "--out", str(root / "run")]) == 0
    return root


def test_training_writes_best_averaged_and_metrics(run):
    records = [json.loads(line) for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [6, 12] and all("val_bleu" in r for r in evals)
    # the part of the validation split the figures cover: 30 pairs in token-count batches of 512
    assert all(r["eval_batches"] == min(2, r["eval_split_batches"]) and r["eval_split_batches"] >= 1 for r in evals)
    best = read_config(run / "run" / "best")["best"]
    assert best["metric"] == "val_loss" and best["value"] == min(r["val_loss"] for r in evals)
    averaged = read_config(run / "run" / "averaged")["averaged"]
    assert averaged == ["step-00000004", "step-00000008", "step-00000012"]
    model, config = load_model(run / "run" / "averaged")
    assert config["task"] == "translation" and type(model).__name__ == "EncoderDecoder"
    tok = load_tokenizer(run / "run")
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2) and tok.eos_token == "</s>"


def test_resume_is_exact(run, tmp_path):
    """Stop after 8 of 12 steps, resume: the same weights as the uninterrupted run (the batch order and the
    data position are part of the checkpoint)."""
    import torch

    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["train"].update(average_last=0, keep_best=None, eval_every=0)
    recipe["data"]["bleu"] = False
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(tmp_path / "r.yaml"), "--out", str(tmp_path / "full")]) == 0
    assert main(["train", str(tmp_path / "r.yaml"), "--out", str(tmp_path / "part"),
                 "--set", "train.stop_after_steps=8"]) == 0
    assert main(["train", "--out", str(tmp_path / "part"), "--resume"]) == 0
    a, _ = load_model(tmp_path / "full")
    b, _ = load_model(tmp_path / "part")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_translate_stdin_and_files(run, tmp_path, capsys, monkeypatch):
    import io

    (tmp_path / "in.xx").write_text("red dog\n\nthe big cat sleeps\n")
    assert main(["translate", str(run / "run"), "--input", str(tmp_path / "in.xx"), "--output",
                 str(tmp_path / "out.yy"), "--beam", "2"]) == 0
    lines = (tmp_path / "out.yy").read_text().split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # empty input line -> empty output line
    assert f"wrote 3 line(s) (2 translated, 1 empty) to {tmp_path / 'out.yy'}" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO("red dog\nthe big cat sleeps\n"))
    capsys.readouterr()
    assert main(["translate", str(run / "run"), "--beam", "2"]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == [lines[0], lines[2]]


def test_evaluate_split_and_files(run, tmp_path, capsys):
    capsys.readouterr()
    assert main(["evaluate", str(run / "run"), "--split", "test", "--beam", "1", "--json",
                 "--metrics", "bleu", "chrf", "exact_match", "--output", str(tmp_path / "hyp")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"bleu", "chrf", "exact_match"} <= result.keys() and "tok:13a" in result["signatures"]["bleu"]
    assert len((tmp_path / "hyp").read_text().splitlines()) == 20
    assert main(["evaluate", str(run / "run"), "--source", str(run / "test.xx"), "--reference",
                 str(run / "test.yy"), "--beam", "1", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["bleu"] == result["bleu"]


@pytest.mark.parametrize("args, message", [
    (["evaluate", "{run}", "--metrics", "blue"], "did you mean 'bleu'"),
    (["evaluate", "{run}", "--split", "nosuch"], "not found"),
    (["evaluate", "{run}", "--source", "{root}/test.xx"], "--source and --reference go together"),
    (["evaluate", "{run}", "--source", "{root}/test.xx", "--reference", "{root}/val.yy"], "20 lines but"),
    (["translate", "{run}", "--input", "{root}/missing.txt"], "input file not found"),
    (["translate", "{run}", "--beam", "0"], "--beam must be >= 1"),
])
def test_bad_input_is_one_line(run, capsys, args, message):
    args = [a.format(run=run / "run", root=run) for a in args]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_misaligned_training_files_are_named(run, tmp_path, capsys):
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    (tmp_path / "train.xx").write_text("a b\nc d\ne f\n")
    (tmp_path / "train.yy").write_text("B A\nD C\n")
    recipe["data"].update(dir=str(tmp_path), test=[])
    (tmp_path / "val.xx").write_text("a\n")
    (tmp_path / "val.yy").write_text("A\n")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    capsys.readouterr()
    assert main(["train", str(tmp_path / "r.yaml"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "train.xx" in err and "train.yy" in err and "3" in err and "2" in err and err.count("\n") == 1


def test_translate_refuses_a_language_model(tmp_path, capsys):
    from tokenloom import GPT, GPTConfig
    from tokenloom.checkpoint import write_checkpoint
    from tokenloom.data import create_tokenizer
    from tokenloom.models.factory import model_config_to_dict

    model = GPT(GPTConfig(vocab_size=10, num_layers=1, num_heads=1, embed_dim=8, max_seq_len=8))
    write_checkpoint(tmp_path / "lm", model, {"model": model_config_to_dict("gpt", model.config)},
                     create_tokenizer("char", "abcdefghij"))
    capsys.readouterr()
    assert main(["translate", str(tmp_path / "lm"), "--input", str(tmp_path / "lm" / "config.yaml")]) == 2
    assert "needs an encoder-decoder" in capsys.readouterr().err


def test_bundled_checkpoint_translates(tmp_path, capsys):
    """checkpoints/multi30k-de-en (BLEU 41.3 on test2016 with beam 5) works right after install."""
    from pathlib import Path

    bundle = Path(__file__).resolve().parents[2] / "checkpoints" / "multi30k-de-en"
    (tmp_path / "in.de").write_text("Zwei Hunde spielen im Schnee.\n")
    capsys.readouterr()
    assert main(["translate", str(bundle), "--input", str(tmp_path / "in.de"), "--beam", "2"]) == 0
    assert "dogs" in capsys.readouterr().out

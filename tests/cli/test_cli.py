import json
import subprocess
import sys

import pytest
import yaml

from tokenloom.cli.main import main

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\n\nJULIET:\nAy me.\n" * 60


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    (root / "corpus.txt").write_text(TEXT)
    recipe = {
        "model": {"num_layers": 2, "num_heads": 2, "embed_dim": 32, "max_seq_len": 64},
        "data": {"path": str(root / "corpus.txt")},
        "train": {"max_steps": 40, "batch_size": 8, "seq_len": 32, "lr": 3e-3, "warmup_steps": 5,
                  "eval_every": 20, "eval_batches": 2, "checkpoint_every": 20, "precision": "fp32"},
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["train", str(root / "recipe.yaml"), "--out", str(root / "run")]) == 0
    return root


def test_train_writes_checkpoint_and_metrics(trained):
    ckpt = trained / "run" / "checkpoint"
    for name in ("config.yaml", "model.safetensors", "tokenizer.json", "trainer_state.pt"):
        assert (ckpt / name).is_file()
    records = [json.loads(line) for line in (trained / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 40 and "val_loss" in records[-1]


def test_generate_prints_prompt_and_continuation(trained, capsys):
    assert main(["generate", str(trained / "run"), "--prompt", "ROMEO:", "--max-new-tokens", "30",
                 "--seed", "1", "--temperature", "0.8", "--top-k", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ROMEO:") and len(out) >= len("ROMEO:") + 30


def test_generate_same_seed_same_text(trained, capsys):
    args = ["generate", str(trained / "run"), "--prompt", "J", "--max-new-tokens", "40", "--seed", "3"]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first


def test_generate_num_samples_and_stop(trained, capsys):
    assert main(["generate", str(trained / "run"), "--prompt", "R", "--max-new-tokens", "60", "--greedy",
                 "--num-samples", "2", "--stop", "\n"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- sample") == 2
    first = out.split("--- sample 2 ---")[0].split("--- sample 1 ---\n")[1]
    assert first.rstrip("\n").count("\n") == 0  # stopped at the first newline


def test_stop_takes_the_backslash_escapes_a_shell_passes_literally(trained, capsys):
    # bash passes --stop "\n\n" as backslash, n, backslash, n: read as a blank line, the generation stops at the
    # first one (the corpus has one every few lines), where the literal four characters would never match
    args = ["generate", str(trained / "run"), "--prompt", "ROMEO:", "--max-new-tokens", "300", "--greedy"]
    assert main([*args, "--stop", r"\n\n"]) == 0
    stopped = capsys.readouterr().out
    assert stopped.count("\n\n") == 1 and stopped.rstrip("\n").count("\n\n") == 0, stopped
    assert main(args) == 0
    assert len(capsys.readouterr().out) > len(stopped)


def test_unescape_reads_the_four_escapes_and_leaves_other_backslashes():
    from tokenloom.cli.commands import unescape

    assert unescape(r"\n\n") == "\n\n" and unescape(r"a\tb\r") == "a\tb\r"
    assert unescape(r"\\n") == "\\n" and unescape(r"\x\\") == r"\x" + "\\" and unescape("ROMEO:") == "ROMEO:"


def test_generate_beyond_the_context_slides_a_window(trained, capsys):
    assert main(["generate", str(trained / "run"), "--prompt", "ROMEO:", "--max-new-tokens", "150",
                 "--seed", "2"]) == 0
    out = capsys.readouterr().out
    assert len(out) == len("ROMEO:") + 150 + 1  # the model's context is 64; char-level: one token a char


def test_evaluate_reports_loss_and_speed(trained, capsys):
    assert main(["evaluate", str(trained / "run"), "--json", "--batches", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["val_loss"] > 0 and result["val_ppl"] > 1 and result["tokens_per_s"] > 0


def test_resume_continues(trained, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume"]) == 0  # nothing changed: nothing to note
    assert "note:" not in capsys.readouterr().err
    assert main(["train", "--out", str(run), "--resume", "--set", "train.max_steps=45"]) == 0
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 45
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and (
        "note: resuming keeps the learning-rate schedule of the first run (max_steps 40 -> 45: steps after 40 run at "
        "min_lr 0.0003); to train on a new schedule, start a new run from these weights: tokenloom train RECIPE --out "
        f"NEW --set train.init_from={run}\n") in err
    lrs = [r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "lr" in r]
    assert lrs[-1] == pytest.approx(3e-4)  # the floor of the first run's schedule
    # the end-of-training line names the validation figure by the part of the split training evaluated
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = next(r for r in reversed(records) if "val_loss" in r)
    batches, total = last["eval_batches"], last["eval_split_batches"]
    name = "val_loss[whole split]" if batches == total else f"val_loss[{batches} of {total} batches]"
    assert "step 45: train_loss " in err and f"  {name} {last['val_loss']:.4f}  (max_steps, " in err


@pytest.mark.parametrize("args, message", [
    (["generate", "{run}", "--prompt", "ROMEO: \u00e9\u20ac"], "characters outside the vocabulary: '\u00e9', '\u20ac'"),
    (["generate", "{run}", "--prompt", "ROMEO: " * 10], "leaves no room in the model's context of 64"),
    (["generate", "{root}/nowhere"], "checkpoint not found"),
    (["train", "{root}/recipe.yaml", "--out", "{run}"], "already holds a checkpoint"),
    (["train", "{root}/recipe.yaml", "--out", "{root}/x", "--set", "train.max_stpes=3"], "did you mean 'max_steps'"),
    (["train", "{root}/missing.yaml", "--out", "{root}/x"], "config file not found"),
])
def test_bad_input_is_one_line(trained, capsys, args, message):
    args = [a.format(run=trained / "run", root=trained) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_corrupt_checkpoint_subprocess(trained, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained / "run", run)
    weights = run / "checkpoint" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])
    proc = subprocess.run([sys.executable, "-m", "tokenloom", "generate", str(run)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "truncated or corrupt" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1


def test_generate_with_beam_search(trained, capsys):
    import torch

    from tokenloom.checkpoint import load_model, load_tokenizer
    from tokenloom.generation import GenerationConfig, beam_search

    capsys.readouterr()
    assert main(["generate", str(trained / "run"), "--prompt", "ROMEO:", "--beam", "4", "--max-new-tokens", "20",
                 "--num-samples", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- hypothesis") == 2 and "ROMEO:" in out
    model, _ = load_model(trained / "run")
    tok = load_tokenizer(trained / "run")
    ids = torch.tensor([tok.encode("ROMEO:")])
    best = beam_search(model, ids, GenerationConfig(max_new_tokens=20, do_sample=False, num_beams=4))
    expected = "ROMEO:" + tok.decode(best.sequences[0, 0, ids.shape[1]:].tolist())
    first = out.split("--- hypothesis 2")[0].split("---\n", 1)[1]
    assert first == expected + "\n"  # the printed best hypothesis is beam search's best


@pytest.mark.parametrize("argv, error", [
    (["--temperature", "1e-38"], "temperature must be 0 (greedy) or a finite number >= 1.18e-38"),
    (["--seed", str(2 ** 64)], "seed must be an integer in [0, 2^64) or None, got 18446744073709551616"),
    (["--top-p", "1e-300"], None),  # 0 in float32: the top token stays
    (["--seed", str(2 ** 64 - 1), "--num-samples", "2"], None),  # the second sample's seed wraps into range
])
def test_extreme_sampling_settings_are_one_line_errors_or_work(trained, capsys, argv, error):
    """These printed tracebacks (exit 1) from inside the sampler (issue 23)."""
    code = main(["generate", str(trained / "run"), "--prompt", "ab", "--max-new-tokens", "4", *argv])
    err = capsys.readouterr().err
    if error is None:
        assert code == 0, err
    else:
        assert code == 2 and err.startswith("error: ") and error in err and "Traceback" not in err


def test_a_run_stopped_before_any_figure_prints_none_not_nan(tmp_path, capsys, monkeypatch):
    # Ctrl-C before the first step and evaluation: the summary has no val_loss and a nan train_loss
    (tmp_path / "corpus.txt").write_text(TEXT)
    recipe = {"model": {"num_layers": 1, "num_heads": 2, "embed_dim": 16, "max_seq_len": 32},
              "data": {"path": str(tmp_path / "corpus.txt")},
              "train": {"max_steps": 3, "batch_size": 2, "seq_len": 16, "precision": "fp32"}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    monkeypatch.setattr("tokenloom.training.trainer.Trainer.fit", lambda self: {
        "step": 0, "train_loss": float("nan"), "stopped_by": "interrupt", "seconds": 0.4, "device": "cpu"})
    assert main(["train", str(tmp_path / "recipe.yaml"), "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "step 0: (interrupt, 0s)" in err and "nan" not in err

"""``tokenloom bench attention``: one row per backend, mode and length, measured in worker processes; bad
arguments are one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenloom.cli.main import main
from tokenloom.hardware import machine


def test_bench_attention_writes_a_table_and_a_plot(tmp_path, capsys):
    out = tmp_path / "att"
    assert main(["bench", "attention", "--lengths", "48", "--backends", "sdpa", "math", "performer", "linformer",
                 "--heads", "2", "--head-dim", "8", "--repeats", "1", "--math-max-length", "16", "--threads", "1",
                 "--out", str(out)]) == 0
    table, measured = (out / "attention-bench.md").read_text().split("\n\n")
    lines = table.splitlines()[2:]
    assert len(lines) == 3 + 4  # causal: sdpa, math, performer; bidirectional: + linformer
    assert measured.startswith("Measured on: ") and "1 threads" in measured  # the workers' --threads
    assert measured.startswith(f"Measured on: {machine().cpu} (")
    assert sum("math | 48 | skipped" in line for line in lines) == 2  # above --math-max-length
    performer = [line for line in lines if "| performer |" in line]
    assert all(line.split("|")[-2].strip() not in ("-", "") for line in performer)  # the error is measured
    assert (out / "attention-bench.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "speedup vs sdpa" in printed and f"torch {machine().torch}" in printed


@pytest.mark.parametrize("argv,message", [
    (["--backends", "flash9"], "unknown attention backend 'flash9'"),
    (["--lengths", "0"], "--lengths must be positive"),
    (["--heads", "0"], "--heads must be >= 1"),
])
def test_bench_attention_bad_arguments(argv, message, capsys):
    assert main(["bench", "attention", *argv]) != 0
    assert message in capsys.readouterr().err


def test_bench_roofline_prints_the_machines_limits(capsys):
    assert main(["bench", "roofline", "--size", "128", "--gib", "0.01", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for quantity in ("matmul peak, float32", "matmul peak, bfloat16", "memory read bandwidth", "ridge point"):
        assert quantity in out
    assert out.startswith(machine().describe())
    assert main(["bench", "roofline", "--size", "8"]) != 0
    assert "--size must be >= 64" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["train", "generate"])
def test_bench_train_and_generate_hand_their_arguments_to_the_benchmark(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", name, "--help"])
    assert exit_.value.code == 0
    assert f"usage: tokenloom bench {name}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["bench", name, "--shapes", "bogus"])
    assert exit_.value.code == 2
    assert "unknown shape 'bogus'" in capsys.readouterr().err


def test_other_commands_still_refuse_unknown_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "roofline", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_bench_generate_refuses_a_model_that_is_not_a_gpt(capsys):
    translation = Path(__file__).resolve().parents[2] / "checkpoints" / "multi30k-de-en"  # the bundled seq2seq
    assert main(["bench", "generate", str(translation)]) == 2
    assert "holds a 'seq2seq' model; bench generate measures GPT models" in capsys.readouterr().err

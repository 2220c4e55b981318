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
                 "window", "--window", "8", "--heads", "2", "--head-dim", "8", "--repeats", "1",
                 "--math-max-length", "16", "--threads", "1", "--out", str(out)]) == 0
    table, notes, measured = (out / "attention-bench.md").read_text().split("\n\n")
    lines = table.splitlines()[2:]
    assert len(lines) == 4 + 5  # causal: sdpa, math, performer, window; bidirectional: + linformer
    # 48 positions are too few for window 8's blocks: sdpa with the dense windowed mask, said so
    assert sum("| window (dense) | 48 |" in line for line in lines) == 2
    assert notes.startswith("window: sliding-window attention, W = 8")
    assert measured.startswith("Measured on: ") and "1 threads" in measured  # the workers' --threads
    assert measured.startswith(f"Measured on: {machine().cpu} (")
    assert sum("math | 48 | skipped" in line for line in lines) == 2  # above --math-max-length
    performer = [line for line in lines if "| performer |" in line]
    assert all(line.split("|")[-2].strip() not in ("-", "") for line in performer)  # the error is measured
    assert (out / "attention-bench.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "speedup vs sdpa" in printed and f"torch {machine().torch}" in printed


def test_bench_attention_window_rows_comma_lists_and_k_lengths(tmp_path, capsys):
    out = tmp_path / "att"
    assert main(["bench", "attention", "--backends", "sdpa,window", "--lengths", "32,1k", "--window", "32",
                 "--mode", "causal", "--sdpa-max-length", "64", "--heads", "1", "--head-dim", "8", "--repeats", "1",
                 "--threads", "1", "--out", str(out)]) == 0
    table, notes, _ = (out / "attention-bench.md").read_text().split("\n\n")
    header, _, *lines = table.splitlines()
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert "ms / 1k positions" in columns
    rows = {tuple(cell.strip() for cell in line.strip("|").split("|")[1:3]): line for line in lines}
    assert list(rows) == [("sdpa", "32"), ("sdpa", "1024"), ("window (dense)", "32"), ("window", "1024")]  # 1k
    assert "skipped: above --sdpa-max-length 64" in rows["sdpa", "1024"]
    banded = [cell.strip() for cell in rows["window", "1024"].strip("|").split("|")]
    assert float(banded[columns.index("rel. error")]) < 1e-5  # block-wise = the dense windowed attention
    assert float(banded[columns.index("ms / 1k positions")]) > 0
    speedup = [cell.strip() for cell in rows["window (dense)", "32"].strip("|").split("|")]
    assert speedup[columns.index("speedup vs sdpa")].endswith("x")  # against sdpa at the same length
    assert "W = 32" in notes
    assert (out / "attention-bench.png").stat().st_size > 0


@pytest.mark.parametrize("argv,message", [
    (["--backends", "flash9"], "--backends: unknown attention backend 'flash9'"),
    (["--backends", "sdpa,flash9"], "--backends: unknown attention backend 'flash9'"),
    (["--lengths", "0"], "--lengths must be positive integers, optionally with a k suffix (1k = 1024), got '0'"),
    (["--lengths", "1k,4q"], "--lengths must be positive integers, optionally with a k suffix (1k = 1024), got '4q'"),
    (["--lengths", "1k", "-2"], "got '-2'"),
    (["--lengths", ","], "--lengths must be positive integers"),
    (["--heads", "0"], "--heads must be >= 1"),
    (["--window", "0"], "--window must be >= 1"),
])
def test_bench_attention_bad_arguments(argv, message, capsys):
    assert main(["bench", "attention", *argv]) != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


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

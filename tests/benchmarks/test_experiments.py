"""The synthetic experiments in ``benchmarks/`` (issue 29): their data is what they claim, and their cores run a
few steps end to end and return the structure the tables, JSON and plots read."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


parity = _load("exp_parity")
recall = _load("exp_recall")


def test_parity_data_sets_the_first_n_entries_and_labels_their_parity():
    gen = torch.Generator().manual_seed(0)
    x, y, n = parity.parity_data(512, 64, gen)
    assert x.shape == (512, 64) and y.shape == (512,) and n.min() >= 1 and n.max() <= 64
    for row, label, count in zip(x.tolist(), y.tolist(), n.tolist(), strict=True):
        assert all(v in (-1.0, 1.0) for v in row[:count]) and all(v == 0.0 for v in row[count:])
        assert label == row.count(1.0) % 2
    assert 0.4 < y.mean() < 0.6 and len(set(n.tolist())) > 40
    x, y, n = parity.parity_data(64, 64, gen, n=5)
    assert (n == 5).all() and ((x != 0).sum(dim=1) == 5).all()


def test_parity_networks_step_counts():
    x, _, _ = parity.parity_data(16, 8, torch.Generator().manual_seed(0))
    for kind, expected in (("one", 1.0), ("fixed", 6.0)):
        logits, ponder, steps = parity.PonderNet(kind, max_steps=6)(x)
        assert logits.shape == (16,) and (steps == expected).all() and (ponder == expected).all()
    # ACT: a halting bias of 10 halts everything at the first step (N = 1, R = 1); -10 runs to M = 6
    _, ponder, steps = parity.PonderNet("act", max_steps=6, halting_bias=10.0)(x)
    assert (steps == 1).all() and torch.allclose(ponder, torch.full_like(ponder, 2.0))
    _, ponder, steps = parity.PonderNet("act", max_steps=6, halting_bias=-10.0)(x)
    assert (steps == 6).all() and (ponder > 6).all() and (ponder <= 7).all()


def test_parity_run_returns_a_row_per_length_with_the_three_kinds(tmp_path, capsys):
    rows = parity.run([2, 4], steps=3, max_steps=3, hidden=8, eval_per_n=4, log=lambda *a, **k: None)
    assert [r["length"] for r in rows] == [2, 4]
    for row in rows:
        for kind in parity.KINDS:
            r = row[kind]
            assert r["updates"] == 3 and 0.0 <= r["accuracy"] <= 1.0
            assert sorted(int(n) for n in r["steps_per_n"]) == list(range(1, row["length"] + 1))
    assert rows[0]["one"]["steps"] == 1.0 and rows[0]["fixed"]["steps"] == 3.0
    lines = parity.tables(rows, 3).splitlines()
    for length in (2, 4):
        mine = [line.split(" | ")[1] for line in lines if line.startswith(f"| {length} | ")]
        assert len(mine) == 5 and mine[0][0] in "01"  # the summary row, then four rows by n
        assert mine[1:] == ["ACT accuracy", "1 step accuracy", "fixed M accuracy", "ACT steps N"]
    parity.main(["--lengths", "2", "--steps", "2", "--max-steps", "2", "--hidden", "4", "--eval-per-n", "2",
                 "--json", str(tmp_path / "p.json")])
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["rows"][0]["act"]["updates"] == 2 and "cpu" in saved["machine"]
    assert "| max length L |" in capsys.readouterr().out


def test_recall_data_puts_the_key_first_and_the_query_last():
    ids, keys = recall.recall_data(64, 10, torch.Generator().manual_seed(0))
    assert ids.shape == (64, 12)
    assert torch.equal(ids[:, 0], keys) and (keys < recall.KEYS).all() and len(set(keys.tolist())) > 8
    fillers = ids[:, 1:-1]
    assert ((fillers >= recall.KEYS) & (fillers < recall.QUERY)).all()
    assert (ids[:, -1] == recall.QUERY).all() and ids.max() < recall.VOCAB


def test_recall_curriculum_opens_the_gaps_shortest_first():
    gaps = [512, 8, 64, 16]
    seen = [recall.curriculum_gaps(gaps, step, 100, 0.5) for step in range(100)]
    assert seen[0] == [8] and seen[12] == [8] and seen[13] == [8, 16] and seen[37] == [8, 16, 64]
    assert seen[38] == seen[50] == seen[99] == [8, 16, 64, 512]
    assert recall.curriculum_gaps(gaps, 0, 100, 0.0) == [8, 16, 64, 512]


def test_recall_models_are_about_the_same_size_and_the_run_reports_each_gap(tmp_path, capsys):
    sizes = {name: recall.parameters(m) for name, m in recall.create_models(512).items()}
    assert set(sizes) == {"GPT", "LSTM"} and all(100_000 <= s <= 200_000 for s in sizes.values())
    assert abs(sizes["GPT"] - sizes["LSTM"]) / sizes["GPT"] < 0.1
    results = recall.run([2, 5], steps=2, batch=4, eval_count=8, gpt_dim=16, lstm_dim=16, log=lambda *a, **k: None)
    for r in results.values():
        assert r["steps"] == 2 and set(r["accuracy"]) == {2, 5}
        assert all(a in {i / 8 for i in range(9)} for a in r["accuracy"].values())
    assert "| 5 |" in recall.table([2, 5], results)
    recall.main(["--gaps", "3", "--steps", "1", "--batch", "2", "--eval", "4", "--gpt-dim", "8", "--lstm-dim", "8",
                 "--json", str(tmp_path / "r.json")])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["gaps"] == [3] and set(saved["results"]) == {"GPT", "LSTM"}
    assert "| gap g |" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--lengths", "65"], ["--lengths", "0"]])
def test_parity_rejects_lengths_beyond_the_vector(bad):
    with pytest.raises(SystemExit):
        parity.main(bad)

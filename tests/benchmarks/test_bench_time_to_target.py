"""benchmarks/bench_time_to_target.py: the curve read from metrics.jsonl (training seconds of the step an evaluation
follows), the first time under each target, and a tiny recipe end to end with a variant and --fit-steps (max_steps
fitted to the budget from a timed start) or --clock (the schedule over the budget's training time)."""

from __future__ import annotations

import json

import yaml

from tests.benchmarks.test_experiments import _load
from tests.training.test_trainer import recipe

bench = _load("bench_time_to_target")


def test_the_curve_pairs_each_evaluation_with_the_training_seconds_of_its_step(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": 5, "loss": 3.0, "train_s": 1.5}, {"step": 10, "loss": 2.0, "train_s": 3.0},
               {"step": 10, "val_loss": 2.5}, {"step": 15, "loss": 1.8, "train_s": 4.5},
               {"step": 20, "loss": 1.7, "train_s": 6.0}, {"step": 20, "val_loss": 1.9}]
    metrics.write_text("\n".join(json.dumps(r) for r in records))
    curve = bench.read_curve(metrics)
    assert curve == [(10, 3.0, 2.5), (20, 6.0, 1.9)]
    assert bench.time_to(curve, 2.5) == 3.0 and bench.time_to(curve, 2.0) == 6.0 and bench.time_to(curve, 1.0) is None


def test_a_recipe_and_a_variant_run_to_their_budget(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    cfg = recipe(tmp_path, max_steps=20, warmup_steps=2)
    path.write_text(yaml.safe_dump({"task": "lm", **cfg}))
    out = tmp_path / "rows.json"
    bench.main([str(path), "--minutes", "0.05", "--eval-every", "5", "--targets", "5.0", "0.01", "--threads", "1",
                "--variant", "muon", "train.optimizer=muon", "--fit-steps", "--keep", str(tmp_path / "runs"),
                "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["base", "muon"]
    for row in rows:
        assert row["minutes_to"]["0.01"] is None  # never reached
        assert row["minutes_to"]["5.0"] is not None and row["minutes_to"]["5.0"] <= row["train_minutes"]
        fitted = [o for o in row["overrides"] if o.startswith("train.max_steps=")]  # --fit-steps
        assert len(fitted) == 1 and int(fitted[0].split("=")[1]) >= 1
        assert row["steps"] == row["curve"][-1][0] <= int(fitted[0].split("=")[1])  # the last evaluation counts
    assert "train.optimizer=muon" in rows[1]["overrides"]
    printed = capsys.readouterr().out
    assert "base" in printed and "muon" in printed


def test_the_clock_runs_each_variant_to_the_whole_budget(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"task": "lm", **recipe(tmp_path, max_steps=20, warmup_steps=2)}))
    out = tmp_path / "rows.json"
    bench.main([str(path), "--minutes", "0.05", "--eval-every", "1000", "--targets", "9.0", "--threads", "1",
                "--variant", "wsd", "train.schedule=wsd", "--only", "wsd", "--clock", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert {"train.schedule_clock=minutes", f"train.max_steps={bench.CLOCK_CAP}"} <= set(row["overrides"])
    assert row["train_minutes"] >= 0.05  # stopped by its 3 seconds of training time (max_steps is only a cap)
    assert row["steps"] == row["curve"][-1][0] < bench.CLOCK_CAP  # the final evaluation, with the last step's time

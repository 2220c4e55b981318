"""Sweeps: expansion, validation, running, resuming an interrupted sweep, failures, reports, scaling fits."""

import csv
import json

import pytest
import yaml

from tokenloom.cli.main import main
from tokenloom.errors import ConfigError
from tokenloom.experiments.report import fit_scaling, sweep_report
from tokenloom.experiments.sweep import load_sweep, run_sweep

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 40)


def write(tmp_path, sweep, **recipe_train):
    (tmp_path / "corpus.txt").write_text(TEXT)
    recipe = {"model": {"num_layers": 1, "num_heads": 2, "embed_dim": 16, "max_seq_len": 32, "dropout": 0.0},
              "data": {"path": str(tmp_path / "corpus.txt")},
              "train": {"max_steps": 3, "batch_size": 2, "seq_len": 16, "warmup_steps": 1, "eval_every": 0,
                        "eval_batches": 1, "checkpoint_every": 0, "log_every": 1, "precision": "fp32",
                        **recipe_train}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"recipe": "recipe.yaml", **sweep}, sort_keys=False))
    return path


def test_grid_times_runs_times_seeds(tmp_path):
    sweep = load_sweep(write(tmp_path, {"set": {"train.lr": 0.002},
                                        "grid": {"model.num_layers": [1, 2], "model.norm_placement": ["pre", "post"]},
                                        "runs": [{"train.warmup_steps": 0}, {"train.warmup_steps": 2}],
                                        "seeds": [1, 2]}))
    assert len(sweep.points) == 2 * 2 * 2 * 2
    first = sweep.points[0]
    assert first.name == "num_layers=1,norm_placement=pre,warmup_steps=0,seed=1"
    assert first.all_overrides(sweep.shared) == ["train.lr=0.002", "model.num_layers=1", "model.norm_placement=pre",
                                                 "train.warmup_steps=0", "train.seed=1"]
    assert sweep.keys == ["model.num_layers", "model.norm_placement", "train.warmup_steps", "train.seed"]
    assert len({p.name for p in sweep.points}) == 16
    only_runs = load_sweep(write(tmp_path, {"runs": [{"model.embed_dim": 16}, {"model.embed_dim": 32}]}))
    assert [p.name for p in only_runs.points] == ["embed_dim=16", "embed_dim=32"]


def test_bad_sweeps_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'model.norm_placment' \(did you mean 'norm_placement'\?\)"):
        load_sweep(write(tmp_path, {"grid": {"model.norm_placment": ["pre"]}}))
    with pytest.raises(ConfigError, match="the sweep is empty"):
        load_sweep(write(tmp_path, {"grid": {}}))
    with pytest.raises(ConfigError, match=r"grid.train.lr must be a non-empty list"):
        load_sweep(write(tmp_path, {"grid": {"train.lr": []}}))
    with pytest.raises(ConfigError, match=r"unknown sweep key 'seed' \(did you mean 'seeds'\?\)"):
        load_sweep(write(tmp_path, {"grid": {"train.lr": [0.1]}, "seed": [1]}))
    path = write(tmp_path, {"grid": {"train.lr": [0.1]}})
    path.write_text(path.read_text().replace("recipe.yaml", "missing.yaml"))
    with pytest.raises(ConfigError, match="recipe missing.yaml not found"):
        load_sweep(path)


def test_a_sweep_runs_records_failures_and_an_interrupted_one_continues(tmp_path):
    # seq_len 64 > max_seq_len 32 passes the recipe check but fails when the data is set up: recorded, not fatal
    path = write(tmp_path, {"grid": {"model.embed_dim": [16, 32]}, "runs": [{"train.seq_len": 16},
                                                                              {"train.seq_len": 64}]})
    out, lines = tmp_path / "out", []
    results = run_sweep(load_sweep(path), out, log=lines.append)
    assert [r["status"] for r in results] == ["done", "failed", "done", "failed"]
    assert "train.seq_len=64 exceeds model.max_seq_len=32" in results[1]["error"]
    assert results[0]["final"]["step"] == 3 and "val_loss" in results[0]["final"] and results[0]["params"] > 0
    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["status"] for r in rows] == ["done", "failed", "done", "failed"]
    assert rows[0]["model.embed_dim"] == "16" and float(rows[0]["val_loss"]) > 0
    assert "failed" in (out / "results.md").read_text()
    # interrupted: one run lost its result (its checkpoint stayed), another never started
    done = out / "embed_dim=16,seq_len=16"
    (done / "result.json").unlink()
    weights_before = (done / "checkpoint" / "model.safetensors").read_bytes()
    import shutil

    shutil.rmtree(out / "embed_dim=32,seq_len=16")
    lines.clear()
    results = run_sweep(load_sweep(path), out, log=lines.append)
    assert [r["status"] for r in results] == ["done", "failed", "done", "failed"]
    assert not any("skipped" in line for line in lines if line.startswith("embed_dim=16,seq_len=16"))
    assert any(line.startswith("embed_dim=32,seq_len=16: done") for line in lines)
    assert (done / "checkpoint" / "model.safetensors").read_bytes() == weights_before  # resumed at its end
    # the failed ones are tried again; the finished ones are skipped
    lines.clear()
    run_sweep(load_sweep(path), out, log=lines.append)
    assert sum("already done, skipped" in line for line in lines) == 2
    assert sum(": failed" in line for line in lines) == 2


def test_length_evaluations_and_reports(tmp_path):
    path = write(tmp_path, {"grid": {"model.position": ["learned", "rope"]}, "seeds": [1, 2],
                            "evaluate": {"seq_lens": [16, 32, 64]}})
    out = tmp_path / "out"
    results = run_sweep(load_sweep(path), out, log=lambda line: None)
    final = results[0]["final"]
    assert final["val_ppl@16"] > 1 and final["val_ppl@32"] > 1
    assert final["val_ppl@64"] != final["val_ppl@64"]  # NaN: longer than the model's context
    written = sweep_report(out)
    assert {p.name for p in written} == {"results.csv", "results.md", "curves.png"}
    text = (out / "results.md").read_text()
    assert "### val_loss by model.position" in text and "| rope | 2 | 0 |" in text
    assert "### val_loss by run, seeds pooled" in text and "collapsed" not in text
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert final["tokens"] == 3 * 2 * 16  # counted by the trainer: steps x batch x window
    # a collapse threshold just under the worst run's loss: that run (only) is counted, and left out of the mean
    worst = max(results, key=lambda r: r["final"]["val_loss"])
    sweep_report(out, collapsed_above=worst["final"]["val_loss"] - 1e-6)
    by_key = (out / "results.md").read_text().split("### val_loss by run")[0]
    rows = [line.split(" | ") for line in by_key.splitlines() if line.startswith(("| learned | 2", "| rope | 2"))]
    assert [int(row[3]) for row in rows] == [int("learned" in worst["name"]), int("rope" in worst["name"])]
    others = [r["final"]["val_loss"] for r in results if r is not worst and r["name"].split(",")[0] in
              worst["name"]]
    assert any(row[4] == f"{others[0]:.4f}" for row in rows)  # the mean of the one that trained
    sweep_report(out, collapsed_above=1e9)
    assert "| learned | 2 | 0 | 0 |" in (out / "results.md").read_text()


def test_set_overrides_shrink_a_sweep_and_the_report_section(tmp_path, capsys):
    path = write(tmp_path, {"grid": {"model.embed_dim": [8, 16]}, "report": {"collapsed_above": 100}})
    sweep = load_sweep(path, ["train.max_steps=2", "train.lr=0.001"])
    assert sweep.shared == {"train.max_steps": 2, "train.lr": 0.001} and sweep.report == {"collapsed_above": 100}
    with pytest.raises(ConfigError, match=r"--set model.embed_dim: the sweep varies this key"):
        load_sweep(path, ["model.embed_dim=32"])
    with pytest.raises(ConfigError, match=r"unknown key 'train.max_step' \(did you mean 'max_steps'\?\)"):
        load_sweep(path, ["train.max_step=2"])
    with pytest.raises(ConfigError, match="must look like key.sub=value"):
        load_sweep(path, ["train.max_steps"])
    (tmp_path / "bad").mkdir()
    with pytest.raises(ConfigError, match=r"report.collapse_above: unknown \(did you mean 'collapsed_above'\?\)"):
        load_sweep(write(tmp_path / "bad", {"grid": {"train.lr": [0.1]}, "report": {"collapse_above": 3}}))
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out), "--set", "train.max_steps=2"]) == 0
    assert json.loads((out / "embed_dim=8" / "result.json").read_text())["final"]["step"] == 2
    assert main(["sweep-report", str(out)]) == 0  # report.collapsed_above from the sweep file (via sweep.json)
    assert "collapsed (> 100)" in (out / "results.md").read_text()
    capsys.readouterr()


def test_fit_scaling_needs_more_sizes_than_parameters(tmp_path, capsys):
    path = write(tmp_path, {"runs": [{"model.embed_dim": 8}, {"model.embed_dim": 16}]})
    out = tmp_path / "out"
    run_sweep(load_sweep(path), out, log=lambda line: None)
    assert main(["fit-scaling", str(out), "--bootstrap", "10"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs at least" in err
    assert main(["sweep-report", str(tmp_path / "nothing")]) == 2
    assert "no sweep directory" in capsys.readouterr().err


def test_fit_scaling_writes_fits_and_plots(tmp_path, monkeypatch):
    """Five sizes (params from the checkpoints); the fit and its files (exponent recovery: test_scaling.py)."""
    path = write(tmp_path, {"runs": [{"model.embed_dim": d, "model.num_heads": 2} for d in (4, 8, 12, 16, 24)]})
    out = tmp_path / "out"
    run_sweep(load_sweep(path), out, log=lambda line: None)
    report = fit_scaling(out, n_boot=20)
    assert len(report["points"]) == 5 and report["points"][0]["compute"] > 0
    assert {"N", "C"} <= set(report["fits"])
    assert json.loads((out / "scaling.json").read_text())["metric"] == "val_loss"
    assert (out / "scaling-params.png").read_bytes()[:4] == b"\x89PNG" and (out / "scaling.md").is_file()


def test_the_sweep_log_names_the_validation_figures_by_the_part_of_the_split_they_cover():
    from tokenloom.experiments.sweep import _report

    lines = []
    final = {"step": 3, "train_loss": 2.0, "val_loss": 1.5, "val_ppl": 4.48, "val_loss@64": 1.6, "eval_batches": 2,
             "eval_split_batches": 2}
    _report({"name": "a", "status": "done", "seconds": 4.0, "final": final}, lines.append)
    assert lines == ["a: done (4s) val_loss[whole split] 1.5000"]

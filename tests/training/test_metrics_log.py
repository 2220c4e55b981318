"""``metrics.jsonl`` tells one run's story once (issue 23, defect 8): a resume after a kill drops the lines of the
steps it replays (those after the checkpoint it continues from) instead of logging them twice, and a fresh run
never appends to an earlier run's file."""

import json
import shutil

import pytest

from tokenloom.cli.main import main
from tokenloom.training import load_run_config, setup_run

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 40


def recipe(tmp_path, **train):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return {
        "model": {"num_layers": 1, "num_heads": 2, "embed_dim": 16, "max_seq_len": 32},
        "data": {"path": str(path)},
        "train": {"max_steps": 8, "batch_size": 4, "seq_len": 16, "lr": 3e-3, "warmup_steps": 2, "eval_every": 4,
                  "eval_batches": 1, "checkpoint_every": 4, "log_every": 1, "precision": "fp32", **train},
    }


def train(config, run_dir, resume=False, overrides=()):
    trainer = setup_run(load_run_config(config, list(overrides)), run_dir, resume=resume, show_progress=False)
    return trainer.fit()


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps(run_dir):
    return [r["step"] for r in records(run_dir) if "loss" in r]


def simulate_kill(run_dir, at_step):
    """What SIGKILL at ``at_step`` leaves: the checkpoint of an earlier step, and metrics.jsonl with the lines logged
    up to ``at_step`` (a run that went on from the checkpoint, cut short)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line)["step"] <= at_step]
    (run_dir / "metrics.jsonl").write_text("".join(kept[:-1]) + kept[-1][:7])  # the last line torn mid-write


def test_resume_after_a_kill_logs_each_step_once(tmp_path):
    cfg = recipe(tmp_path)
    train(cfg, tmp_path / "full")
    # the run checkpointed at step 4, logged steps 5 and 6, and was killed during step 7's line
    shutil.copytree(tmp_path / "full", tmp_path / "killed")
    shutil.rmtree(tmp_path / "killed" / "checkpoint")
    train(cfg, tmp_path / "part", overrides=["train.stop_after_steps=4"])
    shutil.copytree(tmp_path / "part" / "checkpoint", tmp_path / "killed" / "checkpoint")
    simulate_kill(tmp_path / "killed", at_step=7)
    train(cfg, tmp_path / "killed", resume=True)
    assert steps(tmp_path / "killed") == list(range(1, 9))
    full, resumed = records(tmp_path / "full"), records(tmp_path / "killed")
    timing = ("tokens_per_s", "ms_per_step", "elapsed_s", "train_s")
    assert [{k: v for k, v in r.items() if k not in timing} for r in resumed] == \
        [{k: v for k, v in r.items() if k not in timing} for r in full]
    assert not list((tmp_path / "killed").glob("*.tmp"))


def test_resume_keeps_the_lines_up_to_its_checkpoint(tmp_path):
    """Stopped cleanly at step 4 (its checkpoint): nothing to drop; the resumed run appends 5..8."""
    cfg = recipe(tmp_path)
    train(cfg, tmp_path / "r", overrides=["train.stop_after_steps=4"])
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    train(cfg, tmp_path / "r", resume=True)
    assert (tmp_path / "r" / "metrics.jsonl").read_text().startswith(before)
    assert steps(tmp_path / "r") == list(range(1, 9))


def test_resume_from_an_older_checkpoint_in_history(tmp_path):
    """The newest checkpoint is damaged; the resume continues from history (step 4) and drops 5..8."""
    cfg = recipe(tmp_path, keep_checkpoints=2, max_steps=8)
    train(cfg, tmp_path / "r")
    (tmp_path / "r" / "checkpoint" / "model.safetensors").write_bytes(b"torn")
    with pytest.warns(UserWarning, match="damaged"):
        train(cfg, tmp_path / "r", resume=True)
    assert steps(tmp_path / "r") == list(range(1, 9))


def test_a_fresh_run_starts_a_fresh_metrics_file(tmp_path):
    """An earlier run that never reached a checkpoint left metrics.jsonl behind: a new run (no --resume) replaces
    it rather than mixing the two. (A directory with a checkpoint is refused without --resume.)"""
    cfg = recipe(tmp_path)
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n')
    train(cfg, run, overrides=["train.max_steps=3"])
    assert steps(run) == [1, 2, 3] and all(r.get("loss") != 9.0 for r in records(run))
    assert sorted(p.name for p in run.glob("metrics*")) == ["metrics.jsonl"]


def test_the_cli_refuses_a_run_directory_with_a_checkpoint_without_resume(tmp_path, capsys):
    cfg = recipe(tmp_path, max_steps=2)
    train(cfg, tmp_path / "r")
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    import yaml

    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert main(["train", str(tmp_path / "recipe.yaml"), "--out", str(tmp_path / "r")]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before

import contextlib
import os
import signal

import pytest
import torch

from tokenloom.checkpoint import load_model, write_checkpoint
from tokenloom.errors import CheckpointError, DataError
from tokenloom.training import load_run_config, setup_run

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 40)


def recipe(tmp_path, **train):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return {
        "model": {"num_layers": 2, "num_heads": 2, "embed_dim": 32, "max_seq_len": 32, "dropout": 0.1},
        "data": {"path": str(path)},
        "train": {"max_steps": 8, "batch_size": 4, "seq_len": 16, "lr": 3e-3, "warmup_steps": 2,
                  "eval_every": 4, "eval_batches": 2, "checkpoint_every": 4, "log_every": 2,
                  "precision": "fp32", **train},
    }


def run(config_dict, run_dir, resume=False, overrides=()):
    trainer = setup_run(load_run_config(config_dict, list(overrides)), run_dir, resume=resume, show_progress=False)
    summary = trainer.fit()
    return trainer, summary


def params(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-autocast"])
def test_resume_is_exact(tmp_path, precision):
    cfg = recipe(tmp_path, precision=precision, grad_accum_steps=2)
    full, whole = run(cfg, tmp_path / "full")
    _, first = run(cfg, tmp_path / "split", overrides=["train.stop_after_steps=4"])
    assert first["step"] == 4 and first["stopped_by"] == "stop_after_steps"
    resumed, rest = run(cfg, tmp_path / "split", resume=True)
    assert resumed.step == 8
    assert first["tokens"] == 4 * 2 * 4 * 16 and rest["tokens"] == whole["tokens"] == 8 * 2 * 4 * 16  # the count too
    a, b = params(full.model), params(resumed.model)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert full.last_eval == resumed.last_eval


def test_loss_goes_down_and_metrics_logged(tmp_path):
    trainer, summary = run(recipe(tmp_path, max_steps=30), tmp_path / "r", overrides=["model.dropout=0.0"])
    lines = (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) >= 15
    first = next(float(line.split('"loss": ')[1].split(",")[0]) for line in lines if '"loss"' in line)
    assert summary["train_loss"] < first - 0.5
    assert summary["val_loss"] < 3.0


def test_ctrl_c_checkpoints_and_resumes_exactly(tmp_path):
    cfg = recipe(tmp_path, checkpoint_every=0)
    full, _ = run(cfg, tmp_path / "full")
    trainer = setup_run(load_run_config(cfg), tmp_path / "int", show_progress=False)
    real = trainer.task.get_batch
    calls = {"n": 0}

    def get_batch(generator):
        calls["n"] += 1
        if calls["n"] == 3:  # Ctrl-C during step 3: the step finishes, a checkpoint is written
            os.kill(os.getpid(), signal.SIGINT)
        return real(generator)

    trainer.task.get_batch = get_batch
    summary = trainer.fit()
    assert summary["stopped_by"] == "interrupt" and summary["step"] == 3
    resumed, _ = run(cfg, tmp_path / "int", resume=True)
    for k, v in params(full.model).items():
        assert torch.equal(v, resumed.model.state_dict()[k]), k


def test_crash_while_writing_keeps_previous_checkpoint(tmp_path):
    trainer, _ = run(recipe(tmp_path, max_steps=2), tmp_path / "r")
    ckpt = tmp_path / "r" / "checkpoint"
    before = (ckpt / "model.safetensors").read_bytes()

    def boom(tmp):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_checkpoint(ckpt, trainer.model, {"model": {}}, extra=boom)
    assert (ckpt / "model.safetensors").read_bytes() == before
    model, _ = load_model(tmp_path / "r")
    assert model.config.num_layers == 2


def test_truncated_and_missing_checkpoints(tmp_path):
    run(recipe(tmp_path, max_steps=2), tmp_path / "r")
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        load_model(tmp_path / "nope")
    weights = tmp_path / "r" / "checkpoint" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model(tmp_path / "r")
    state = tmp_path / "r" / "checkpoint" / "trainer_state.pt"
    state.write_bytes(b"garbage")
    with pytest.raises(CheckpointError):
        run(recipe(tmp_path), tmp_path / "r", resume=True)


def test_missing_data_file(tmp_path):
    cfg = recipe(tmp_path)
    cfg["data"]["path"] = str(tmp_path / "missing.txt")
    with pytest.raises(DataError, match="data file not found"):
        run(cfg, tmp_path / "r")


def test_activation_checkpointing_trains_the_same_weights(tmp_path):
    cfg = recipe(tmp_path, max_steps=3, eval_every=0, checkpoint_every=0)
    plain, _ = run(cfg, tmp_path / "plain", overrides=["model.dropout=0.0"])
    saved, _ = run(cfg, tmp_path / "ckpt", overrides=["model.dropout=0.0", "train.activation_checkpointing=true"])
    assert saved.model.config.gradient_checkpointing and not plain.model.config.gradient_checkpointing
    a, b = params(plain.model), params(saved.model)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def test_fine_tuning_may_switch_to_a_linear_attention_backend(tmp_path):
    """init_from an exact-attention run with attention: performer: every weight is taken over; the performer's
    random features (absent from the checkpoint) start fresh."""
    cfg = recipe(tmp_path, max_steps=2, eval_every=0, checkpoint_every=0)
    base, _ = run(cfg, tmp_path / "base", overrides=["model.dropout=0.0"])
    tuned_cfg = recipe(tmp_path, max_steps=1, eval_every=0, checkpoint_every=0, lr=1e-9, warmup_steps=0,
                       init_from=str(tmp_path / "base"))
    tuned, summary = run(tuned_cfg, tmp_path / "tuned", overrides=["model.dropout=0.0", "model.attention=performer"])
    assert tuned.model.config.attention == "performer" and summary["step"] == 1
    assert "blocks.0.attn.backend.features" in tuned.model.state_dict()
    torch.testing.assert_close(tuned.model.tok_embed.weight, base.model.tok_embed.weight, atol=1e-6, rtol=0)


def poison(trainer, bad_calls):
    """Make the task's loss NaN on the given (0-based) loss calls."""
    loss_fn, calls = trainer.task.loss, [0]

    def loss(model, batch):
        value, n = loss_fn(model, batch)
        calls[0] += 1
        return (value * float("nan") if calls[0] - 1 in bad_calls else value), n

    trainer.task.loss = loss


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_nan_loss_skips_the_update_and_is_counted(tmp_path, precision):
    cfg = recipe(tmp_path, precision=precision, max_steps=6, eval_every=0, checkpoint_every=0)
    trainer = setup_run(load_run_config(cfg, ["model.dropout=0.0"]), tmp_path / "r", show_progress=False)
    poison(trainer, {2, 3})  # the 3rd and 4th batches
    summary = trainer.fit()
    assert summary["step"] == 6 and summary["nonfinite_steps"] == 2 and summary["stopped_by"] == "max_steps"
    assert all(torch.isfinite(v).all() for v in trainer.model.state_dict().values())
    records = [line for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if "skipped" in line]
    assert len(records) == 2 and '"nonfinite_steps": 2' in records[-1]
    # the skipped batches left no trace in the optimizer or the schedule: 6 updates, not 8
    assert {int(state["step"]) for state in trainer.optimizer.state.values()} == {6}
    assert trainer.scheduler.last_epoch == 6


def test_nan_in_a_row_stops_with_a_clear_message_and_an_intact_checkpoint(tmp_path):
    from tokenloom.errors import TrainingError

    cfg = recipe(tmp_path, max_steps=20, eval_every=0, checkpoint_every=0, max_nonfinite=3)
    trainer = setup_run(load_run_config(cfg, []), tmp_path / "r", show_progress=False)
    poison(trainer, set(range(4, 100)))  # every batch from the 5th on
    with pytest.raises(TrainingError, match=r"NaN/Inf for 3 updates in a row at step 4 \(train.max_nonfinite=3\); "
                                            r"stopped"):
        trainer.fit()
    model, _ = load_model(tmp_path / "r")
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    state = torch.load(tmp_path / "r" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 4 and state["nonfinite_steps"] == 3
    assert '"stopped": "non_finite"' in (tmp_path / "r" / "metrics.jsonl").read_text()


def test_max_nonfinite_is_checked():
    from tokenloom.errors import ConfigError

    with pytest.raises(ConfigError, match="train.max_nonfinite must be an integer >= 0"):
        load_run_config({"data": {"path": "x"}, "train": {"max_nonfinite": -1}}, [])


def test_checkpoints_carry_checksums_and_damage_is_found(tmp_path):
    from tokenloom.checkpoint import CHECKSUM_FILE, checkpoint_damage

    run(recipe(tmp_path, max_steps=4), tmp_path / "r")
    ckpt = tmp_path / "r" / "checkpoint"
    assert (ckpt / CHECKSUM_FILE).is_file() and checkpoint_damage(ckpt) is None
    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[-5] ^= 0xFF  # one flipped byte inside a tensor: the file still parses
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    assert "model.safetensors does not match its checksum" in checkpoint_damage(ckpt)
    data[-5] ^= 0xFF
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    assert checkpoint_damage(ckpt) is None
    (ckpt / "trainer_state.pt").unlink()
    assert "trainer_state.pt is missing" in checkpoint_damage(ckpt)


def test_keep_checkpoints_and_resume_from_the_newest_intact_one(tmp_path):
    cfg = recipe(tmp_path, keep_checkpoints=3, checkpoint_every=2, eval_every=0)
    full, _ = run(cfg, tmp_path / "full")
    run(cfg, tmp_path / "split", overrides=["train.stop_after_steps=6"])  # saves at 2, 4 and 6 (its end)
    history = sorted(p.name for p in (tmp_path / "split" / "history").iterdir())
    assert history == ["step-00000002", "step-00000004"]  # with the newest: 3 kept
    newest = tmp_path / "split" / "checkpoint" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[-5] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"resuming from .*step-00000004: checkpoint is damaged \(.*does not match"):
        resumed, _ = run(cfg, tmp_path / "split", resume=True)
    assert resumed.step == 8
    for (k, a), b in zip(params(full.model).items(), params(resumed.model).values(), strict=True):
        assert torch.equal(a, b), k  # exact: steps 5-8 replayed from step 4's state
    from tokenloom.checkpoint import checkpoint_damage

    # the damaged checkpoint went aside; it did not replace the intact step 4 it was resumed from
    step4 = tmp_path / "split" / "history" / "step-00000004"
    assert checkpoint_damage(step4) is None
    assert "does not match" in checkpoint_damage(tmp_path / "split" / "checkpoint.damaged")
    for p in (tmp_path / "split" / "history").iterdir():
        (p / "config.yaml").unlink()
    (tmp_path / "split" / "checkpoint" / "trainer_state.pt").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="no intact checkpoint to resume from"):
        run(cfg, tmp_path / "split", resume=True)


def test_keep_checkpoints_is_checked():
    from tokenloom.errors import ConfigError

    with pytest.raises(ConfigError, match="train.keep_checkpoints must be an integer >= 1, got 0"):
        load_run_config({"data": {"path": "x"}, "train": {"keep_checkpoints": 0}}, [])


def test_an_unwritable_run_directory_fails_before_training(tmp_path):
    from tokenloom.errors import ConfigError

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match=r"^cannot write the run directory .*a-file/run: Not a directory$"):
        setup_run(load_run_config(recipe(tmp_path), []), tmp_path / "a-file" / "run", show_progress=False)


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_is_chosen_recorded_and_kept_on_resume(tmp_path, monkeypatch, native):
    """train.precision auto -> bf16 where bf16 is native, fp32 elsewhere (mocked answers); the checkpoint records
    the choice (train.precision) and its reason and machine (machine section); a resume continues in it, also on a
    machine where auto would choose otherwise."""
    from tokenloom import hardware
    from tokenloom.checkpoint import read_config

    found = hardware.Bf16Support(native, "mocked: native" if native else "mocked: emulated")
    monkeypatch.setattr(hardware, "bf16_support", lambda: found)
    monkeypatch.setattr(hardware, "_warned_emulated", False)
    monkeypatch.setattr(hardware, "bf16_matmul_speedup", lambda: 0.3)
    cfg = recipe(tmp_path, precision="auto", max_steps=4)
    trainer, _ = run(cfg, tmp_path / "r", overrides=["train.stop_after_steps=2"])
    chosen = "bf16" if native else "fp32"
    assert trainer.config.train.precision == chosen and (trainer.master is not None) is native
    saved = read_config(tmp_path / "r" / "checkpoint")
    assert saved["train"]["precision"] == chosen
    assert saved["machine"]["precision"] == {"requested": "auto", "chosen": chosen, "reason": found.reason}
    assert saved["machine"]["cpu"] == hardware.machine().cpu and saved["machine"]["torch"] == hardware.machine().torch
    other = hardware.Bf16Support(not native, "mocked: the other machine")
    monkeypatch.setattr(hardware, "bf16_support", lambda: other)
    with pytest.warns(hardware.EmulatedBf16Warning) if native else contextlib.nullcontext():  # bf16 where emulated
        resumed, _ = run(load_run_config(read_config(tmp_path / "r")).to_dict(), tmp_path / "r", resume=True)
    assert resumed.config.train.precision == chosen and resumed.step == 4
    assert resumed.precision.requested == "auto" and "chosen when the run started" in resumed.precision.reason


class _Payload:
    """Unpickling this runs code (what a crafted trainer_state.pt would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_resume_never_runs_code_from_the_run_directory(tmp_path):
    """trainer_state.pt is read with weights_only=True: a crafted object in it (checksums regenerated, so the
    checkpoint looks intact) is refused with a one-line error and never executed."""
    from tokenloom.checkpoint import STATE_FILE, write_checksums

    cfg = recipe(tmp_path, max_steps=4)
    run(cfg, tmp_path / "r", overrides=["train.stop_after_steps=2"])
    checkpoint = tmp_path / "r" / "checkpoint"
    state = torch.load(checkpoint / STATE_FILE, weights_only=True)  # what the trainer writes: plain data
    marker = tmp_path / "pwned"
    state["last_eval"] = _Payload(marker)
    torch.save(state, checkpoint / STATE_FILE)
    write_checksums(checkpoint)
    with pytest.raises(CheckpointError, match=r"trainer_state.pt holds objects a trainer state never holds; it is "
                                              r"not loaded, since loading could run code"):
        run(cfg, tmp_path / "r", resume=True)
    assert not marker.exists()


def test_a_trainer_state_written_with_a_numpy_rng_array_still_resumes_exactly(tmp_path):
    """States written before the numpy key array became a tensor hold numpy's array: still read (numpy's array
    reconstruction is allowed), and the resume is exact."""
    import numpy as np

    from tokenloom.checkpoint import STATE_FILE, write_checksums

    cfg = recipe(tmp_path, max_steps=8)
    full, _ = run(cfg, tmp_path / "full")
    run(cfg, tmp_path / "split", overrides=["train.stop_after_steps=4"])
    checkpoint = tmp_path / "split" / "checkpoint"
    state = torch.load(checkpoint / STATE_FILE, weights_only=True)
    name, keys, pos, has_gauss, cached = state["numpy_rng"]
    old = (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)  # the earlier layout
    state["numpy_rng"] = old
    state["rank_rng"] = [{**state["rank_rng"][0], "numpy": old}]
    torch.save(state, checkpoint / STATE_FILE)
    write_checksums(checkpoint)
    resumed, _ = run(cfg, tmp_path / "split", resume=True)
    a, b = params(full.model), params(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)


def logged_lrs(run_dir):
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in records if "lr" in r}


def cosine_lrs(steps, *, lr=3e-3, min_lr=3e-4, warmup=2, max_steps=12):
    """The lr logged after each update s (the one update s + 1 trains with) of the cosine schedule, and its floor
    after ``max_steps``."""
    from tokenloom.training.schedules import cosine

    return {s: lr * cosine(s, warmup_steps=warmup, max_steps=max_steps, min_ratio=min_lr / lr) for s in steps}


def test_a_resume_with_a_larger_max_steps_keeps_the_schedule_and_says_so(tmp_path):
    """The first run's cosine schedule (12 steps) continues exactly; the steps after its end run at min_lr; the notice
    names the key; a resume of the resumed run (changed or not) keeps the schedule recorded by the first one."""
    import torch

    cfg = recipe(tmp_path, max_steps=12, log_every=1, eval_every=0, checkpoint_every=0, stop_after_steps=4)
    first, _ = run(cfg, tmp_path / "r")
    assert first.notices == [] and first.step == 4
    state = torch.load(tmp_path / "r" / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert state["schedule"] == {"schedule": "cosine", "lr": 3e-3, "min_lr": pytest.approx(3e-4), "warmup_steps": 2,
                                 "max_steps": 12, "decay_fraction": 0.2}
    resumed, _ = run(cfg, tmp_path / "r", resume=True, overrides=["train.max_steps=20"])  # steps 5-8
    assert resumed.notices == [
        "note: resuming keeps the learning-rate schedule of the first run (max_steps 12 -> 20: steps after 12 run "
        "at min_lr 0.0003); to train on a new schedule, start a new run from these weights: tokenloom train RECIPE "
        f"--out NEW --set train.init_from={tmp_path / 'r'}"]
    # the second resume reads the run's own config (max_steps 20 now): nothing changed, nothing said
    again, _ = run(load_run_config(read_run_config(tmp_path / "r")).to_dict(), tmp_path / "r", resume=True)  # 9-12
    assert again.notices == [] and again.step == 12
    last, _ = run(load_run_config(read_run_config(tmp_path / "r")).to_dict(), tmp_path / "r", resume=True,
                  overrides=["train.stop_after_steps=null", "train.max_steps=22"])  # 13-22
    assert last.step == 22 and last.notices == [
        "note: resuming keeps the learning-rate schedule of the first run (max_steps 20 -> 22: steps after 12 run "
        "at min_lr 0.0003); to train on a new schedule, start a new run from these weights: tokenloom train RECIPE "
        f"--out NEW --set train.init_from={tmp_path / 'r'}"]
    got = logged_lrs(tmp_path / "r")
    assert sorted(got) == list(range(1, 23))
    expected = cosine_lrs(range(1, 23))
    assert all(expected[s] == pytest.approx(3e-4) for s in range(12, 23))
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-12, abs=0), step
    # the same lr sequence as an uninterrupted run of the original schedule, step for step
    whole = logged_lrs(run(recipe(tmp_path, max_steps=12, log_every=1, eval_every=0, checkpoint_every=0),
                           tmp_path / "whole")[0].run_dir)
    assert all(got[s] == whole[s] for s in whole)


def read_run_config(run_dir):
    from tokenloom.checkpoint import read_config

    return read_config(run_dir)


def test_an_unchanged_resume_says_nothing_and_other_keys_need_no_notice(tmp_path):
    cfg = recipe(tmp_path, max_steps=8, log_every=1, eval_every=0, checkpoint_every=0, stop_after_steps=4)
    run(cfg, tmp_path / "r")
    resumed, _ = run(cfg, tmp_path / "r", resume=True, overrides=["train.eval_batches=1", "train.log_every=2"])
    assert resumed.notices == [] and resumed.step == 8


def test_a_resume_that_changes_lr_and_the_schedule_keeps_both(tmp_path):
    # min_lr is unset (lr / 10): it follows the new lr, and is kept too
    cfg = recipe(tmp_path, max_steps=8, log_every=1, eval_every=0, checkpoint_every=0, stop_after_steps=4)
    run(cfg, tmp_path / "r")
    resumed, _ = run(cfg, tmp_path / "r", resume=True,
                     overrides=["train.lr=1e-2", "train.schedule=linear", "train.warmup_steps=0"])
    assert resumed.notices == [
        "note: resuming keeps the learning-rate schedule of the first run (schedule cosine -> linear: the schedule "
        "keeps cosine; lr 0.003 -> 0.01: the schedule keeps 0.003; min_lr 0.0003 -> 0.001: the schedule keeps "
        "0.0003; warmup_steps 2 -> 0: the schedule keeps 2); to train on a new schedule, start a new run from these "
        f"weights: tokenloom train RECIPE --out NEW --set train.init_from={tmp_path / 'r'}"]
    got, expected = logged_lrs(tmp_path / "r"), cosine_lrs(range(1, 9), max_steps=8)
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-12, abs=0), step


def test_a_resume_of_a_checkpoint_without_a_recorded_schedule_keeps_its_config_s(tmp_path):
    """Checkpoints written before the record: the schedule their config.yaml builds."""
    import torch

    cfg = recipe(tmp_path, max_steps=12, log_every=1, eval_every=0, checkpoint_every=0, stop_after_steps=4)
    run(cfg, tmp_path / "r")
    path = tmp_path / "r" / "checkpoint" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    del state["schedule"]
    torch.save(state, path)
    from tokenloom.checkpoint import write_checksums

    write_checksums(path.parent)
    resumed, _ = run(cfg, tmp_path / "r", resume=True, overrides=["train.max_steps=16", "train.stop_after_steps=null"])
    assert resumed.step == 16 and "max_steps 12 -> 16: steps after 12 run at min_lr 0.0003" in resumed.notices[0]
    got, expected = logged_lrs(tmp_path / "r"), cosine_lrs(range(1, 17))
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-12, abs=0), step


def test_a_constant_schedule_is_not_shaped_by_max_steps(tmp_path):
    cfg = recipe(tmp_path, max_steps=6, schedule="constant", log_every=1, eval_every=0, checkpoint_every=0,
                 stop_after_steps=3)
    run(cfg, tmp_path / "r")
    resumed, _ = run(cfg, tmp_path / "r", resume=True, overrides=["train.max_steps=9", "train.min_lr=1e-4"])
    assert resumed.notices == [] and resumed.step == 6  # stop_after_steps 3 again


def test_training_evaluations_record_and_name_the_part_of_the_split_they_cover(tmp_path, capsys):
    """metrics.jsonl keeps val_loss and adds eval_batches / eval_split_batches; the lines printed during training
    name the figure val_loss[2 of N batches] (or [whole split] when train.eval_batches covers the split)."""
    import json

    trainer, summary = run(recipe(tmp_path), tmp_path / "part")  # eval_batches 2
    total = trainer.task.eval_split_batches()
    assert total == len(list(trainer.task.dataset.iter_batches("val", 4, 16))) > 2
    evals = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()
             if '"val_loss"' in line]
    assert [r["step"] for r in evals] == [4, 8]
    assert all(r["eval_batches"] == 2 and r["eval_split_batches"] == total and r["val_loss"] > 0 for r in evals)
    assert summary["eval_batches"] == 2 and summary["val_loss"] == evals[-1]["val_loss"]
    out = capsys.readouterr().out
    assert f"step 4: val_loss[2 of {total} batches] " in out and "val_loss " not in out
    _, whole = run(recipe(tmp_path, eval_batches=1000), tmp_path / "whole")
    assert whole["eval_batches"] == whole["eval_split_batches"] == total
    assert "step 4: val_loss[whole split] " in capsys.readouterr().out

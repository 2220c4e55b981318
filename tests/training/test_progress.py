"""What a person sees while a run trains (tokenloom.training.progress): every train.log_every steps the step's
metrics.jsonl record as one line on stderr (step/max, loss, lr, ms/step, tokens/s, MFU, ETA, the task's own
figures), a tqdm bar instead while stderr is a terminal; and train.log_to: [tensorboard], the same records as
TensorBoard scalars (tokenloom.training.tensorboard_log)."""

import io
import json
import os
import re

import pytest
from tests.tasks.preference_helpers import PAIRS, make_lm_checkpoint, write_jsonl
from tests.tasks.preference_helpers import run as preference_run
from tests.training.test_metrics_log import recipe as metrics_recipe

from tokenloom.errors import ConfigError
from tokenloom.hardware import remembered
from tokenloom.training import load_run_config, setup_run
from tokenloom.training import progress as progress_module
from tokenloom.training.progress import Progress, duration, progress_line, progress_mode

LINE = re.compile(r"step +(\d+)/(\d+)  loss (\S+)  lr (\S+)  (\S+) ms/step  (\S+) tok/s  MFU (\S+)%  ETA (\S+)$")
PEAK = 2e9  # FLOP/s standing in for the measured matmul peak (the MFU is then the formula's, exactly)


def recipe(tmp_path, **train):
    """The metrics-log tests' tiny run, 7 steps with a line every 3, no evaluation or checkpoint between."""
    return metrics_recipe(tmp_path, **{"max_steps": 7, "eval_every": 0, "checkpoint_every": 0, "log_every": 3,
                                       **train})


def records(run_dir, key="loss"):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if key in r]


@pytest.fixture
def peak(monkeypatch):
    """No matmul measurement in these tests: the peak is PEAK."""
    import tokenloom.hardware

    monkeypatch.setattr(tokenloom.hardware, "remembered_matmul_peak", lambda dtype, device=None, at_least=None: PEAK)


def test_the_line_shows_the_record_with_rate_mfu_eta_and_the_tasks_figures():
    record = {"step": 40, "loss": 2.58779, "lr": 8.2e-4, "tokens_per_s": 21004.4, "ms_per_step": 195.04,
              "elapsed_s": 8.1, "reward": 0.41, "kl": 0.01234}
    assert progress_line(record, 900, mfu=0.0461, eta_s=168) == (
        "step  40/900  loss 2.5878  lr 8.20e-04  195 ms/step  21,004 tok/s  MFU 4.6%  ETA 2m48s  reward 0.41  "
        "kl 0.01234")
    # a bar shows the step, its rate and ETA itself: the line it carries leaves them out
    assert progress_line(record, 900, mfu=0.0461, eta_s=168, bar=True) == (
        "loss 2.5878  lr 8.20e-04  21,004 tok/s  MFU 4.6%  reward 0.41  kl 0.01234")
    # no MFU where it is unknown, the task's unit, small figures with their digits
    assert progress_line({"step": 3, "loss": 0.5, "lr": 1e-5, "tokens_per_s": 2.5, "ms_per_step": 4.25}, 10,
                         unit="pairs") == "step  3/10  loss 0.5000  lr 1.00e-05  4.25 ms/step  2.50 pairs/s"
    assert [duration(s) for s in (0, 45.4, 168, 3725)] == ["0s", "45s", "2m48s", "1h02m"]


def test_mfu_is_model_flops_over_the_peak_and_a_peak_from_a_busy_moment_is_measured_again(tmp_path, monkeypatch):
    calls = []

    def peak(reached):
        calls.append(reached)
        return 100.0 if reached is None else 400.0

    progress = Progress("lines", step=0, max_steps=10, flops_per_token=2.0, peak=peak)
    assert progress.mfu({"tokens_per_s": 25.0}) == 0.5 and calls == [None]
    # 200 FLOP/s reached over a remembered 100: measured again (at least 200), once
    assert progress.mfu({"tokens_per_s": 100.0}) == 0.5 and calls == [None, 200.0]
    assert progress.mfu({"tokens_per_s": 1000.0}) is None and len(calls) == 2  # never above 100%
    assert Progress("lines", step=0, max_steps=10, peak=peak).mfu({"tokens_per_s": 1.0}) is None  # no FLOPs known
    # the remembered value: kept while nothing beats it, else measured again and the larger kept
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path))
    measured = iter([10.0, 30.0, 5.0])
    assert remembered("peak x", lambda: next(measured)) == (10.0, False)
    assert remembered("peak x", lambda: next(measured)) == (10.0, True)
    assert remembered("peak x", lambda: next(measured), at_least=20.0) == (30.0, False)
    assert remembered("peak x", lambda: next(measured), at_least=20.0) == (30.0, True)
    assert remembered("peak x", lambda: next(measured), at_least=40.0) == (30.0, False)  # (5 measured: 30 kept)


def test_a_bar_in_a_terminal_lines_elsewhere(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

        def fileno(self):
            return 2

    assert progress_mode(False) == "off" and progress_mode(None, is_main=False) == "off"
    assert progress_mode(True) == "bar"
    assert progress_mode(None) == "lines"  # (pytest's captured stderr is not a terminal)
    monkeypatch.setattr("sys.stderr", Terminal())
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr(progress_module.os, "get_terminal_size", lambda fd: os.terminal_size((120, 40)))
    assert progress_mode(None) == "bar"
    monkeypatch.setenv("TERM", "dumb")
    assert progress_mode(None) == "lines"
    monkeypatch.setenv("TERM", "xterm")  # a terminal of no width (a pseudo-terminal nobody sized): tqdm draws nothing
    monkeypatch.setattr(progress_module.os, "get_terminal_size", lambda fd: os.terminal_size((0, 0)))
    assert progress_mode(None) == "lines"


def test_training_prints_a_line_every_log_every_steps_off_a_terminal(tmp_path, capsys, peak):
    trainer = setup_run(load_run_config(recipe(tmp_path)), tmp_path / "run")  # show_progress: auto
    trainer.fit()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("step")]
    logged = records(tmp_path / "run")
    assert [r["step"] for r in logged] == [3, 6, 7]  # every log_every steps, and the last
    assert len(lines) == len(logged), err
    for line, record in zip(lines, logged, strict=True):
        step, total, loss, lr, ms, rate, mfu, eta = LINE.match(line).groups()
        assert (int(step), int(total)) == (record["step"], 7)
        assert loss == f"{record['loss']:.4f}" and float(lr) == pytest.approx(record["lr"], rel=1e-2)
        assert float(ms.replace(",", "")) == pytest.approx(record["ms_per_step"], abs=0.5) and record["ms_per_step"] > 0
        assert rate == f"{record['tokens_per_s']:,.0f}"
        # MFU: tokens/s x (6 N + 12 L C T) FLOPs a token / the peak
        flops = 6 * trainer.parameter_counts[1] + 12 * 1 * 16 * 16
        assert float(mfu) == pytest.approx(100 * record["tokens_per_s"] * flops / PEAK, abs=0.051)  # (to 0.1%)
        assert re.fullmatch(r"(\d+h)?(\d+m)?\d+s|\d+h\d+m", eta)
    assert lines[-1].endswith("ETA 0s")
    # the record holds the window's rates: tokens/s x ms/step = the tokens of a step
    for record in logged:
        assert record["tokens_per_s"] * record["ms_per_step"] / 1000 == pytest.approx(4 * 16, rel=0.02)


def test_no_lines_when_progress_is_off_and_evaluations_stay_on_stdout(tmp_path, capsys, peak):
    trainer = setup_run(load_run_config(recipe(tmp_path, eval_every=3)), tmp_path / "run", show_progress=False)
    trainer.fit()
    out, err = capsys.readouterr()
    assert not re.search(r"^step .*/7", err, re.M)
    assert re.search(r"^step 3: val_loss\[", out, re.M) and re.search(r"^step 6: val_loss\[", out, re.M)


def test_a_bar_when_asked_for(tmp_path, capsys, peak):
    """show_progress=True: the tqdm bar (what a terminal gets), its figures from the records."""
    trainer = setup_run(load_run_config(recipe(tmp_path)), tmp_path / "run", show_progress=True)
    trainer.fit()
    err = capsys.readouterr().err
    last = records(tmp_path / "run")[-1]
    assert "train: 100%" in err and "7/7" in err and ("step/s" in err or "s/step" in err)
    assert f"loss {last['loss']:.4f}" in err and "tok/s" in err and "MFU " in err
    assert not re.search(r"^step +\d+/7", err, re.M)  # no plain lines besides the bar


def test_the_tasks_own_figures_are_shown_dpo(tmp_path, capsys, peak):
    """DPO's implicit-reward figures (train_metrics) in metrics.jsonl and on the line; its rate counts items."""
    sft = make_lm_checkpoint(tmp_path / "sft")
    trainer = preference_run("dpo", {"path": str(write_jsonl(tmp_path / "p.jsonl", PAIRS)), "beta": 0.5},
                             tmp_path / "out", init_from=sft, steps=4, log_every=2)
    trainer.show_progress = None
    trainer.fit()
    logged = records(tmp_path / "out")
    assert [r["step"] for r in logged] == [2, 4]
    assert all({"reward_acc", "margin", "chosen_reward", "rejected_reward"} <= set(r) for r in logged)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all(" items/s" in line and "MFU" not in line for line in lines)  # no MFU: not lm
    last = logged[-1]
    assert f"reward_acc {last['reward_acc']:.4g}" in lines[-1] and f"margin {last['margin']:.4g}" in lines[-1]


def test_log_to_is_a_list_or_a_string_of_known_targets(tmp_path):
    assert load_run_config(recipe(tmp_path, log_to="tensorboard")).train.log_to == ["tensorboard"]
    assert load_run_config(recipe(tmp_path, log_to=["tensorboard"])).train.log_to == ["tensorboard"]
    assert load_run_config(recipe(tmp_path)).train.log_to == []
    with pytest.raises(ConfigError, match=r"train\.log_to must list targets of tensorboard .*'tensorbord'.*did you "
                                          r"mean 'tensorboard'"):
        load_run_config(recipe(tmp_path, log_to="tensorbord"))
    with pytest.raises(ConfigError, match=r"train\.log_to: expected list\[str\] or str"):
        load_run_config(recipe(tmp_path, log_to=3))


def test_log_to_tensorboard_without_the_package_is_one_line(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else
                        find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"tensorboard package.*tokenloom\[tensorboard\]") as err:
        setup_run(load_run_config(recipe(tmp_path, log_to="tensorboard")), tmp_path / "run", show_progress=False)
    assert "\n" not in str(err.value)


def scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_tensorboard_holds_the_metrics_jsonl_values(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = recipe(tmp_path, log_to=["tensorboard"], eval_every=3, log_every=2)
    setup_run(load_run_config(cfg), tmp_path / "run", show_progress=False).fit()
    run = tmp_path / "run"
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("tokens_per_s", "train/tokens_per_s"),
                     ("val_loss", "val/loss")):
        logged = [(r["step"], r[key]) for r in records(run, key)]
        assert [step for step, _ in scalars(run, tag)] == [step for step, _ in logged] and logged
        assert [value for _, value in scalars(run, tag)] == pytest.approx([v for _, v in logged], rel=1e-6)


def test_a_resumed_run_appends_each_step_once(tmp_path):
    """A run killed after its checkpoint logged steps the resumed run logs again: TensorBoard shows each step once
    (purge_step), with the values metrics.jsonl keeps."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    cfg = recipe(tmp_path, log_to="tensorboard", log_every=1, max_steps=8, checkpoint_every=4)
    run = tmp_path / "run"
    setup_run(load_run_config(cfg, ["train.stop_after_steps=4"]), run, show_progress=False).fit()
    killed = SummaryWriter(str(run / "tensorboard"))  # what a killed resume wrote after the checkpoint
    for step in (5, 6):
        killed.add_scalar("train/loss", 99.0, step)
    killed.close()
    setup_run(load_run_config(cfg), run, resume=True, show_progress=False).fit()
    logged = [(r["step"], r["loss"]) for r in records(run)]
    assert [step for step, _ in logged] == list(range(1, 9))
    shown = scalars(run, "train/loss")
    assert [step for step, _ in shown] == list(range(1, 9))
    assert [value for _, value in shown] == pytest.approx([v for _, v in logged], rel=1e-6)


def test_a_sample_goes_to_tensorboard_as_text(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = setup_run(load_run_config(recipe(tmp_path, log_to="tensorboard")), tmp_path / "run",
                        show_progress=False)
    trainer.fit()
    trainer.log_text("sample", "All:\nSpeak")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    (text,) = events.Tensors("sample/text_summary")
    assert text.step == 7 and text.tensor_proto.string_val == [b"    All:\n    Speak"]

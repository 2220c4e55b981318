"""train.schedule_clock: minutes -- the learning-rate schedule runs over training time (training/clock.py)."""

import json
from types import SimpleNamespace

import pytest
import torch
from test_trainer import params, recipe, run

from tokenloom.errors import ConfigError
from tokenloom.training import clock
from tokenloom.training.clock import TrainingClock, schedule_position
from tokenloom.training.config import load_run_config
from tokenloom.training.trainer import Trainer


def test_the_position_is_the_larger_of_the_steps_and_the_time_and_stops_at_max_steps():
    assert schedule_position(10, 0.0, 100, 60.0) == 10  # no time spent: the steps
    assert schedule_position(10, 30.0, 100, 60.0) == 50  # half the budget: half of max_steps
    assert schedule_position(80, 30.0, 100, 60.0) == 80  # a fast machine: the steps are further
    assert schedule_position(90, 600.0, 100, 60.0) == 100  # past the budget: the end, not beyond
    assert schedule_position(5, 30.0, 100, 60.0, warmup_steps=10) == 5  # the warmup counts steps
    assert schedule_position(10, 30.0, 100, 60.0, warmup_steps=10) == 50  # then the clock


@pytest.fixture
def one_second_per_step(monkeypatch):
    """Training time advances exactly one second per update, evaluations and checkpoints take none."""
    now = [0.0]
    monkeypatch.setattr(clock, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    train_step = Trainer.train_step

    def timed(self):
        now[0] += 1.0
        return train_step(self)

    monkeypatch.setattr(Trainer, "train_step", timed)
    return now


def minutes_recipe(tmp_path):  # a 6-second budget, a linear schedule over 12 steps
    return recipe(tmp_path, max_steps=12, max_minutes=0.1, schedule_clock="minutes", schedule="linear",
                  warmup_steps=0, lr=1e-3, min_lr=0.0, log_every=1, eval_every=0, checkpoint_every=0)


def test_the_schedule_follows_the_clock_and_the_run_ends_with_the_budget(tmp_path, one_second_per_step):
    trainer, summary = run(minutes_recipe(tmp_path), tmp_path / "r")
    assert summary["stopped_by"] == "max_minutes" and trainer.step == 6  # 6 of the 12 steps fit 6 seconds
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
           if '"lr"' in line]
    # after k updates (k seconds of 6) the schedule stands at 2k of its 12 steps: lr = 1e-3 * (1 - 2k / 12)
    assert lrs == pytest.approx([1e-3 * (1 - 2 * k / 12) for k in range(1, 7)])
    assert lrs[-1] == 0.0  # the decay ended with the budget


def test_training_time_adds_up_over_resumes(tmp_path, one_second_per_step):
    cfg = minutes_recipe(tmp_path)
    full, _ = run(cfg, tmp_path / "full")
    assert full.clock.total_s == 6.0
    _, first = run(cfg, tmp_path / "split", overrides=["train.stop_after_steps=2"])
    assert first["step"] == 2
    resumed, rest = run(cfg, tmp_path / "split", resume=True)
    assert resumed.step == full.step == 6 and rest["stopped_by"] == "max_minutes"  # 2 seconds + 4, not 2 + 6
    assert resumed.clock.total_s == 6.0
    a, b = params(full.model), params(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same clock readings: the same schedule, the same weights


def test_the_step_clock_is_unchanged(tmp_path):
    trainer, _ = run(recipe(tmp_path, max_steps=4, schedule="linear", warmup_steps=0, log_every=1), tmp_path / "r")
    assert trainer.scheduler.last_epoch == 4 and trainer.clock.total_s > 0


def test_a_clock_is_paused_for_what_is_not_training(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(clock, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    c = TrainingClock(before_s=5.0)
    c.start()
    now[0] = 2.0
    with c.paused():
        now[0] = 10.0
    now[0] = 11.0
    assert (c.this_run_s, c.total_s) == (3.0, 8.0)


@pytest.mark.parametrize("changes, match", [
    ({"schedule_clock": "hours"}, r"^train.schedule_clock must be one of steps, minutes, got 'hours'$"),
    ({"schedule_clock": "minutes", "max_minutes": None},
     r"^train.schedule_clock=minutes needs train.max_minutes \(the time the schedule runs over\)$"),
])
def test_bad_clock_settings_are_one_line(tmp_path, changes, match):
    with pytest.raises(ConfigError, match=match):
        load_run_config(recipe(tmp_path, **changes))

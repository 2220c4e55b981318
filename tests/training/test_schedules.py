import math

import pytest
import torch

from tokenloom.training.schedules import SCHEDULES, create_scheduler


def lrs(name, steps=20, warmup=5, max_steps=20, min_ratio=0.1, lr=1.0, **options):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr)
    sched = create_scheduler(opt, name, warmup_steps=warmup, max_steps=max_steps, min_ratio=min_ratio, **options)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_is_linear_from_zero():
    assert lrs("cosine")[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


def test_cosine_values():
    got = lrs("cosine", steps=21)
    for step in (5, 10, 15, 20):
        progress = (step - 5) / 15
        assert got[step] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    assert got[20] == pytest.approx(0.1)


def test_linear_values():
    got = lrs("linear", steps=21)
    assert got[5] == pytest.approx(1.0)
    assert got[20] == pytest.approx(0.1)
    assert got[12] == pytest.approx(1 - 0.9 * 7 / 15)


def test_constant_after_warmup():
    assert lrs("constant")[5:] == pytest.approx([1.0] * 15)


def test_inverse_sqrt_is_noam():
    d_model, warmup = 512, 4
    got = lrs("inverse_sqrt", warmup=warmup)
    for step, value in enumerate(got):
        n = step + 1
        noam = d_model ** -0.5 * min(n ** -0.5, n * warmup ** -1.5)
        assert value == pytest.approx(noam / (d_model ** -0.5 * warmup ** -0.5))
    assert max(got) == pytest.approx(1.0) and got.index(max(got)) == warmup - 1


def test_unknown_schedule_suggests():
    with pytest.raises(KeyError, match="did you mean 'cosine'"):
        SCHEDULES.get("cosin")


def spec(**changes):
    from tokenloom.training.schedules import ScheduleSpec

    base = {"schedule": "cosine", "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10, "max_steps": 150}
    return ScheduleSpec(**{**base, **changes})


def test_the_resume_notice_names_each_changed_key_and_what_happens():
    from tokenloom.training.schedules import kept_schedule_notice

    first = spec()
    assert kept_schedule_notice(first, first, first, "runs/a") is None
    longer = kept_schedule_notice(first, first, spec(max_steps=300), "runs/a")
    assert longer == ("note: resuming keeps the learning-rate schedule of the first run (max_steps 150 -> 300: steps "
                      "after 150 run at min_lr 0.0001); to train on a new schedule, start a new run from these "
                      "weights: tokenloom train RECIPE --out NEW --set train.init_from=runs/a")
    shorter = kept_schedule_notice(first, first, spec(max_steps=100, min_lr=2e-4), "runs/a")
    assert ("(min_lr 0.0001 -> 0.0002: the schedule keeps 0.0001; max_steps 150 -> 100: the run ends at step 100, "
            "before the schedule's end at 150)") in shorter
    # a resumed run (config max_steps 300, schedule 150) resumed again: 300 -> 400 is said; set back to 150 is not
    assert "max_steps 300 -> 400: steps after 150 run at min_lr" in kept_schedule_notice(
        first, spec(max_steps=300), spec(max_steps=400), "r")
    assert kept_schedule_notice(first, spec(max_steps=300), spec(max_steps=150), "r") is None
    assert kept_schedule_notice(first, spec(max_steps=300), spec(max_steps=300), "r") is None


def test_keys_that_do_not_shape_the_schedule_need_no_notice():
    from tokenloom.training.schedules import kept_schedule_notice

    for name in ("constant", "inverse_sqrt"):
        first = spec(schedule=name)
        assert first.shaping_keys() == ("schedule", "lr", "warmup_steps")
        assert kept_schedule_notice(first, first, spec(schedule=name, max_steps=900, min_lr=0.0), "r") is None
        assert "warmup_steps 10 -> 20" in kept_schedule_notice(first, first, spec(schedule=name, warmup_steps=20),
                                                               "r")


def test_a_recorded_schedule_is_checked():
    from tokenloom.training.schedules import ScheduleSpec

    first = spec()
    assert ScheduleSpec.from_record(first.as_dict()) == first
    for bad in ({**first.as_dict(), "max_steps": "150"}, {**first.as_dict(), "warmup_steps": True},
                {"schedule": "cosine"}, [1, 2]):
        with pytest.raises(ValueError, match="the recorded learning-rate schedule is not one"):
            ScheduleSpec.from_record(bad)


def test_wsd_warms_up_holds_then_decays_linearly():
    # warmup 2, stable until step 6 (= 10 - 0.4 * 10), then a line from 1 at step 6 to 0.1 at step 10
    wsd = {"warmup": 2, "max_steps": 10, "decay_fraction": 0.4}
    assert lrs("wsd", steps=11, **wsd) == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1])
    assert lrs("wsd", steps=11, **{**wsd, "decay_fraction": 0.0})[2:10] == pytest.approx([1.0] * 8)
    assert lrs("wsd", steps=13, **wsd)[-1] == pytest.approx(0.1)  # min_lr after max_steps

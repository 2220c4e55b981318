import math

import pytest
import torch

from tokenloom.training.schedules import SCHEDULES, create_scheduler


def lrs(name, steps=20, warmup=5, max_steps=20, min_ratio=0.1, lr=1.0):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr)
    sched = create_scheduler(opt, name, warmup_steps=warmup, max_steps=max_steps, min_ratio=min_ratio)
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

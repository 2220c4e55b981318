"""eval_mode / enter_eval: only training modules are switched, and every module gets its own mode back."""

from __future__ import annotations

import pytest
from torch import nn

from tokenloom.nn.modes import enter_eval, eval_mode, restore_training


def modes(model: nn.Module) -> list[bool]:
    return [m.training for m in model.modules()]


def test_eval_mode_switches_and_restores_each_modules_own_mode():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Dropout(0.5), nn.Linear(2, 2)))
    model.eval()
    model[1][0].train()  # a submodule deliberately left in training mode
    before = modes(model)
    with eval_mode(model):
        assert not any(modes(model))
    assert modes(model) == before
    model.train()
    with pytest.raises(RuntimeError), eval_mode(model):
        assert not any(modes(model))
        raise RuntimeError("restored on errors too")
    assert all(modes(model))


def test_a_model_in_eval_mode_is_not_touched():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)).eval()
    assert enter_eval(model) == []


def test_model_like_objects_switch_as_a_whole():
    class Wrapper:  # the generation protocol: training / train() / eval(), no modules()
        def __init__(self):
            self.inner = nn.Linear(2, 2)

        @property
        def training(self):
            return self.inner.training

        def train(self, mode=True):
            self.inner.train(mode)
            return self

        def eval(self):
            return self.train(False)

    w = Wrapper()
    switched = enter_eval(w)
    assert not w.training
    restore_training(switched)
    assert w.training
    assert enter_eval(w.eval()) == []

"""``train.compile``: the training forward through torch.compile, falling back to eager with one warning where
compilation is unavailable or fails, and never hiding the model's own errors."""

from __future__ import annotations

import pytest
import torch
from test_trainer import recipe, run  # tests/training is on sys.path (pytest's prepend import mode)
from torch import nn

import tokenloom.training.compile as compile_module
from tokenloom.errors import ConfigError
from tokenloom.training import load_run_config
from tokenloom.training.compile import CompiledForward, compile_unavailable


class DynamoFailure(Exception):
    pass


DynamoFailure.__module__ = "torch._dynamo.exc"  # what TorchDynamo / Inductor raise from


def test_unavailable_compiler_warns_once_and_runs_eagerly(monkeypatch):
    monkeypatch.setattr(compile_module, "compile_unavailable", lambda: "no C++ compiler (g++, c++ or clang++)")
    model = nn.Linear(3, 2)
    with pytest.warns(UserWarning, match="train.compile: no C.. compiler .*training eagerly"):
        forward = CompiledForward(model)
    x = torch.randn(4, 3)
    assert torch.equal(forward(x), model(x))
    assert forward.weight is model.weight  # the model's attributes pass through


def test_a_failing_compilation_falls_back_to_eager(monkeypatch):
    monkeypatch.setattr(compile_module, "compile_unavailable", lambda: None)

    def broken(*args, **kwargs):
        raise DynamoFailure("backend 'inductor' raised:\nCppCompileError: ...")

    monkeypatch.setattr(torch, "compile", lambda model, mode=None: broken)
    model = nn.Linear(3, 2)
    forward = CompiledForward(model)
    x = torch.randn(4, 3)
    with pytest.warns(UserWarning, match="compiling the model failed .backend 'inductor' raised:.; training eagerly"):
        out = forward(x)
    assert torch.equal(out, model(x)) and forward.compiled is None


def test_the_models_own_errors_are_not_swallowed(monkeypatch):
    monkeypatch.setattr(compile_module, "compile_unavailable", lambda: None)

    def model_bug(*args, **kwargs):
        raise ValueError("shapes do not match")

    monkeypatch.setattr(torch, "compile", lambda model, mode=None: model_bug)
    with pytest.raises(ValueError, match="shapes do not match"):
        CompiledForward(nn.Linear(3, 2))(torch.randn(1, 3))


def test_compile_mode_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="train.compile_mode must be default, reduce-overhead or max-autotune"):
        load_run_config(recipe(tmp_path, compile=True, compile_mode="fastest"), [])


@pytest.mark.slow
@pytest.mark.skipif(compile_unavailable() is not None, reason=f"torch.compile unavailable: {compile_unavailable()}")
def test_compiled_training_follows_the_eager_loss_curve(tmp_path):
    cfg = recipe(tmp_path, max_steps=4, eval_every=0, checkpoint_every=0)
    overrides = ["model.dropout=0.0"]
    _, eager = run(cfg, tmp_path / "eager", overrides=overrides)
    _, compiled = run(cfg, tmp_path / "compiled", overrides=[*overrides, "train.compile=true"])
    assert compiled["train_loss"] == pytest.approx(eager["train_loss"], abs=1e-4)
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], abs=1e-4)

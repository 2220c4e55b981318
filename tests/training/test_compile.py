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


# -- train.compile: step (the optimizer's step compiled too) --------------------------------------------------------
def test_compile_takes_true_false_model_or_step(tmp_path):
    from tokenloom.training.compile import COMPILE_TRUE, compile_parts

    assert [load_run_config(recipe(tmp_path, compile=v)).train.compile for v in (True, "model", "step")] == \
        [True, "model", "step"]
    assert compile_parts(False) == () and compile_parts("model") == ("model",)
    assert compile_parts("step") == ("model", "step") and compile_parts(True) == compile_parts(COMPILE_TRUE)
    with pytest.raises(ConfigError, match="train.compile"):
        load_run_config(recipe(tmp_path, compile="optimizer"))


def test_unavailable_compilation_warns_once_and_trains_eagerly(tmp_path, monkeypatch):
    import warnings

    import tokenloom.compilation

    monkeypatch.setattr(tokenloom.compilation, "compile_unavailable", lambda: "no C++ compiler (g++)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, summary = run(recipe(tmp_path, compile="step", max_steps=2, eval_every=0), tmp_path / "r")
    said = [str(w.message) for w in caught if "train.compile" in str(w.message)]
    assert said == ["train.compile: no C++ compiler (g++); training eagerly"]
    assert trainer.forward_model is trainer.model and trainer.compiled_step is None
    assert summary["step"] == 2 and isinstance(trainer.optimizer.param_groups[0]["lr"], float)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test compiles afresh: the compiled optimizer steps of earlier tests count against Dynamo's recompile
    limit (8 per function), past which it runs eagerly."""
    torch._dynamo.reset()
    yield


def _relative_difference(a, b):
    return max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)) for k in a)


@pytest.mark.slow
@pytest.mark.skipif(compile_unavailable() is not None, reason=f"torch.compile unavailable: {compile_unavailable()}")
@pytest.mark.parametrize("optimizer,rtol", [("adamw", 1e-5), ("muon", 1e-2)])
def test_a_compiled_optimizer_step_is_the_eager_step(optimizer, rtol):
    """The same gradients, 3 steps on a schedule: the eager (fused AdamW, float learning rates) and the compiled step
    (single-tensor AdamW, tensor learning rates) give the same weights (Muon: within its bfloat16 Newton-Schulz)."""
    from tokenloom.models import GPT, GPTConfig
    from tokenloom.training.optim import create_optimizer, hidden_matrices
    from tokenloom.training.schedules import create_scheduler

    weights = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=23, num_layers=2, num_heads=2, embed_dim=32, max_seq_len=16, dropout=0.0))
        opt = create_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), optimizer=optimizer,
                               hidden=hidden_matrices(model), tensor_lr=compiled)
        step = compile_module.CompiledStep(opt) if compiled else opt.step
        schedule = create_scheduler(opt, "cosine", warmup_steps=2, max_steps=3, min_ratio=0.1)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            step()
            schedule.step()
        weights[compiled] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        assert not compiled or step.compiled is not None  # compiled, not fallen back
    assert _relative_difference(weights[False], weights[True]) <= rtol


@pytest.mark.slow
@pytest.mark.skipif(compile_unavailable() is not None, reason=f"torch.compile unavailable: {compile_unavailable()}")
@pytest.mark.parametrize("precision,atol", [("fp32", 1e-5), ("bf16", 5e-3)])
def test_training_with_a_compiled_step_follows_training_with_an_eager_one(tmp_path, precision, atol):
    """The model compiled in both (the compiled forward's own rounding is test_compiled_training_follows_...); the
    step eager or compiled: the weights after 3 steps agree within ``atol`` (bf16: the float32 masters, trained on
    bf16 gradients)."""
    from test_trainer import params

    cfg = recipe(tmp_path, max_steps=3, eval_every=0, checkpoint_every=0, precision=precision)
    overrides = ["model.dropout=0.0"]
    eager, a = run(cfg, tmp_path / "eager", overrides=[*overrides, "train.compile=model"])
    compiled, b = run(cfg, tmp_path / "compiled", overrides=[*overrides, "train.compile=step"])
    assert eager.compiled_step is None and compiled.compiled_step.compiled is not None
    x, y = params(eager.model), params(compiled.model)
    assert max(float((x[k] - y[k]).abs().max()) for k in x) <= atol
    assert b["val_loss"] == pytest.approx(a["val_loss"], abs=10 * atol)


@pytest.mark.slow
@pytest.mark.skipif(compile_unavailable() is not None, reason=f"torch.compile unavailable: {compile_unavailable()}")
@pytest.mark.parametrize("compile", ["step", "model"])
def test_a_compiled_run_resumes_exactly(tmp_path, compile):
    """Each run in a process of its own, as the CLI runs them (the uninterrupted run, its first half, its resumed
    second half), on one thread: Inductor's CPU kernels are not run-to-run deterministic on two threads here (two
    identical compiled 3-step runs in two processes differed by ~2e-6; on one thread they are equal; eager runs are
    equal on two; TORCHINDUCTOR_DETERMINISTIC=1 did not change it), so bit-exactness is a property of one thread.
    Within one process a later compilation differs from the first alike."""
    import subprocess
    import sys
    from pathlib import Path

    script = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from pathlib import Path
from safetensors.torch import save_file
from test_trainer import params, recipe, run
tmp, stage = Path({str(tmp_path)!r}), sys.argv[1]
cfg = recipe(tmp, compile={compile!r}, max_steps=6, eval_every=3, checkpoint_every=3, threads=1)
if stage == "full":
    trainer, _ = run(cfg, tmp / "full")
elif stage == "first":
    trainer, first = run(cfg, tmp / "split", overrides=["train.stop_after_steps=3"])
    assert first["step"] == 3
else:
    trainer, _ = run(cfg, tmp / "split", resume=True)
    assert trainer.step == 6
assert (trainer.compiled_step if {compile!r} == "step" else trainer.forward_model).compiled is not None
save_file({{k: v.contiguous() for k, v in params(trainer.model).items()}}, str(tmp / (stage + ".safetensors")))
"""
    for stage in ("full", "first", "resume"):
        out = subprocess.run([sys.executable, "-W", "ignore", "-c", script, stage], capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
    from safetensors.torch import load_file

    a, b = load_file(str(tmp_path / "full.safetensors")), load_file(str(tmp_path / "resume.safetensors"))
    assert [k for k in a if not torch.equal(a[k], b[k])] == []

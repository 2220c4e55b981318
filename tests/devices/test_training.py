"""The Trainer on an accelerator (the stand-in of tests/devices/accelerator.py): batches built on the CPU and moved
once per step, evaluation, checkpoints written from device tensors and loaded on the CPU, and the same training as
on the CPU. And fp16's gradient scaler: overflowing steps skipped and counted, the scale lowered, exact resume."""

from __future__ import annotations

import pytest
import torch

from tests.devices.accelerator import ACCELERATOR, AcceleratorMode, OnDevice
from tests.training.test_trainer import recipe, run
from tokenloom.checkpoint import load_model
from tokenloom.devices import DeviceChoice
from tokenloom.hardware import PrecisionChoice
from tokenloom.training import load_run_config, setup_run


@pytest.fixture
def on_accelerator(monkeypatch):
    """The Trainer's device is the stand-in accelerator (module parameters swapped in place, so tied weights stay
    tied as ``.to("cuda")`` keeps them)."""
    monkeypatch.setattr("tokenloom.training.trainer.training_device",
                        lambda *a, **k: DeviceChoice(ACCELERATOR, "meta", "the tests' stand-in accelerator"))
    monkeypatch.setattr(torch.__future__, "get_swap_module_params_on_conversion", lambda: True)
    with AcceleratorMode():
        yield


def test_training_on_the_accelerator_matches_the_cpu_and_its_checkpoint_loads_on_the_cpu(tmp_path, monkeypatch):
    cfg = recipe(tmp_path, max_steps=6, eval_every=3, checkpoint_every=3)
    cpu, cpu_summary = run(cfg, tmp_path / "cpu")
    monkeypatch.setattr("tokenloom.training.trainer.training_device",
                        lambda *a, **k: DeviceChoice(ACCELERATOR, "meta", "the tests' stand-in accelerator"))
    monkeypatch.setattr(torch.__future__, "get_swap_module_params_on_conversion", lambda: True)
    with AcceleratorMode():
        acc, summary = run(cfg, tmp_path / "acc")
        weights = {k: v for k, v in acc.model.state_dict().items()}
        assert all(isinstance(v, OnDevice) for v in weights.values())
        assert acc.model.lm_head.weight is acc.model.tok_embed.weight  # still tied
        weights = {k: v.cpu() for k, v in weights.items()}
    for key in ("train_loss", "val_loss"):
        assert summary[key] == pytest.approx(cpu_summary[key], rel=1e-4), key
    for name, value in cpu.model.state_dict().items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5)
    loaded, _ = load_model(tmp_path / "acc")  # written from device tensors, read on the CPU
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, weights[name]), name


def test_resume_on_the_accelerator_is_exact(tmp_path, on_accelerator):
    cfg = recipe(tmp_path)
    full, _ = run(cfg, tmp_path / "full")
    run(cfg, tmp_path / "split", overrides=["train.stop_after_steps=4"])
    resumed, _ = run(cfg, tmp_path / "split", resume=True)
    for name, value in full.model.state_dict().items():
        assert torch.equal(value.cpu(), resumed.model.state_dict()[name].cpu()), name


def _fp16_on_cpu(monkeypatch):
    """fp16 with its scaler, on the CPU (torch's CPU autocast and GradScaler take float16): the logic a CUDA run
    uses, checked without a GPU."""
    monkeypatch.setattr("tokenloom.training.trainer.choose_precision",
                        lambda requested, **k: PrecisionChoice("fp16", "fp16", ""))


def test_fp16_scales_the_loss_skips_overflowing_steps_and_resumes_exactly(tmp_path, monkeypatch):
    _fp16_on_cpu(monkeypatch)
    cfg = recipe(tmp_path, precision="auto", max_steps=6, checkpoint_every=3)
    trainer = setup_run(load_run_config(cfg), tmp_path / "r", show_progress=False)
    assert trainer.scaler is not None and trainer.config.train.precision == "fp16"
    scale = trainer.scaler.get_scale()
    real = trainer.task.loss
    calls = {"n": 0}

    def overflow_once(model, batch):  # the second micro-batch's gradients overflow float16
        calls["n"] += 1
        loss, n = real(model, batch)
        return (loss * 1e30 if calls["n"] == 2 else loss), n

    trainer.task.loss = overflow_once
    trainer.fit()
    assert trainer.step == 6 and trainer.nonfinite_steps == 1 and trainer.nonfinite_streak == 0
    assert trainer.scaler.get_scale() < scale  # lowered after the overflow
    # resume: the scaler's state comes back with the rest
    full, _ = run(cfg, tmp_path / "full")
    run(cfg, tmp_path / "split", overrides=["train.stop_after_steps=3"])
    resumed, _ = run(cfg, tmp_path / "split", resume=True)
    assert resumed.scaler.get_scale() == full.scaler.get_scale()
    for name, value in full.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name

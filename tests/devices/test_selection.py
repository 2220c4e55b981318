"""Device and precision chosen for the hardware, from mocked capabilities (CUDA with and without bf16, several GPUs,
MPS, a CPU with and without native bf16), and the one-line errors for a device or precision the machine lacks."""

from __future__ import annotations

import pytest
import torch

from tokenloom.cli.main import main
from tokenloom.devices import Accelerators, choose_device
from tokenloom.errors import ConfigError
from tokenloom.hardware import Bf16Support, choose_inference_precision, choose_precision
from tokenloom.training.distributed import resolve_backend

CPU_ONLY = Accelerators(cuda=0, mps=False)
TWO_GPUS = Accelerators(cuda=2, mps=False, cuda_names=("NVIDIA H100", "NVIDIA H100"))
MAC = Accelerators(cuda=0, mps=True)
NATIVE = Bf16Support(True, "native")
EMULATED = Bf16Support(False, "emulated")


def never() -> float:
    raise AssertionError("not measured")


@pytest.mark.parametrize("accelerators, want", [(CPU_ONLY, "cpu"), (TWO_GPUS, "cuda:0"), (MAC, "mps")])
def test_auto_takes_cuda_then_mps_then_the_cpu_and_says_why(accelerators, want):
    choice = choose_device("auto", accelerators)
    assert str(choice.device) == want and choice.requested == "auto"
    assert choice.describe().startswith(f"device: {want} (auto: ")
    assert (choice.reason == "auto: CUDA GPU 0 NVIDIA H100") == (want == "cuda:0")


def test_each_process_takes_its_local_gpu():
    assert choose_device("auto", TWO_GPUS, local_rank=1).device == torch.device("cuda", 1)
    assert choose_device("cuda", TWO_GPUS, local_rank=1).device == torch.device("cuda", 1)
    assert choose_device("cuda:0", TWO_GPUS, local_rank=1).device == torch.device("cuda", 0)  # as given
    assert choose_device("auto", CPU_ONLY, local_rank=3).device == torch.device("cpu")


@pytest.mark.parametrize("requested, accelerators, words", [
    ("cuda", CPU_ONLY, "device cuda: CUDA is not available"),
    ("cuda:3", TWO_GPUS, "device cuda:3: only 2 CUDA device(s) visible; this machine has: cpu, cuda:0, cuda:1"),
    ("mps", CPU_ONLY, "device mps: not available"),
    ("tpu", CPU_ONLY, "device 'tpu' is not one of auto, cpu, cuda, cuda:N, mps (this machine has: cpu)"),
    ("cpu:1", CPU_ONLY, "device 'cpu:1': only cuda takes an index"),
])
def test_a_device_the_machine_lacks_is_one_line_naming_what_it_has(requested, accelerators, words):
    with pytest.raises(ConfigError) as err:
        choose_device(requested, accelerators)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert "this machine has: " in str(err.value)


def test_training_precision_follows_the_device():
    assert choose_precision("auto", device="cuda:0", gpu_bf16=lambda: True).precision == "bf16-autocast"
    old_gpu = choose_precision("auto", device="cuda:0", gpu_bf16=lambda: False)
    assert old_gpu.precision == "fp16" and "gradient scaler" in old_gpu.reason
    assert choose_precision("fp16", device="cuda").precision == "fp16"
    assert choose_precision("bf16", device="cuda", gpu_bf16=never).precision == "bf16"  # as asked
    assert choose_precision("auto", device="mps").precision == "fp32"
    assert choose_precision("auto", device="cpu", support=lambda: NATIVE).precision == "bf16"
    assert choose_precision("auto", device="cpu", support=lambda: EMULATED).precision == "fp32"


def test_inference_precision_follows_the_device():
    assert choose_inference_precision("auto", never, device="cuda:1", gpu_bf16=lambda: True).precision == "bf16"
    assert choose_inference_precision("auto", never, device="cuda:1", gpu_bf16=lambda: False).precision == "fp16"
    assert choose_inference_precision("auto", never, device="mps").precision == "fp32"
    assert choose_inference_precision("auto", lambda: 2.0, support=lambda: NATIVE, device="cpu").precision == "bf16"


@pytest.mark.parametrize("choose", [lambda: choose_precision("fp16", device="cpu"),
                                    lambda: choose_inference_precision("fp16", never, device="cpu"),
                                    lambda: choose_precision("fp16", device="mps")])
def test_fp16_off_cuda_is_one_line(choose):
    with pytest.raises(ConfigError, match=r"^precision fp16 needs a CUDA GPU .*; use auto, fp32 or bf16$"):
        choose()


def test_the_process_group_backend_follows_the_device():
    assert resolve_backend("auto", "cpu") == "gloo"
    with pytest.raises(ConfigError, match="train.backend=nccl"):
        resolve_backend("nccl", "cpu")  # nccl reduces CUDA tensors only


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without CUDA")
@pytest.mark.parametrize("argv", [
    ["generate", "checkpoints/shakespeare-char", "--device", "cuda", "--max-new-tokens", "2"],
    ["evaluate", "checkpoints/shakespeare-char", "--device", "cuda:3"],
    ["translate", "checkpoints/multi30k-de-en", "--device", "mps"],
    ["generate", "checkpoints/shakespeare-char", "--precision", "fp16", "--max-new-tokens", "2"],
])
def test_the_commands_refuse_a_missing_device_in_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and ("device" in err or "fp16" in err), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without CUDA")
def test_train_refuses_cuda_and_nccl_without_a_gpu_in_one_line(tmp_path, capsys):
    recipe = "configs/shakespeare-char.yaml"
    assert main(["train", recipe, "--out", str(tmp_path / "a"), "--device", "cuda"]) == 2
    assert main(["train", recipe, "--out", str(tmp_path / "b"), "--set", "train.device=gpu"]) == 2
    assert main(["train", recipe, "--out", str(tmp_path / "c"), "--set", "train.precision=fp16"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines), lines
    assert "CUDA is not available" in lines[0] and "train.device" in lines[1] and "fp16" in lines[2]
    assert not (tmp_path / "a" / "checkpoint").exists()

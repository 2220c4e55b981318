"""precision: auto — bf16 where the CPU has native bf16 matrix instructions, fp32 elsewhere — from (mocked) capability
answers; the one-time warning on emulated bf16; the measurement cache that keeps a measured choice stable; the
machine line that figures and checkpoints carry."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import yaml

from tokenloom import hardware
from tokenloom.errors import ConfigError
from tokenloom.hardware import Bf16Support, Machine, bf16_support, choose_inference_precision, choose_precision

HERE = hardware.machine()
BASE = Machine(cpu="Test CPU", arch="x86_64", cores=2, threads=2, amx=False, avx512_bf16=False, avx512=False,
               avx2=True, aten_kernels="AVX2", onednn_isa_cap=None, torch="2.13.0")
SAPPHIRE_RAPIDS = dataclasses.replace(BASE, cpu="Intel Xeon 8480", amx=True, avx512_bf16=True, avx512=True,
                                      aten_kernels="AVX512")
ZEN4 = dataclasses.replace(BASE, cpu="AMD EPYC 9654", avx512_bf16=True, avx512=True, aten_kernels="AVX512")
SKYLAKE = dataclasses.replace(BASE, cpu="Intel Xeon 6148", avx512=True, aten_kernels="AVX512")


def never() -> float:
    raise AssertionError("the flags settle it: nothing is measured")


@pytest.fixture(autouse=True)
def _fresh_warning(monkeypatch):
    monkeypatch.setattr(hardware, "_warned_emulated", False)


@pytest.mark.parametrize("machine, native, words", [
    (SAPPHIRE_RAPIDS, True, "native bf16 matrix instructions (AMX)"),
    (SKYLAKE, False, "no native bf16 matrix instructions (AVX-512, AVX2, no AMX)"),
    (BASE, False, "no native bf16 matrix instructions (AVX2, no AMX)"),
    (dataclasses.replace(ZEN4, onednn_isa_cap="AVX2"), False, "ONEDNN_MAX_CPU_ISA=AVX2 keeps oneDNN off"),
    (dataclasses.replace(ZEN4, onednn_isa_cap="AVX512_CORE"), False, "ONEDNN_MAX_CPU_ISA=AVX512_CORE"),
    (dataclasses.replace(SAPPHIRE_RAPIDS, onednn_isa_cap="ALL"), True, "(AMX)"),
])
def test_flags_settle_native_bf16(machine, native, words):
    found = bf16_support(machine, measure=never)
    assert found.native is native and words in found.reason, found.reason


@pytest.mark.parametrize("machine", [dataclasses.replace(BASE, arch="aarch64", avx2=False),
                                     dataclasses.replace(ZEN4, onednn_isa_cap="AVX_FUTURE_THING")])
@pytest.mark.parametrize("speedup, native", [(2.5, True), (0.4, False)])
def test_where_the_flags_do_not_settle_it_a_measurement_does(machine, speedup, native):
    calls = []
    found = bf16_support(machine, measure=lambda: calls.append(1) or speedup)
    assert calls == [1] and found.native is native and f"{speedup:.2f}x the float32 speed" in found.reason


@pytest.mark.parametrize("machine", [ZEN4, dataclasses.replace(SAPPHIRE_RAPIDS, onednn_isa_cap="AVX512_CORE_BF16")])
@pytest.mark.parametrize("speedup, native, words", [(1.8, True, "native bf16 matrix instructions"),
                                                    (0.5, False, "bf16 is not faster than float32 on this CPU")])
def test_avx512_bf16_without_amx_is_measured(machine, speedup, native, words):
    """The flags do not settle AVX512-BF16 without AMX (an Intel Xeon measured 0.5x float32 there, AMD Zen 4 faster):
    the product's measured speed does."""
    calls = []
    found = bf16_support(machine, measure=lambda: calls.append(1) or speedup)
    assert calls == [1] and found.native is native, found.reason
    assert words in found.reason and f"{speedup:.2f}x the float32 speed" in found.reason


NATIVE = Bf16Support(True, "the CPU has native bf16 matrix instructions (AVX512-BF16, no AMX)")
EMULATED = Bf16Support(False, "the CPU has no native bf16 matrix instructions (AVX2, no AMX): bf16 is emulated")


def test_auto_trains_in_bf16_where_native_and_fp32_elsewhere():
    native = choose_precision("auto", support=lambda: NATIVE)
    assert (native.precision, native.requested) == ("bf16", "auto")
    assert native.describe() == f"precision auto -> bf16: {NATIVE.reason}"
    emulated = choose_precision("auto", support=lambda: EMULATED)
    assert emulated.precision == "fp32" and "no native bf16" in emulated.describe()
    assert emulated.as_dict() == {"requested": "auto", "chosen": "fp32", "reason": EMULATED.reason}


def test_explicit_bf16_on_emulated_hardware_warns_once_naming_the_slowdown(monkeypatch):
    monkeypatch.setattr(hardware, "bf16_matmul_speedup", lambda: 0.25)
    with pytest.warns(hardware.EmulatedBf16Warning, match=r"precision bf16: .*emulated; a bf16 matrix product runs "
                                                          r"4\.0x slower than float32") as seen:
        assert choose_precision("bf16", support=lambda: EMULATED).precision == "bf16"  # kept: it was asked for
        assert choose_precision("bf16-autocast", support=lambda: EMULATED).precision == "bf16-autocast"
        assert choose_inference_precision("bf16", never, support=lambda: EMULATED).precision == "bf16"
    assert len(seen) == 1  # once per process


def test_explicit_precisions_on_native_hardware_are_kept_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_precision("bf16", support=lambda: NATIVE).precision == "bf16"
        assert choose_precision("fp32", support=lambda: EMULATED).describe() == "precision fp32"
        assert choose_inference_precision("fp32", never, support=never).precision == "fp32"


def test_a_bad_precision_is_a_one_line_config_error():
    with pytest.raises(ConfigError, match="precision must be one of auto, fp32, bf16, bf16-autocast, fp16, got 'fp8'"):
        choose_precision("fp8")
    with pytest.raises(ConfigError, match=r"\$TOKENLOOM_PRECISION\), got 'half'"):
        choose_inference_precision("half", never)


@pytest.mark.parametrize("speedup, chosen", [(2.7, "bf16"), (1.1, "fp32"), (0.4, "fp32")])
def test_inference_auto_measures_only_where_bf16_is_native(speedup, chosen):
    choice = choose_inference_precision("auto", lambda: speedup, support=lambda: NATIVE)
    assert choice.precision == chosen and f"ran {speedup:.2f}x as fast with bf16" in choice.reason
    assert ("under the 1.25x that pays" in choice.reason) is (chosen == "fp32")
    emulated = choose_inference_precision("auto", never, support=lambda: EMULATED)
    assert emulated.precision == "fp32" and emulated.reason == EMULATED.reason


def test_a_measurement_is_remembered_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    measure = lambda: calls.append(1) or 1.7  # noqa: E731
    assert hardware.remembered("decode, width 384", measure) == (1.7, False)
    assert hardware.remembered("decode, width 384", measure) == (1.7, True)
    assert hardware.remembered("decode, width 768", measure) == (1.7, False)
    assert len(calls) == 2
    stored = json.loads((tmp_path / "cache" / "measurements.json").read_text())
    assert len(stored) == 2 and all(HERE.cpu in key and f"torch {HERE.torch}" in key for key in stored)
    (tmp_path / "cache" / "measurements.json").write_text("{not json")  # a damaged cache: measured again
    assert hardware.remembered("decode, width 384", measure) == (1.7, False)
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache" / "measurements.json" / "sub"))  # unwritable
    assert hardware.remembered("decode, width 384", measure) == (1.7, False)


def test_the_machine_line_names_cpu_features_cores_and_torch(monkeypatch):
    line = ZEN4.describe()
    assert line.startswith("AMD EPYC 9654 (AVX512-BF16, AVX-512, AVX2, no AMX; 2 cores, 2 threads; ATen AVX512")
    assert line.endswith("torch 2.13.0")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2" in ZEN4.describe()
    info = HERE.as_dict()
    yaml.safe_dump(info)  # plain types: checkpoints and benchmark JSON carry it
    assert info["cpu"] == HERE.cpu and info["cores"] >= 1 and info["torch"] == HERE.torch


def test_the_flags_of_this_machine_agree_with_torch():
    import torch

    assert HERE.amx == torch.cpu._is_amx_tile_supported()
    assert HERE.avx512_bf16 == torch.cpu._is_avx512_bf16_supported()
    assert HERE.aten_kernels == torch.backends.cpu.get_cpu_capability()


def test_measurements_leave_the_global_random_stream_alone():
    """A measurement at the start of a run (auto's, or the emulated-bf16 warning's) must not shift the run's dropout
    or sampling stream: a first run measured and later ones did not, and their weights differed."""
    import torch

    from tokenloom.nn.fused import decode_bf16_speedup

    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    hardware.bf16_matmul_speedup(size=64, repeats=1)
    decode_bf16_speedup(32, repeats=1)
    assert torch.equal(torch.rand(3), expected)

"""The machine this process runs on, and the precision chosen for it.

bfloat16 is fast on a CPU only where the CPU has native bf16 matrix instructions: Intel AMX (Sapphire Rapids
and later) or AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake). Elsewhere (AVX2 or plain AVX-512) PyTorch
and oneDNN emulate bf16 with float32 arithmetic plus conversions, which is slower than float32 itself. So
``precision: auto`` (the recipes' default) trains in bf16 where the CPU has native support and in fp32
otherwise, and an explicit ``bf16`` on a CPU without it warns once, naming the slowdown measured on the spot.

The feature flags come from PyTorch (``torch.cpu._is_amx_tile_supported()`` and friends: what the CPU has) and
from ``ONEDNN_MAX_CPU_ISA`` (what oneDNN, which runs the bf16 matrix products, is allowed to use). Where the
flags do not settle it (a CPU that is not x86-64, an ISA cap this module does not know), a short measurement
of a bf16 and a float32 matrix product decides. Inference (``--precision auto`` on generate, translate,
evaluate, serve, ...) adds a measurement of the decode step's kernels at the model's width, see
:func:`choose_inference_precision`: whether bf16 weights pay for decoding depends on how far the CPU's float32
matrix-vector kernels are from the memory bound, which no flag tells.

Example::

    >>> choice = choose_precision("auto")
    >>> choice.precision, choice.reason        # doctest: +SKIP
    ('bf16', 'the CPU has native bf16 matrix instructions (AVX512-BF16, no AMX)')
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ConfigError

PRECISION_CHOICES = ("auto", "fp32", "bf16", "bf16-autocast", "fp16")  # train.precision
INFERENCE_PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # --precision of the commands that run a model

# oneDNN's CPU ISA names (ONEDNN_MAX_CPU_ISA), lowest first; from AVX512_CORE_BF16 on, bf16 dot products are native
_ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
                "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "ALL")
_FIRST_NATIVE_BF16 = _ONEDNN_ISAS.index("AVX512_CORE_BF16")
_FIRST_AMX = _ONEDNN_ISAS.index("AVX10_1_512_AMX")


@dataclass(frozen=True)
class Machine:
    """What the CPU has and what the libraries are allowed to use of it."""

    cpu: str  # the CPU's model name
    arch: str  # platform.machine(): x86_64, aarch64, ...
    cores: int  # cores this process may run on
    threads: int  # torch's intra-op threads
    amx: bool  # AMX tiles (Intel Sapphire Rapids and later)
    avx512_bf16: bool  # AVX512-BF16 dot products (AMD Zen 4+, Intel Cooper Lake+)
    avx512: bool
    avx2: bool
    aten_kernels: str  # the vectorised ATen kernels in use: torch.backends.cpu.get_cpu_capability()
    onednn_isa_cap: str | None  # ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA), upper-cased, if set
    torch: str

    @property
    def features(self) -> str:
        """``AMX, AVX512-BF16, AVX-512, AVX2`` (those present), ``no AMX`` where it is missing."""
        have = [name for name, present in (("AMX", self.amx), ("AVX512-BF16", self.avx512_bf16),
                                           ("AVX-512", self.avx512), ("AVX2", self.avx2)) if present]
        if self.arch in ("x86_64", "AMD64") and not self.amx:
            have.append("no AMX")
        return ", ".join(have) or "no AVX2"

    @property
    def kernel_settings(self) -> str:
        """The environment variables that force other kernels, where set (``ATEN_CPU_CAPABILITY=avx2 ...``)."""
        names = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                 "OMP_NUM_THREADS")
        return " ".join(f"{n}={os.environ[n]}" for n in names if os.environ.get(n))

    def describe(self) -> str:
        """One line for logs and benchmark output: CPU, features, cores, torch, forced kernel settings."""
        forced = f"; {self.kernel_settings}" if self.kernel_settings else ""
        return (f"{self.cpu} ({self.features}; {self.cores} cores, {self.threads} threads; ATen {self.aten_kernels}"
                f"{forced}), torch {self.torch}")

    def as_dict(self) -> dict[str, object]:
        return {"cpu": self.cpu, "arch": self.arch, "cores": self.cores, "threads": self.threads,
                "features": self.features, "aten_kernels": self.aten_kernels,
                "kernel_settings": self.kernel_settings, "torch": self.torch}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")) and ":" in line:
                    name = line.split(":", 1)[1].strip()
                    if name:
                        return name
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _flag(name: str) -> bool:
    check = getattr(torch.cpu, name, None)
    try:
        return bool(check()) if check is not None else False
    except Exception:  # noqa: BLE001 - a build without cpuinfo: the feature counts as absent
        return False


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def machine() -> Machine:
    """This machine: the CPU and its flags read once per process, torch's thread count as it is now."""
    return dataclasses.replace(_machine(), threads=torch.get_num_threads())


@functools.lru_cache(maxsize=1)
def _machine() -> Machine:
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return Machine(cpu=_cpu_name(), arch=platform.machine(), cores=_cores(), threads=torch.get_num_threads(),
                   amx=_flag("_is_amx_tile_supported"), avx512_bf16=_flag("_is_avx512_bf16_supported"),
                   avx512=_flag("_is_avx512_supported"), avx2=_flag("_is_avx2_supported"),
                   aten_kernels=torch.backends.cpu.get_cpu_capability(),
                   onednn_isa_cap=cap.strip().upper() if cap else None, torch=str(torch.__version__))


# --- native bf16 ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Bf16Support:
    native: bool
    reason: str  # why, in words: "the CPU has native bf16 matrix instructions (AVX512-BF16, no AMX)"


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (first-call allocations, oneDNN primitive creation)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bf16_matmul_speedup(size: int = 512, repeats: int = 5) -> float:
    """How many times faster a ``size``-cubed bf16 matrix product runs than a float32 one here, now
    (< 1: bf16 is slower). About 20 to 100 ms."""
    gen = torch.Generator().manual_seed(0)  # never the global generator: a run's random stream stays as it was
    a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
    a16, b16 = a.bfloat16(), b.bfloat16()
    with torch.no_grad():
        fp32 = _time(lambda: torch.mm(a, b), repeats)
        bf16 = _time(lambda: torch.mm(a16, b16), repeats)
    return fp32 / bf16


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 5,
                device: torch.device | str | None = None) -> float:
    """FLOP/s of the best of ``repeats`` (size x size) @ (size x size) products in ``dtype`` on ``device`` (default
    the CPU; after one warm-up; an accelerator synchronised before each clock reading, larger products there).
    The matrices come from a private generator: the global random stream (a training run's) stays as it was."""
    from .devices import synchronize

    device = torch.device(device or "cpu")
    if device.type != "cpu":
        size *= 4  # a GPU needs large products to reach its peak
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    a @ b
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def remembered_matmul_peak(dtype: torch.dtype, device: torch.device | str | None = None,
                           at_least: float | None = None) -> float:
    """:func:`matmul_peak` of ``dtype`` on ``device`` (the roofline ``tokenloom bench roofline`` measures), measured
    once on this machine and then :func:`remembered`: the denominator of a training run's MFU. ``at_least`` (FLOP/s a
    run reached): a remembered peak below it was measured while the machine was busy; it is measured again."""
    device = torch.device(device or "cpu")
    where = f" on {torch.cuda.get_device_name(device)}" if device.type == "cuda" else \
        f" on {device.type}" if device.type != "cpu" else ""
    return remembered(f"matmul peak {str(dtype).removeprefix('torch.')}{where}",
                      lambda: matmul_peak(dtype, device=device), at_least)[0]


def bf16_support(m: Machine | None = None, measure: Callable[[], float] | None = None) -> Bf16Support:
    """Whether bf16 matrix products run natively here, by the CPU's flags and oneDNN's ISA cap; measured
    (``measure``, default :func:`bf16_matmul_speedup`, remembered per machine for AVX512-BF16 CPUs) where the flags
    do not settle it: bf16 counts as native at 1.2x the float32 speed or more."""
    m = m or machine()
    x86 = m.arch in ("x86_64", "AMD64", "i686", "x86")
    cap = m.onednn_isa_cap
    known_cap = cap is None or cap in _ONEDNN_ISAS
    if x86 and known_cap:
        units = "AMX" if m.amx else "AVX512-BF16, no AMX" if m.avx512_bf16 else None
        if units is None:
            return Bf16Support(False, f"the CPU has no native bf16 matrix instructions ({m.features}): bf16 is "
                                      "emulated")
        if cap is not None and _ONEDNN_ISAS.index(cap) < _FIRST_NATIVE_BF16:
            return Bf16Support(False, f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN off the CPU's bf16 instructions: "
                                      "bf16 is emulated")
        if m.amx and cap is not None and _ONEDNN_ISAS.index(cap) < _FIRST_AMX:
            units = f"AVX512-BF16; AMX off by ONEDNN_MAX_CPU_ISA={cap}"
        if units == "AMX":
            return Bf16Support(True, f"the CPU has native bf16 matrix instructions ({units})")
        # AVX512-BF16 without AMX: 1.5-2x float32 on AMD Zen 4, 0.5x on an Intel Xeon measured (oneDNN does not
        # use the instructions there), so the flags do not settle it: a product timed once and remembered does
        speedup = measure() if measure is not None else remembered("bf16 matmul speedup", bf16_matmul_speedup)[0]
        measured = f"a bf16 matrix product measured {speedup:.2f}x the float32 speed"
        if speedup >= 1.2:
            return Bf16Support(True, f"the CPU has native bf16 matrix instructions ({units}; {measured})")
        return Bf16Support(False, f"bf16 is not faster than float32 on this CPU ({units}; {measured})")
    speedup = (measure or bf16_matmul_speedup)()
    where = f"ONEDNN_MAX_CPU_ISA={cap} is not a setting this check knows" if not known_cap else f"a {m.arch} CPU"
    return Bf16Support(speedup >= 1.2, f"{where}: a bf16 matrix product measured {speedup:.2f}x the float32 speed")


# --- choosing a precision -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PrecisionChoice:
    precision: str  # fp32 | bf16 | bf16-autocast
    requested: str  # what the recipe or the command line said: auto | fp32 | bf16 | bf16-autocast
    reason: str  # why, for auto ("" when the precision was given)

    def describe(self) -> str:
        """``precision auto -> bf16: the CPU has ...`` or ``precision fp32``."""
        if self.requested == "auto":
            return f"precision auto -> {self.precision}: {self.reason}"
        return f"precision {self.precision}"

    def as_dict(self) -> dict[str, str]:
        return {"requested": self.requested, "chosen": self.precision, "reason": self.reason}


_warned_emulated = False


class EmulatedBf16Warning(UserWarning):
    """bf16 asked for on a CPU that emulates it (slower than fp32)."""


def warn_emulated_bf16(requested: str, support: Bf16Support, measure: Callable[[], float] | None = None) -> None:
    """Warn, once per process, that ``requested`` (bf16 or bf16-autocast) runs emulated here, with the slowdown of
    a bf16 matrix product against float32 measured now."""
    global _warned_emulated
    if _warned_emulated:
        return
    _warned_emulated = True
    speedup = (measure or bf16_matmul_speedup)()
    slower = f"{1 / speedup:.1f}x slower than" if speedup < 1 else f"{speedup:.2f}x the speed of"
    warnings.warn(f"precision {requested}: {support.reason}; a bf16 matrix product runs {slower} float32 on this "
                  f"machine ({machine().cpu}); precision auto or fp32 is faster here", EmulatedBf16Warning,
                  stacklevel=3)


def cuda_bf16_supported(device: torch.device) -> bool:
    """Whether the CUDA GPU ``device`` computes in bfloat16 natively (compute capability 8.0, Ampere, and later)."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def _device_type(device: torch.device | str | None) -> str:
    return torch.device(device if device is not None else "cpu").type


def _refuse_fp16(requested: str, device_type: str) -> None:
    if requested == "fp16" and device_type != "cuda":
        raise ConfigError(f"precision fp16 needs a CUDA GPU (the device is {device_type}); use auto, fp32 or bf16")


def _accelerator_precision(requested: str, device: torch.device | str, gpu_bf16: Callable[[], bool] | None,
                           bf16: str) -> PrecisionChoice:
    """The precision on a CUDA or MPS ``device`` (training and inference alike; ``bf16`` names the bf16 choice):
    an explicit one is kept; ``auto`` -> bf16 on a GPU that computes in it, fp16 on an older GPU, fp32 on MPS."""
    if requested != "auto":
        return PrecisionChoice(requested, requested, "")
    if _device_type(device) == "mps":
        return PrecisionChoice("fp32", requested, "Apple MPS: float32 (bf16 support varies by macOS version)")
    if (gpu_bf16 or (lambda: cuda_bf16_supported(torch.device(device))))():
        return PrecisionChoice(bf16, requested, "the GPU computes in bf16 (compute capability >= 8)")
    return PrecisionChoice("fp16", requested, "the GPU has no bf16 (compute capability < 8): float16"
                           + (" with a gradient scaler" if bf16 == "bf16-autocast" else ""))


def choose_precision(requested: str, support: Callable[[], Bf16Support] | None = None,
                     device: torch.device | str | None = "cpu",
                     gpu_bf16: Callable[[], bool] | None = None) -> PrecisionChoice:
    """The training precision for ``requested`` on ``device``.

    CPU: ``auto`` -> bf16 (bf16 weights with float32 masters) where bf16 is native, else fp32; an explicit bf16 /
    bf16-autocast is kept, with a one-time warning where it is emulated. CUDA: ``auto`` -> bf16-autocast (float32
    weights, bf16 matmuls: what the GPU's tensor cores want) where the GPU has bf16 (``gpu_bf16()``, default
    :func:`cuda_bf16_supported`: Ampere and later), else fp16 (float16 autocast with a gradient scaler). MPS:
    ``auto`` -> fp32. fp16 needs CUDA."""
    if requested not in PRECISION_CHOICES:
        raise ConfigError(f"precision must be one of {', '.join(PRECISION_CHOICES)}, got {requested!r}")
    kind = _device_type(device)
    _refuse_fp16(requested, kind)
    if requested == "fp32":
        return PrecisionChoice("fp32", requested, "")
    if kind != "cpu":
        return _accelerator_precision(requested, device, gpu_bf16, bf16="bf16-autocast")
    found = (support or bf16_support)()
    if requested == "auto":
        return PrecisionChoice("bf16" if found.native else "fp32", requested, found.reason)
    if not found.native:
        warn_emulated_bf16(requested, found)
    return PrecisionChoice(requested, requested, "")


def cache_dir() -> Path:
    """Where measurements are kept between runs: ``$TOKENLOOM_CACHE_DIR``, else ``$XDG_CACHE_HOME/tokenloom``, else
    ``~/.cache/tokenloom``."""
    if os.environ.get("TOKENLOOM_CACHE_DIR"):
        return Path(os.environ["TOKENLOOM_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenloom"


def remembered(name: str, measure: Callable[[], float], at_least: float | None = None) -> tuple[float, bool]:
    """(``measure()``, False) the first time on this machine, kernel settings and torch version; (the value
    measured then, True) afterwards, from ``cache_dir() / "measurements.json"``. A choice made from a measurement
    thus stays the same from run to run (a busy moment does not flip it); delete the file to measure again. An
    unreadable or unwritable cache only means measuring each time. ``at_least``: for a peak, a value the machine was
    seen to reach; a remembered one below it (measured in a busy moment) is measured again and the larger kept."""
    m = machine()
    key = f"{name} | {m.cpu} | {m.features} | {m.threads} threads | {m.kernel_settings or 'default kernels'} | " \
          f"torch {m.torch}"
    path = cache_dir() / "measurements.json"
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    old = known.get(key)
    old = float(old) if isinstance(old, (int, float)) and not isinstance(old, bool) and old > 0 else None
    if old is not None and (at_least is None or old >= at_least):
        return old, True
    value = measure() if old is None else max(old, measure())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**known, key: value}, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass
    return value, False


def choose_inference_precision(requested: str, decode_speedup: Callable[[], float],
                               support: Callable[[], Bf16Support] | None = None,
                               threshold: float = 1.25, device: torch.device | str | None = "cpu",
                               gpu_bf16: Callable[[], bool] | None = None) -> PrecisionChoice:
    """The weights' precision for running a model on ``device``. CPU: ``auto`` -> fp32 where bf16 is emulated;
    where it is native, bf16 if ``decode_speedup()`` (bf16 over float32 time of the model's decode-step kernels,
    measured now) is at least ``threshold``, else fp32 (bf16 weights change the results slightly; they must buy
    real speed). Callers pass a :func:`remembered` measurement so the choice is stable between runs. CUDA:
    ``auto`` -> bf16 where the GPU has it, else fp16. MPS: ``auto`` -> fp32. fp16 needs CUDA."""
    if requested not in INFERENCE_PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(INFERENCE_PRECISIONS)} (--precision or "
                          f"$TOKENLOOM_PRECISION), got {requested!r}")
    kind = _device_type(device)
    _refuse_fp16(requested, kind)
    if requested == "fp32":
        return PrecisionChoice("fp32", requested, "")
    if kind != "cpu":
        return _accelerator_precision(requested, device, gpu_bf16, bf16="bf16")
    found = (support or bf16_support)()
    if requested == "bf16":
        if not found.native:
            warn_emulated_bf16(requested, found)
        return PrecisionChoice("bf16", requested, "")
    if not found.native:
        return PrecisionChoice("fp32", requested, found.reason)
    speedup = decode_speedup()
    pick = "bf16" if speedup >= threshold else "fp32"
    return PrecisionChoice(pick, requested, f"{found.reason}; the decode step's matrix-vector product ran "
                                            f"{speedup:.2f}x as fast with bf16 weights"
                                            + ("" if pick == "bf16" else f", under the {threshold}x that pays"))

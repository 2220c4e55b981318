"""The device a model runs on: ``auto | cpu | cuda | cuda:N | mps``.

``auto`` (the default everywhere) takes the first CUDA GPU when there is one, else Apple's MPS, else the CPU, and
never fails; an explicit device that this machine does not have is a one-line :class:`~tokenloom.errors.ConfigError`
naming the devices it has. Under ``torchrun`` with CUDA, each process takes ``cuda:LOCAL_RANK``.

What the machine offers is read once into :class:`Accelerators` (and can be given instead, which is how the tests
choose for machines they do not run on)::

    >>> choose_device("auto", Accelerators(cuda=0, mps=False)).device
    device(type='cpu')
    >>> choose_device("cuda:1", Accelerators(cuda=2, mps=False)).device
    device(type='cuda', index=1)
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
from dataclasses import dataclass

import torch

from .errors import ConfigError

DEVICE_HELP = ("auto (a CUDA GPU, else Apple MPS, else the CPU; said on stderr) | cpu | cuda | cuda:N | mps; "
               "default: $TOKENLOOM_DEVICE or auto")
DEVICE = re.compile(r"^(auto|cpu|mps|cuda)(?::(\d+))?$")


@dataclass(frozen=True)
class Accelerators:
    """The accelerators this process can use: ``cuda`` visible CUDA devices (their names in ``cuda_names``) and
    whether Apple's MPS backend is available."""

    cuda: int
    mps: bool
    cuda_names: tuple[str, ...] = ()

    @classmethod
    def detect(cls) -> Accelerators:
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        names = tuple(torch.cuda.get_device_name(i) for i in range(cuda))
        mps_backend = getattr(torch.backends, "mps", None)
        return cls(cuda, bool(mps_backend is not None and mps_backend.is_available()), names)

    def available(self) -> list[str]:
        """The device names a user may give: ``cpu``, ``cuda:0`` ... and ``mps`` where present."""
        return ["cpu", *(f"cuda:{i}" for i in range(self.cuda)), *(["mps"] if self.mps else [])]


@dataclass(frozen=True)
class DeviceChoice:
    """The device chosen for a ``requested`` name, and why."""

    device: torch.device
    requested: str
    reason: str

    def describe(self) -> str:
        return f"device: {self.device} ({self.reason})"


def _why_no_cuda() -> str:
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    return "no CUDA GPU is visible (CUDA_VISIBLE_DEVICES, drivers)"


def choose_device(requested: str | None = "auto", accelerators: Accelerators | None = None,
                  local_rank: int | None = None) -> DeviceChoice:
    """The device for ``requested`` (None: ``auto``). ``local_rank`` (one process of several on this machine, e.g.
    ``LOCAL_RANK`` under torchrun) picks ``cuda:local_rank`` for ``auto`` and ``cuda``. A device this machine does
    not have raises a :class:`ConfigError` that lists the ones it has."""
    requested = str(requested or "auto").strip().lower()
    match = DEVICE.match(requested)
    acc = accelerators if accelerators is not None else Accelerators.detect()
    have = ", ".join(acc.available())
    if match is None:
        raise ConfigError(f"device {requested!r} is not one of auto, cpu, cuda, cuda:N, mps (this machine has: {have})")
    kind, index = match.group(1), match.group(2)
    if index is not None and kind != "cuda":
        raise ConfigError(f"device {requested!r}: only cuda takes an index (this machine has: {have})")
    if kind == "auto":
        if acc.cuda:
            i = local_rank if local_rank is not None else 0
            if i >= acc.cuda:
                raise ConfigError(f"process {i} of this machine has no GPU of its own: {acc.cuda} CUDA device(s) "
                                  f"visible (start at most {acc.cuda} processes)")
            name = f" {acc.cuda_names[i]}" if i < len(acc.cuda_names) else ""
            return DeviceChoice(torch.device("cuda", i), "auto", f"auto: CUDA GPU {i}{name}")
        if acc.mps:
            return DeviceChoice(torch.device("mps"), "auto", "auto: Apple MPS (no CUDA GPU)")
        return DeviceChoice(torch.device("cpu"), "auto", "auto: no CUDA GPU or Apple MPS")
    if kind == "cpu":
        return DeviceChoice(torch.device("cpu"), requested, "requested")
    if kind == "mps":
        if not acc.mps:
            where = "MPS needs macOS on Apple silicon" if platform.system() != "Darwin" else \
                "this torch build or macOS version has no MPS support"
            raise ConfigError(f"device mps: not available ({where}); this machine has: {have}")
        return DeviceChoice(torch.device("mps"), requested, "requested")
    if not acc.cuda:
        raise ConfigError(f"device {requested}: CUDA is not available ({_why_no_cuda()}); this machine has: {have}")
    i = int(index) if index is not None else (local_rank if local_rank is not None else 0)
    if i >= acc.cuda:
        raise ConfigError(f"device cuda:{i}: only {acc.cuda} CUDA device(s) visible; this machine has: {have}")
    return DeviceChoice(torch.device("cuda", i), requested, "requested")


def default_device() -> str:
    """``$TOKENLOOM_DEVICE`` or ``auto``: the commands' default ``--device``, and what a recipe's ``train.device:
    auto`` resolves through (the test suite sets ``cpu``)."""
    return os.environ.get("TOKENLOOM_DEVICE") or "auto"


def training_device(requested: str, local_rank: int | None = None) -> DeviceChoice:
    """The device of a recipe's ``train.device``: :func:`choose_device`, with ``auto`` read through
    :func:`default_device` (``$TOKENLOOM_DEVICE``)."""
    if requested.strip().lower() == "auto":
        requested = default_device()
    return choose_device(requested, local_rank=local_rank)


def device_of(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter (or buffer); the CPU for a module with neither."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


def to_device(batch, device: torch.device | str, non_blocking: bool = False):
    """``batch`` with every tensor in it on ``device``: a tensor, or tuples (named tuples included), lists, dicts
    and dataclasses of them, nested; anything else unchanged. A tensor already there is returned as is. On CUDA,
    with ``non_blocking``, CPU tensors are pinned first so the copy can overlap the computation."""
    device = torch.device(device)
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        if non_blocking and device.type == "cuda" and batch.device.type == "cpu":
            return batch.pin_memory().to(device, non_blocking=True)
        return batch.to(device)
    if isinstance(batch, tuple) and hasattr(type(batch), "_fields"):  # a NamedTuple
        return type(batch)(*(to_device(x, device, non_blocking) for x in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(x, device, non_blocking) for x in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: to_device(getattr(batch, f.name), device, non_blocking)
                                             for f in dataclasses.fields(batch) if f.init})
    return batch


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (CUDA, MPS) to finish: what a benchmark does before reading the clock.
    Nothing on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def peak_memory(device: torch.device | str, reset: bool = False) -> int | None:
    """The most bytes allocated on the CUDA ``device`` since the last reset (``reset``: start counting again and
    return None); None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
        return None
    return int(torch.cuda.max_memory_allocated(device))

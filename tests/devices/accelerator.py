"""A stand-in accelerator for tests without a GPU: tensors that report the ``meta`` device but hold real CPU data.

:class:`OnDevice` wraps a CPU tensor and says ``device='meta'``; while :class:`AcceleratorMode` is active every
operation runs on the wrapped CPU data, so decoding loops that read values (``.item()``, ``.tolist()``, ``bool()``)
work, unlike fake or meta tensors. Like a real accelerator:

* a factory given ``device=ACCELERATOR`` (``torch.zeros(..., device=x.device)``) makes an :class:`OnDevice` tensor;
* an operation that mixes an :class:`OnDevice` tensor with a CPU tensor of one or more dimensions raises
  :class:`DeviceMismatch` (0-dim CPU tensors are allowed, as CUDA allows them; so are CPU indices of ``x[index]``
  and the source of ``copy_``, which CUDA accepts too);
* ``x.to(ACCELERATOR)`` moves a CPU tensor there and ``x.to("cpu")`` / ``x.cpu()`` back.

So a tensor created without the device of what it meets (``torch.arange(T)`` beside accelerator inputs) fails the
test that runs the code under the mode.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

ACCELERATOR = torch.device("meta")
CPU = torch.device("cpu")
_CROSS_DEVICE_OK = {torch.ops.aten.copy_.default, torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default,
                    torch.ops.aten.index_put.default, torch.ops.aten._index_put_impl_.default,
                    torch.ops.aten._to_copy.default}


class DeviceMismatch(RuntimeError):
    """A CPU tensor met an accelerator tensor."""


class OnDevice(torch.Tensor):
    """CPU data (``.elem``) presented as a tensor on :data:`ACCELERATOR`."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> OnDevice:
        out = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                  storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                  layout=elem.layout, device=ACCELERATOR,
                                                  requires_grad=elem.requires_grad)
        out.elem = elem
        return out

    def __repr__(self) -> str:  # noqa: D105
        return f"OnDevice({self.elem!r})"

    def tolist(self):  # as on a GPU: the values copied to the host (torch refuses tolist on a subclass)
        return self.elem.tolist()

    def data_ptr(self) -> int:  # as on a GPU: each tensor's own address (a wrapper's is 0), which tying checks read
        return self.elem.data_ptr()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _run(func, args, kwargs):
    inputs: dict[int, OnDevice] = {}
    seen = {"device": False, "cpu": None}

    def unwrap(x):
        if isinstance(x, OnDevice):
            seen["device"] = True
            inputs[id(x.elem)] = x
            return x.elem
        if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0:
            seen["cpu"] = tuple(x.shape)
        return x

    args, kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    target = kwargs.get("device")
    to_device = target is not None and torch.device(target).type == ACCELERATOR.type
    if to_device:
        kwargs = {**kwargs, "device": CPU}
    if seen["device"] and seen["cpu"] is not None and func not in _CROSS_DEVICE_OK:
        raise DeviceMismatch(f"{func}: a CPU tensor of shape {seen['cpu']} met a tensor on {ACCELERATOR} (expected "
                             "all tensors on one device)")
    if kwargs.get("pin_memory"):
        kwargs = {**kwargs, "pin_memory": False}
    out = func(*args, **kwargs)
    wrap = to_device or (seen["device"] and not (target is not None and torch.device(target).type == "cpu"))

    view_of_normal = func.is_view and any(not t.is_inference() for t in inputs.values())

    def rewrap(x):
        if not isinstance(x, torch.Tensor) or not wrap:
            return x
        same = inputs.get(id(x))  # an in-place result is its input
        if same is not None:
            return same
        if view_of_normal and torch.is_inference_mode_enabled():  # a view of a normal tensor is one (as on a GPU)
            with torch.inference_mode(False):
                return OnDevice(x)
        return OnDevice(x)

    return tree_map(rewrap, out)


class _Operations(TorchDispatchMode):
    """Every aten operation through :func:`_run`: factories given ``device=ACCELERATOR`` included."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


class _FromData(TorchFunctionMode):
    """``torch.tensor(data, device=ACCELERATOR)`` / ``torch.as_tensor``: the data reaches the device below the
    dispatcher (a bare meta tensor, without values), so these are made on the CPU and wrapped."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func in (torch.tensor, torch.as_tensor) and device is not None and \
                torch.device(device).type == ACCELERATOR.type:
            return OnDevice(func(*args, **{**kwargs, "device": CPU}))
        return func(*args, **kwargs)


class AcceleratorMode:
    """Within the block, the stand-in accelerator works (:class:`OnDevice` tensors and factories on it)."""

    def __enter__(self) -> AcceleratorMode:
        self._modes = [_FromData(), _Operations()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def to_accelerator(module: nn.Module) -> nn.Module:
    """``module`` with every parameter and buffer moved to :data:`ACCELERATOR` (tied weights stay tied), in place."""
    moved: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in moved:
                    moved[id(p)] = nn.Parameter(OnDevice(p.detach().clone()), requires_grad=p.requires_grad)
                mod._parameters[name] = moved[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                if id(b) not in moved:
                    moved[id(b)] = OnDevice(b.detach().clone())
                mod._buffers[name] = moved[id(b)]
    return module

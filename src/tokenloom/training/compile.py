"""``train.compile``: the training forward through ``torch.compile`` (TorchInductor), with a clean fallback.

On CPU Inductor writes C++ kernels, so it needs a C++ compiler; where there is none, where this torch has no
``torch.compile``, or where compiling the model fails, training warns once (one line) and runs eagerly: the
option never stops a run. Compilation happens at the first step (seconds to a minute); ``mode`` is
``torch.compile``'s (``default``, ``reduce-overhead``, ``max-autotune``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..compilation import compile_unavailable, first_line, from_compiler, separate_inductor_cache


class CompiledForward:
    """Calls ``model`` through ``torch.compile(model)``; falls back to the eager model, with one warning, when
    compilation is unavailable or fails (the failing call is repeated eagerly). Attribute access goes to the
    model, so tasks use it as the model."""

    def __init__(self, model: nn.Module, mode: str = "default") -> None:
        self.model = model
        reason = compile_unavailable()
        self.compiled: Callable[..., Any] | None = None
        if reason is not None:
            warnings.warn(f"train.compile: {reason}; training eagerly", stacklevel=2)
        else:
            separate_inductor_cache()
            self.compiled = torch.compile(model, mode=mode)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is None:
            return self.model(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 — any compiler failure: fall back, never stop the run
            if not from_compiler(error):
                raise
            warnings.warn(f"train.compile: compiling the model failed ({first_line(error)}); training eagerly",
                          stacklevel=2)
            self.compiled = None
            return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

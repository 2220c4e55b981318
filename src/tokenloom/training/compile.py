"""``train.compile``: the training forward (``model``) and the optimizer's step (``step``) through ``torch.compile``
(TorchInductor), with a clean fallback.

On CPU Inductor writes C++ kernels, so it needs a C++ compiler; where there is none, where this torch has no
``torch.compile``, or where compiling fails, training warns once (one line) and runs eagerly: the option never stops
a run. Compilation happens at the first step (seconds to a minute); ``mode`` is ``torch.compile``'s (``default``,
``reduce-overhead``, ``max-autotune``).

``train.compile`` values (:func:`compile_parts`): ``model`` compiles the model's forward (and, through AOTAutograd,
its backward); ``step`` the forward and the optimizer's ``step`` as PyTorch's "compiling the optimizer" recipe does
(the learning rates become 0-dim tensors, which the schedule fills in place, so a new learning rate does not
recompile; AdamW then runs its single-tensor update, which Inductor fuses, instead of the eager fused kernel;
``MuonWithAdamW``'s two steps, Newton-Schulz included, compile alike); ``true`` is :data:`COMPILE_TRUE`, what was
measured to pay. Measured on this project's CPU machine (2026-12-07; one core, one thread; the 4-layer x 256
shakespeare-char demo, batch 16 x 256, medians of 6 interleaved rounds of 5 steps after warm-up; docs/performance.md):
fp32 eager 822 ms/step, model 842, step 828; bf16 eager 1324, model 1296, step 1297 (noise about +-15 ms). The step
alone: fused AdamW eager 3.5 ms, compiled 5.5 ms (slower); MuonWithAdamW eager 260 ms, compiled 250 ms. Compiling
costs the first step: 27 s (model) and 37 s (step), cold cache.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import compilation
from ..compilation import first_line, from_compiler, separate_inductor_cache

COMPILE_TRUE = "model"  # train.compile: true -> the model only: compiling the optimizer step as well did not pay on
#   the demo model (AdamW's compiled step is slower than its fused kernel; Muon's gains 4% of its step, about 1% of
#   a training step, for 10 s more compiling: this module's docstring); train.compile: step asks for it


def compile_unavailable() -> str | None:
    """Why ``torch.compile`` cannot run here (:func:`tokenloom.compilation.compile_unavailable`), or None."""
    return compilation.compile_unavailable()


def compile_parts(value: bool | str) -> tuple[str, ...]:
    """What ``train.compile`` compiles: () (false), ("model",) or ("model", "step")."""
    value = COMPILE_TRUE if value is True else value
    return {"model": ("model",), "step": ("model", "step")}.get(value, ()) if value else ()


def available_parts(value: bool | str) -> tuple[str, ...]:
    """:func:`compile_parts`, or () with one one-line warning where ``torch.compile`` cannot run here."""
    parts = compile_parts(value)
    if parts and (reason := compile_unavailable()) is not None:
        warnings.warn(f"train.compile: {reason}; training eagerly", stacklevel=3)
        return ()
    return parts


def compiled_or_eager(owner: Any, what: str, then: str, eager: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``owner.compiled(*args, **kwargs)``, or ``eager(...)`` where ``owner.compiled`` is None; a compiler failure
    warns once (``train.compile: compiling {what} failed (...); {then}``), drops the compiled callable and repeats
    the call eagerly. Any other error propagates."""
    if owner.compiled is None:
        return eager(*args, **kwargs)
    try:
        return owner.compiled(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 — any compiler failure: fall back, never stop the run
        if not from_compiler(error):
            raise
        warnings.warn(f"train.compile: compiling {what} failed ({first_line(error)}); {then}", stacklevel=3)
        owner.compiled = None
        return eager(*args, **kwargs)


class CompiledStep:
    """``optimizer.step()`` through ``torch.compile`` (its learning rates must be tensors: :func:`create_optimizer`
    with ``tensor_lr=True``); falls back to the eager step, with one warning, when compiling fails (the failing
    call is repeated eagerly)."""

    def __init__(self, optimizer: torch.optim.Optimizer, mode: str = "default") -> None:
        self.optimizer = optimizer
        separate_inductor_cache()
        # optimizer.step looked up at each call, as the recipe does: a learning-rate scheduler made later wraps it
        self.compiled: Callable[[], Any] | None = torch.compile(self._step, mode=mode)

    def _step(self) -> None:
        self.optimizer.step()

    def __call__(self) -> None:
        compiled_or_eager(self, "the optimizer step", "stepping eagerly", self.optimizer.step)


class CompiledForward:
    """Calls ``model`` through ``torch.compile(model)``; falls back to the eager model, with one warning, when
    compilation is unavailable or fails (the failing call is repeated eagerly). Attribute access goes to the
    model, so tasks use it as the model."""

    def __init__(self, model: nn.Module, mode: str = "default", checked: bool = False) -> None:
        """``checked``: the caller has made sure compilation is available (:func:`available_parts`)."""
        self.model = model
        reason = None if checked else compile_unavailable()
        self.compiled: Callable[..., Any] | None = None
        if reason is not None:
            warnings.warn(f"train.compile: {reason}; training eagerly", stacklevel=2)
        else:
            separate_inductor_cache()
            self.compiled = torch.compile(model, mode=mode)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return compiled_or_eager(self, "the model", "training eagerly", self.model, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

"""Learning-rate schedules, by name: ``cosine``, ``linear``, ``constant``, ``inverse_sqrt`` (Noam).

Each maps a step (0-based, the optimizer update about to happen) to a multiplier of the peak
learning rate. All but ``inverse_sqrt`` warm up linearly over ``warmup_steps`` first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch

from ..registry import Registry

Schedule = Callable[..., float]
SCHEDULES: Registry[Schedule] = Registry("schedule")


def _warmup(step: int, warmup_steps: int) -> float | None:
    return (step + 1) / warmup_steps if step < warmup_steps else None


def _decay_progress(step: int, warmup_steps: int, max_steps: int) -> float:
    """0 at the end of warmup, 1 at ``max_steps`` (and after)."""
    return min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))


@SCHEDULES.register("cosine")
def cosine(step: int, *, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Warmup, then half a cosine from 1 down to ``min_ratio`` at ``max_steps``."""
    w = _warmup(step, warmup_steps)
    progress = _decay_progress(step, warmup_steps, max_steps)
    return w if w is not None else min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@SCHEDULES.register("linear")
def linear(step: int, *, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Warmup, then a straight line from 1 down to ``min_ratio`` at ``max_steps``."""
    w = _warmup(step, warmup_steps)
    return w if w is not None else 1 - (1 - min_ratio) * _decay_progress(step, warmup_steps, max_steps)


@SCHEDULES.register("constant")
def constant(step: int, *, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Warmup, then 1."""
    w = _warmup(step, warmup_steps)
    return 1.0 if w is None else w


@SCHEDULES.register("inverse_sqrt")
def inverse_sqrt(step: int, *, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """The original Transformer's (Noam) schedule, normalised to peak at 1 after ``warmup_steps``:
    ``min(n / warmup, sqrt(warmup / n))`` with n = step + 1."""
    n = step + 1
    warmup = max(1, warmup_steps)
    return min(n / warmup, math.sqrt(warmup / n))


def create_scheduler(optimizer: torch.optim.Optimizer, name: str, *, warmup_steps: int, max_steps: int,
                     min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    fn = partial(SCHEDULES.get(name), warmup_steps=warmup_steps, max_steps=max_steps, min_ratio=min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)

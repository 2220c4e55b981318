"""Training time, and a learning-rate schedule that runs over it (``train.schedule_clock: minutes``).

A recipe with a time budget (``train.max_minutes``) ends where the machine's speed puts it: a warmup-stable-decay or
cosine schedule laid out over ``max_steps`` is cut before its decay on a slow CPU and ends early on a fast one. With
the schedule on the clock its position is, after the warmup (counted in steps), the larger of the step count and the
fraction of ``max_minutes`` trained times ``max_steps``, so the decay ends with the budget on any machine (and at
``max_steps`` where that comes first).
Training time leaves evaluations and checkpoints out and adds up over the runs a ``--resume`` continues.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

CLOCKS = ("steps", "minutes")  # train.schedule_clock


class TrainingClock:
    """Seconds spent training: this process's (``this_run_s``) and with the runs it resumed (``total_s``)."""

    def __init__(self, before_s: float = 0.0) -> None:
        self.before_s = before_s  # the training time of the runs this one resumes
        self._start = time.perf_counter()
        self._paused = 0.0

    def start(self) -> None:
        self._start, self._paused = time.perf_counter(), 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Evaluations and checkpoints: time that does not count as training."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - begin

    @property
    def this_run_s(self) -> float:
        return time.perf_counter() - self._start - self._paused

    @property
    def total_s(self) -> float:
        return self.before_s + self.this_run_s


def schedule_position(step: int, trained_s: float, max_steps: int, budget_s: float, warmup_steps: int = 0) -> int:
    """Where a schedule over ``max_steps`` stands after ``step`` updates and ``trained_s`` of a ``budget_s`` budget:
    the step during the warmup (a warmup is about the first updates, whatever they cost), then the larger of the
    step and ``max_steps`` times the fraction of the budget spent, so it never runs behind the steps and reaches
    ``max_steps`` when the budget is spent."""
    if step < warmup_steps:
        return step
    return max(step, min(max_steps, math.floor(max_steps * trained_s / budget_s)))

"""Learning-rate schedules, by name: ``cosine``, ``linear``, ``constant``, ``inverse_sqrt`` (Noam), ``wsd``
(warmup-stable-decay).

Each maps a step (0-based, the optimizer update about to happen) to a multiplier of the peak
learning rate. All but ``inverse_sqrt`` warm up linearly over ``warmup_steps`` first.

A schedule is built from the ``train`` keys in :class:`ScheduleSpec` (``schedule``, ``lr``, ``min_lr``,
``warmup_steps``, ``max_steps``, ``decay_fraction``). A checkpoint records that spec, and a resume keeps it: a
resume that changes one of
those keys keeps the first run's schedule (a larger ``max_steps`` still extends the run; the steps past the
schedule's end run on its continuation, ``min_lr`` for ``cosine`` / ``linear``), and :func:`kept_schedule_notice`
says so in one line.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from functools import partial
from typing import Any

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
def cosine(step: int, *, warmup_steps: int, max_steps: int, min_ratio: float,
                decay_fraction: float = 0.2) -> float:
    """Warmup, then half a cosine from 1 down to ``min_ratio`` at ``max_steps``."""
    w = _warmup(step, warmup_steps)
    progress = _decay_progress(step, warmup_steps, max_steps)
    return w if w is not None else min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@SCHEDULES.register("linear")
def linear(step: int, *, warmup_steps: int, max_steps: int, min_ratio: float,
                decay_fraction: float = 0.2) -> float:
    """Warmup, then a straight line from 1 down to ``min_ratio`` at ``max_steps``."""
    w = _warmup(step, warmup_steps)
    return w if w is not None else 1 - (1 - min_ratio) * _decay_progress(step, warmup_steps, max_steps)


@SCHEDULES.register("constant")
def constant(step: int, *, warmup_steps: int, max_steps: int, min_ratio: float,
                decay_fraction: float = 0.2) -> float:
    """Warmup, then 1."""
    w = _warmup(step, warmup_steps)
    return 1.0 if w is None else w


@SCHEDULES.register("inverse_sqrt")
def inverse_sqrt(step: int, *, warmup_steps: int, max_steps: int, min_ratio: float,
                decay_fraction: float = 0.2) -> float:
    """The original Transformer's (Noam) schedule, normalised to peak at 1 after ``warmup_steps``:
    ``min(n / warmup, sqrt(warmup / n))`` with n = step + 1."""
    n = step + 1
    warmup = max(1, warmup_steps)
    return min(n / warmup, math.sqrt(warmup / n))


@SCHEDULES.register("wsd")
def wsd(step: int, *, warmup_steps: int, max_steps: int, min_ratio: float, decay_fraction: float = 0.2) -> float:
    """Warmup-stable-decay (Hägele et al. 2024): warmup, then 1 until the last ``decay_fraction`` of ``max_steps``,
    then a straight line down to ``min_ratio`` at ``max_steps`` (and ``min_ratio`` after)."""
    w = _warmup(step, warmup_steps)
    if w is not None:
        return w
    decay_start = max(warmup_steps, max_steps - round(decay_fraction * max_steps))
    if step < decay_start:
        return 1.0
    return 1 - (1 - min_ratio) * _decay_progress(step, decay_start, max_steps)


def create_scheduler(optimizer: torch.optim.Optimizer, name: str, *, warmup_steps: int, max_steps: int,
                     min_ratio: float, decay_fraction: float = 0.2) -> torch.optim.lr_scheduler.LambdaLR:
    fn = partial(SCHEDULES.get(name), warmup_steps=warmup_steps, max_steps=max_steps, min_ratio=min_ratio,
                 decay_fraction=decay_fraction)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


# the keys that do not shape a schedule's curve (every other key of the spec does)
UNUSED_KEYS: dict[str, tuple[str, ...]] = {
    "cosine": ("decay_fraction",), "linear": ("decay_fraction",),
    "constant": ("max_steps", "min_lr", "decay_fraction"), "inverse_sqrt": ("max_steps", "min_lr", "decay_fraction")}
FLOOR_AFTER_END = ("cosine", "linear", "wsd")  # past max_steps these stay at min_lr


@dataclass(frozen=True)
class ScheduleSpec:
    """What a learning-rate schedule is built from: the ``train`` keys of the same names (``min_lr`` resolved)."""

    schedule: str
    lr: float
    min_lr: float
    warmup_steps: int
    max_steps: int
    decay_fraction: float = 0.2  # wsd only (a record written before the key existed takes this default)

    @classmethod
    def of(cls, train: Any) -> ScheduleSpec:
        """The spec of a :class:`~tokenloom.training.config.TrainConfig` (or anything with those attributes)."""
        min_lr = train.min_lr if train.min_lr is not None else train.lr / 10
        return cls(str(train.schedule), float(train.lr), float(min_lr), int(train.warmup_steps), int(train.max_steps),
                   float(train.decay_fraction))

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ScheduleSpec:
        """The spec a trainer state recorded; ValueError when the record is not one."""
        kinds = {"schedule": (str,), "lr": (int, float), "min_lr": (int, float), "warmup_steps": (int,),
                 "max_steps": (int,), "decay_fraction": (int, float)}
        if isinstance(record, Mapping) and "decay_fraction" not in record:  # recorded before the key existed
            record = {**record, "decay_fraction": 0.2}
        if not isinstance(record, Mapping) or set(record) != set(kinds) or not all(
                isinstance(record[k], kind) and not isinstance(record[k], bool) for k, kind in kinds.items()):
            raise ValueError(f"the recorded learning-rate schedule is not one: {record!r:.120}")
        return cls(record["schedule"], float(record["lr"]), float(record["min_lr"]), record["warmup_steps"],
                   record["max_steps"], float(record["decay_fraction"]))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def shaping_keys(self) -> tuple[str, ...]:
        """The keys that shape this schedule's curve (``constant`` and ``inverse_sqrt`` ignore max_steps, min_lr)."""
        unused = UNUSED_KEYS.get(self.schedule, ())
        return tuple(f.name for f in fields(self) if f.name not in unused)

    def create(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return create_scheduler(optimizer, self.schedule, warmup_steps=self.warmup_steps, max_steps=self.max_steps,
                                min_ratio=self.min_lr / self.lr, decay_fraction=self.decay_fraction)


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def kept_schedule_notice(kept: ScheduleSpec, before: ScheduleSpec, now: ScheduleSpec, run: str) -> str | None:
    """The one line a resume prints when it changes a key that shapes the schedule it keeps, or None.

    ``kept``: the schedule the run trains on (recorded by its first run); ``before``: the keys of the checkpoint
    resumed (its config.yaml); ``now``: the keys of this resume (config.yaml plus ``--set``)."""
    parts = []
    for key in kept.shaping_keys():
        old, new, used = getattr(before, key), getattr(now, key), getattr(kept, key)
        if new == old or new == used:  # unchanged by this resume, or set back to the schedule's own value
            continue
        if key != "max_steps":
            parts.append(f"{key} {_number(old)} -> {_number(new)}: the schedule keeps {_number(used)}")
        elif new < used:
            parts.append(f"max_steps {old} -> {new}: the run ends at step {new}, before the schedule's end at {used}")
        elif kept.schedule in FLOOR_AFTER_END:
            parts.append(f"max_steps {old} -> {new}: steps after {used} run at min_lr {_number(kept.min_lr)}")
        else:
            parts.append(f"max_steps {old} -> {new}: steps after {used} continue the {kept.schedule} schedule past "
                         "its end")
    if not parts:
        return None
    return (f"note: resuming keeps the learning-rate schedule of the first run ({'; '.join(parts)}); to train on a "
            f"new schedule, start a new run from these weights: tokenloom train RECIPE --out NEW --set "
            f"train.init_from={run}")

"""What a person sees while a run trains: every ``train.log_every`` steps, the step's ``metrics.jsonl`` record as
one line on stderr.

While stderr is a terminal (of a known width) a tqdm bar counts the steps, with its rate and ETA, and carries the
line's figures after it; elsewhere (piped, redirected to a file, CI) each record is one plain line, flushed::

    step  40/900  loss 2.5878  lr 8.20e-04  195 ms/step  21,004 tok/s  MFU 4.6%  ETA 2m48s
    step  10/60  loss 0.6921  lr 1.00e-05  2,310 ms/step  3 pairs/s  ETA 1m55s  reward_acc 0.75  margin 0.0123

The task's own training metrics (:meth:`~tokenloom.tasks.registry.Sharded.train_metrics`: DPO's implicit reward
accuracy and margin, GRPO's reward and KL, ...) follow. MFU (model FLOPs utilisation) is shown where the task's
count is every token a GPT ran forward and backward over (``lm``): tokens/s x ``6 N + 12 L C T`` FLOPs a token
(:func:`~tokenloom.models.sizes.training_flops_per_token`) / the matmul peak of the training dtype on this device,
measured once and remembered (:func:`~tokenloom.hardware.remembered_matmul_peak`, the figure ``tokenloom bench
roofline`` prints). The line's format is :func:`progress_line`.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

Mode = Literal["bar", "lines", "off"]
# the record's fields the line shows first (elapsed_s, train_s: not shown); every other number of the record is the
#   task's and follows
SHOWN = ("step", "loss", "lr", "ms_per_step", "tokens_per_s", "elapsed_s", "train_s")


def progress_mode(show_progress: bool | None, is_main: bool = True) -> Mode:
    """``bar`` (``show_progress`` True, or None while stderr is a terminal of a known width), ``lines`` (None
    elsewhere: piped, a file, CI, a dumb terminal) or ``off`` (False, or a process other than rank 0)."""
    if show_progress is False or not is_main:
        return "off"
    if show_progress:
        return "bar"
    try:
        terminal = sys.stderr.isatty() and os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except (AttributeError, ValueError, OSError):  # no stderr, a closed one, or one without a file descriptor
        terminal = False
    return "bar" if terminal and os.environ.get("TERM") != "dumb" else "lines"


def duration(seconds: float) -> str:
    """``45s``, ``2m48s``, ``1h02m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def progress_line(record: Mapping[str, Any], max_steps: int, *, unit: str = "tok", mfu: float | None = None,
                  eta_s: float | None = None, bar: bool = False) -> str:
    """A training record (a ``metrics.jsonl`` line of a training step) as the progress line: ``step S/MAX``, loss,
    learning rate, ms/step, ``unit``/s, MFU (a fraction, when given), ETA (seconds, when given), then the task's
    own numbers. ``bar``: the part a tqdm bar carries after its own step count, rate and ETA (no step, ms/step or
    ETA)."""
    parts = []
    if not bar:
        parts.append(f"step {record['step']:>{len(str(max_steps))}}/{max_steps}")
    if _number(record.get("loss")):
        parts.append(f"loss {record['loss']:.4f}")
    if _number(record.get("lr")):
        parts.append(f"lr {record['lr']:.2e}")
    if not bar and _number(ms := record.get("ms_per_step")):
        parts.append(f"{ms:,.0f} ms/step" if ms >= 10 else f"{ms:.2f} ms/step")
    if _number(rate := record.get("tokens_per_s")):
        parts.append(f"{rate:,.0f} {unit}/s" if rate >= 10 else f"{rate:.2f} {unit}/s")
    if mfu is not None and _number(mfu):
        parts.append(f"MFU {100 * mfu:.1f}%" if mfu >= 0.01 else f"MFU {100 * mfu:.2f}%")
    if not bar and eta_s is not None and _number(eta_s):
        parts.append(f"ETA {duration(eta_s)}")
    parts += [f"{key} {value:.4g}" for key, value in record.items() if key not in SHOWN and _number(value)]
    return "  ".join(parts)


class Progress:
    """The progress display of one :meth:`Trainer.fit`: :meth:`advance` after each step, :meth:`show` with each
    training record, :meth:`close` at the end. ``end_step``: where this run stops (``max_steps``, or sooner with
    ``train.stop_after_steps``); ``max_seconds``: ``train.max_minutes`` in seconds; both bound the ETA.
    ``flops_per_token`` and ``peak`` (FLOP/s; called at the first record shown, and once more with the FLOP/s reached
    should a record exceed it: ``at_least`` of :func:`~tokenloom.hardware.remembered`): the MFU, when both are
    given."""

    def __init__(self, mode: Mode, *, step: int, max_steps: int, end_step: int | None = None,
                 max_seconds: float | None = None, unit: str = "tok", flops_per_token: float | None = None,
                 peak: Callable[[float | None], float | None] | None = None) -> None:
        self.mode, self.max_steps, self.unit = mode, max_steps, unit
        self.start_step, self.end_step = step, min(end_step or max_steps, max_steps)
        self.max_seconds, self.start = max_seconds, time.perf_counter()
        self.flops_per_token, self._peak_of, self._peak, self._remeasured = flops_per_token, peak, None, False
        self.bar = None
        if mode == "bar":
            from tqdm.auto import tqdm

            self.bar = tqdm(total=max_steps, initial=step, unit="step", desc="train", file=sys.stderr,
                            dynamic_ncols=True, disable=False)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def eta(self, step: int) -> float | None:
        """Seconds until this run stops, at this run's mean pace so far (evaluations and checkpoints included)."""
        done = step - self.start_step
        if done <= 0:
            return None
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * max(0, self.end_step - step)
        return min(eta, max(0.0, self.max_seconds - elapsed)) if self.max_seconds is not None else eta

    def mfu(self, record: Mapping[str, Any]) -> float | None:
        """The record's model FLOP/s over the peak; None where unknown, or above 1 (a peak remembered from a busy
        moment, measured again once, can still be below what a run reaches between two busy moments)."""
        if self.flops_per_token is None or self._peak_of is None or not _number(record.get("tokens_per_s")):
            return None
        achieved = record["tokens_per_s"] * self.flops_per_token
        if self._peak is None or (achieved > self._peak > 0 and not self._remeasured):
            self._remeasured = self._peak is not None
            try:
                self._peak = self._peak_of(achieved if self._remeasured else None) or 0.0
            except (RuntimeError, TypeError, ValueError):  # a dtype this device cannot multiply: no MFU
                self._peak = 0.0
        return achieved / self._peak if 0 < achieved <= self._peak else None

    def show(self, record: Mapping[str, Any]) -> None:
        """A training record as the line (``lines``) or as the bar's figures (``bar``)."""
        if self.mode == "off":
            return
        mfu = self.mfu(record)
        if self.bar is not None:
            self.bar.set_postfix_str(progress_line(record, self.max_steps, unit=self.unit, mfu=mfu, bar=True))
        else:
            print(progress_line(record, self.max_steps, unit=self.unit, mfu=mfu, eta_s=self.eta(record["step"])),
                  file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        """A line of its own (an evaluation's figures) on stdout, above the bar."""
        from tqdm.auto import tqdm

        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def training_progress(mode: Mode, train: Any, task: Any, model_section: dict[str, Any], parameters: int,
                      device: Any, world_size: int, step: int) -> Progress:
    """The progress display of a run (``train``: its :class:`~tokenloom.training.config.TrainConfig`) starting at
    ``step``, with the MFU where the task counts every token a forward and backward ran over
    (``task.counts_model_tokens``) and the model's FLOPs per token are known (a GPT of ``parameters`` parameters),
    against the matmul peak of the training dtype on ``device``, times ``world_size`` processes."""
    import torch

    from ..hardware import remembered_matmul_peak
    from ..models.factory import model_config_from_dict
    from ..models.sizes import training_flops_per_token

    flops = None
    if mode != "off" and task.counts_model_tokens:
        _, model_config = model_config_from_dict(model_section)
        flops = training_flops_per_token(model_config, parameters, train.seq_len)
    dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(train.precision, torch.bfloat16)
    end = step + train.stop_after_steps if train.stop_after_steps is not None else train.max_steps
    return Progress(mode, step=step, max_steps=train.max_steps, end_step=end, unit=task.count_unit,
                    max_seconds=60 * train.max_minutes if train.max_minutes is not None else None,
                    flops_per_token=flops, peak=lambda reached: world_size * remembered_matmul_peak(
                        dtype, device, None if reached is None else reached / world_size))

"""``train.log_to: [tensorboard]``: every ``metrics.jsonl`` record also as TensorBoard scalars, in
``<run>/tensorboard/`` (``tensorboard --logdir runs/``), and text samples where a run produces them
(``tokenloom train --sample N``: the sample after training).

A record's numbers become scalars at its step, named by where they come from: ``train/loss``, ``train/lr``,
``train/tokens_per_s``, ``train/ms_per_step``, the task's own (``train/reward``, ``train/margin``, ...) and the
evaluations' ``val/loss``, ``val/ppl``, ``val/acc``, ... (``val_loss`` -> ``val/loss``); the evaluations' scope
(``eval_batches``, ``eval_split_batches``) is left out. A resumed run appends to the same directory and hides
what a killed run logged after the checkpoint it continues from (``purge_step``), as ``metrics.jsonl`` drops
those lines: each step is logged once. A fresh run replaces an earlier run's event files.

Written by ``torch.utils.tensorboard`` (needs the ``tensorboard`` package: ``pip install 'tokenloom[tensorboard]'``),
imported only when a run asks for it.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..metric_scope import BATCHES, SPLIT_BATCHES

LOG_TARGETS = ("tensorboard",)  # what train.log_to may name
TENSORBOARD_DIR = "tensorboard"  # <run>/tensorboard: the event files
EVENT_FILES = "events.out.tfevents.*"
FLUSH_SECONDS = 5  # how soon a scalar reaches the file (and a TensorBoard watching it)


def check_tensorboard() -> None:
    """A one-line error when the ``tensorboard`` package is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("train.log_to: tensorboard needs the tensorboard package, which is not installed: "
                          "pip install 'tokenloom[tensorboard]' (or pip install tensorboard)")


def scalar_tag(key: str) -> str:
    """``val_loss`` -> ``val/loss``; ``loss`` -> ``train/loss``."""
    return f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of a ``metrics.jsonl`` record: its finite numbers but the step and the scope."""
    return {scalar_tag(key): float(value) for key, value in record.items()
            if key not in ("step", BATCHES, SPLIT_BATCHES) and isinstance(value, int | float)
            and not isinstance(value, bool) and math.isfinite(value)}


class TensorBoardLog:
    """The event writer of one run: ``purge_step`` (a resume: the checkpoint's step + 1) hides the events a killed
    run wrote from that step on; None appends."""

    def __init__(self, run_dir: str | Path, purge_step: int | None = None) -> None:
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.directory = Path(run_dir) / TENSORBOARD_DIR
        self.writer = SummaryWriter(log_dir=str(self.directory), purge_step=purge_step, flush_secs=FLUSH_SECONDS)

    def record(self, record: Mapping[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, int(record["step"]))

    def text(self, tag: str, text: str, step: int) -> None:
        """``text`` as it is (TensorBoard renders text as Markdown: indented, it shows as a preformatted block)."""
        self.writer.add_text(tag, "    " + text.replace("\n", "\n    "), step)

    def close(self) -> None:
        self.writer.close()


def forget_earlier_run(run_dir: str | Path) -> bool:
    """A fresh run: remove the event files an earlier run (one that never reached a checkpoint) left in
    ``<run>/tensorboard``; whether there were any."""
    files = sorted((Path(run_dir) / TENSORBOARD_DIR).glob(EVENT_FILES))
    for path in files:
        path.unlink(missing_ok=True)
    return bool(files)

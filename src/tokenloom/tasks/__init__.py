"""Tasks: per task, what a batch is, its loss and its metrics."""

from .lm import LMDataConfig, LMTask
from .losses import cross_entropy
from .registry import TASKS

__all__ = ["TASKS", "LMDataConfig", "LMTask", "cross_entropy"]

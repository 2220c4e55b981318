"""Tasks: per task, what a batch is, its loss and its metrics."""

from .lm import LMDataConfig, LMTask
from .losses import cross_entropy
from .registry import TASKS
from .translation import TranslationDataConfig, TranslationTask, translate

__all__ = ["TASKS", "LMDataConfig", "LMTask", "TranslationDataConfig", "TranslationTask", "cross_entropy", "translate"]

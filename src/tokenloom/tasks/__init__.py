"""Tasks: per task, what a batch is, its loss and its metrics."""

from .image import ImageBatch, ImageClassificationTask, ImageDataConfig, classify
from .lm import LMDataConfig, LMTask
from .losses import cross_entropy, soft_cross_entropy
from .nat import NATDataConfig, NATTranslationTask
from .registry import TASKS
from .translation import TranslationDataConfig, TranslationTask, translate

__all__ = ["TASKS", "ImageBatch", "ImageClassificationTask", "ImageDataConfig", "LMDataConfig", "LMTask",
           "NATDataConfig", "NATTranslationTask",
           "TranslationDataConfig", "TranslationTask", "classify", "cross_entropy", "soft_cross_entropy", "translate"]

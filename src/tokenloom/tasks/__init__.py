"""Tasks: per task, what a batch is, its loss and its metrics."""

from .grpo import GRPODataConfig, GRPOTask
from .image import ImageBatch, ImageClassificationTask, ImageDataConfig, classify
from .lm import LMDataConfig, LMTask
from .losses import cross_entropy, soft_cross_entropy
from .nat import NATDataConfig, NATTranslationTask
from .preference import PreferenceDataConfig, PreferenceTask
from .registry import TASKS
from .reward import RewardDataConfig, RewardTask
from .sft import SFTDataConfig, SFTTask
from .translation import TranslationDataConfig, TranslationTask, translate

__all__ = ["TASKS", "GRPODataConfig", "GRPOTask",
           "ImageBatch", "ImageClassificationTask", "ImageDataConfig", "LMDataConfig", "LMTask",
           "NATDataConfig", "NATTranslationTask", "PreferenceDataConfig", "PreferenceTask",
           "RewardDataConfig", "RewardTask", "SFTDataConfig", "SFTTask",
           "TranslationDataConfig", "TranslationTask", "classify", "cross_entropy", "soft_cross_entropy", "translate"]

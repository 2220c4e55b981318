"""Models: thin compositions of ``tokenloom.nn`` parts."""

from .gpt import GPT, GPT_PRESETS, GPTConfig
from .registry import MODELS

__all__ = ["GPT", "GPT_PRESETS", "GPTConfig", "MODELS"]

"""Decoding over a small model protocol: settings, logits processors, greedy and sampled generation."""

from .config import GenerationConfig
from .generate import generate, stream
from .processors import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyProcessor,
    TemperatureProcessor,
    TopKProcessor,
    TopPProcessor,
    create_processors,
)

__all__ = [
    "GenerationConfig", "LogitsProcessor", "LogitsProcessorList", "RepetitionPenaltyProcessor",
    "TemperatureProcessor", "TopKProcessor", "TopPProcessor", "create_processors", "generate", "stream",
]

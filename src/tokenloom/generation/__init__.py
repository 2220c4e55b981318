"""Decoding over a small model protocol: settings, logits processors, greedy and sampled generation, beam
search."""

from .beam import BeamOutput, beam_search
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
    "BeamOutput", "GenerationConfig", "LogitsProcessor", "LogitsProcessorList", "RepetitionPenaltyProcessor",
    "TemperatureProcessor", "TopKProcessor", "TopPProcessor", "beam_search", "create_processors", "generate",
    "stream",
]

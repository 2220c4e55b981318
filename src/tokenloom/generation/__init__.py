"""Decoding over a small model protocol: settings, logits processors, greedy and sampled generation (also
speculative), beam search."""

from .beam import BeamOutput, beam_search
from .config import GenerationConfig
from .drafting import Drafter, ModelDrafter, PromptLookup, check_draft_tokenizer
from .generate import generate, stream
from .processors import (
    LogitBiasProcessor,
    LogitsProcessor,
    LogitsProcessorList,
    PresenceFrequencyProcessor,
    RepetitionPenaltyProcessor,
    TemperatureProcessor,
    TopKProcessor,
    TopPProcessor,
    create_processors,
)
from .speculative import DraftTally

__all__ = [
    "BeamOutput", "DraftTally", "Drafter", "GenerationConfig", "LogitBiasProcessor", "LogitsProcessor",
    "LogitsProcessorList", "ModelDrafter", "PresenceFrequencyProcessor", "PromptLookup", "RepetitionPenaltyProcessor",
    "TemperatureProcessor", "TopKProcessor", "TopPProcessor", "beam_search", "check_draft_tokenizer",
    "create_processors", "generate", "stream",
]

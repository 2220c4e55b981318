"""Models: thin compositions of ``tokenloom.nn`` parts."""

from .gpt import GPT, GPT_PRESETS, GPTConfig
from .registry import MODELS
from .seq2seq import EncoderDecoder, Seq2SeqCache, Seq2SeqConfig, Seq2SeqDecoder

__all__ = ["GPT", "GPT_PRESETS", "EncoderDecoder", "GPTConfig", "MODELS", "Seq2SeqCache", "Seq2SeqConfig",
           "Seq2SeqDecoder"]

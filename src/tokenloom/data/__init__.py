"""Data: tokenizers (char, byte-level BPE) and token-id datasets kept as numpy memmaps."""

from .text import TextDataset, read_text
from .tokenizers import TOKENIZERS, Tokenizer, create_tokenizer

__all__ = ["TOKENIZERS", "TextDataset", "Tokenizer", "create_tokenizer", "read_text"]

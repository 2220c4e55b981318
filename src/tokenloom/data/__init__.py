"""Data: tokenizers (char, byte-level BPE), token-id datasets kept as numpy memmaps, and parallel
(translation) pairs batched by token count."""

from .parallel import ParallelBatch, ParallelDataset, read_parallel
from .text import TextDataset, read_text
from .tokenizers import TOKENIZERS, Tokenizer, create_tokenizer, train_joint_bpe

__all__ = ["TOKENIZERS", "ParallelBatch", "ParallelDataset", "TextDataset", "Tokenizer", "create_tokenizer",
           "read_parallel", "read_text", "train_joint_bpe"]

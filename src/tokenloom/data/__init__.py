"""Data: tokenizers (char, byte-level BPE), token-id datasets kept as numpy memmaps, parallel
(translation) pairs batched by token count, and images (MNIST, digits, class folders) with batched
augmentations."""

from .augment import AugmentConfig, augment, mix_batch
from .images import ImageDataset, read_digits, read_idx, read_image_folder, read_mnist, write_idx
from .parallel import ParallelBatch, ParallelDataset, read_parallel
from .text import TextDataset, read_text
from .tokenizers import TOKENIZERS, Tokenizer, create_tokenizer, train_joint_bpe

__all__ = ["TOKENIZERS", "AugmentConfig", "ImageDataset", "ParallelBatch", "ParallelDataset", "TextDataset",
           "Tokenizer", "augment", "create_tokenizer", "mix_batch", "read_digits", "read_idx", "read_image_folder",
           "read_mnist", "read_parallel", "read_text", "train_joint_bpe", "write_idx"]

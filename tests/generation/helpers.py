"""Shared pieces for the generation tests: small random models and an independent greedy reference."""

from __future__ import annotations

import torch
from torch import Tensor

from tokenloom import GPT, GPTConfig

POSITIONS = ["learned", "sinusoidal", "rope", "alibi", "t5", "none"]


def small_model(vocab_size: int = 40, seed: int = 0, **overrides) -> GPT:
    """A random 2-layer GPT. Untied embeddings: a random tied model mostly repeats its last token, which
    would hide position mistakes from greedy-output comparisons."""
    torch.manual_seed(seed)
    config = dict(vocab_size=vocab_size, num_layers=2, num_heads=4, embed_dim=32, max_seq_len=64,
                  tie_embeddings=False)
    return GPT(GPTConfig(**{**config, **overrides})).eval()


@torch.no_grad()
def reference_greedy(model: GPT, prompt: Tensor, n: int, repetition_penalty: float = 1.0) -> Tensor:
    """(T,) prompt -> (T + n,) by re-running the whole sequence through the model (no cache) each step,
    applying the repetition penalty element by element."""
    seq = prompt.tolist()
    for _ in range(n):
        logits = model(torch.tensor([seq]))[0, -1].tolist()
        if repetition_penalty != 1.0:
            for tok in set(seq):
                s = logits[tok]
                logits[tok] = s * repetition_penalty if s < 0 else s / repetition_penalty
        seq.append(max(range(len(logits)), key=logits.__getitem__))
    return torch.tensor(seq)


def left_pad(rows: list[Tensor], pad: int = 0) -> tuple[Tensor, Tensor]:
    """Rows of different lengths -> (B, T) left-padded ids and the (B, T) 0/1 attention mask."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r):] = r
        mask[i, T - len(r):] = 1
    return ids, mask

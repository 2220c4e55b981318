"""The next token from a step's logits, written once for ``generate``/``stream`` and the serving engine (and the
vocabulary limit also for beam search): float32 scores, ids past the tokenizer's vocabulary never chosen, the
logits processors, then argmax (greedy) or one sample from the seeded generator."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def vocabulary_limit(tokenizer: object, model_vocab: int | None) -> int | None:
    """The tokenizer's vocabulary size when the model's vocabulary is padded past it (common in imports: its ids
    beyond are never emitted), else None."""
    known = getattr(tokenizer, "vocab_size", None)
    return known if isinstance(known, int) and model_vocab is not None and known < model_vocab else None


def limit_vocabulary(scores: Tensor, limit: int | None) -> Tensor:
    """(A, V) logits as float32 (in place when they already are), ids from ``limit`` on at -inf."""
    if scores.dtype != torch.float32:
        scores = scores.float()
    if limit is not None:  # before the processors: top-k / top-p choose among the tokenizer's ids
        scores[:, limit:] = float("-inf")
    return scores


def choose_next(scores: Tensor, history: Tensor | None, processors: Callable[[Tensor, Tensor], Tensor] | None,
                greedy: bool, generator: torch.Generator | None) -> Tensor:
    """(A, V) float32 scores (already limited) -> (A, 1) next token ids. ``history`` (A, t) is what the processors
    see (the prompt and the tokens so far); None when there are none."""
    if processors:
        scores = processors(history, scores)
    if greedy:
        return scores.argmax(-1, keepdim=True)
    return torch.multinomial(scores.softmax(-1), 1, generator=generator)

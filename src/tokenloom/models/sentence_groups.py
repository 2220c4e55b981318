"""The row contract of an encoder-decoder's decode cache: ``B = Bm * group`` rows, ``group`` hypotheses for each of
``Bm`` source sentences whose memory (encoder output, cross-attention keys and values, an RNN's attention memory) is
shared by the group. Beam search may only permute rows within a group (:func:`check_reorder`); dropping finished
rows keeps whole sentences (:func:`kept_sentences`). Both caches, :class:`~tokenloom.models.seq2seq.Seq2SeqCache`
and :class:`~tokenloom.models.rnn_seq2seq.RNNSeq2SeqCache`, check through these."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import GenerationError


def check_reorder(index: Tensor, group: int, batch_size: int, cache: str) -> None:
    """Refuse a reorder that moves a row out of its sentence's group (``cache`` names the cache in the message)."""
    if group > 1 or index.numel() != batch_size:
        rows = torch.arange(index.numel(), device=index.device)
        if not bool((index // group == rows // group).all()):
            raise GenerationError(f"a {cache} can only reorder rows within a source sentence's group")


def kept_sentences(index: Tensor, group: int, cache: str) -> Tensor:
    """The sentences (Bm',) whose rows ``index`` keeps; refuses an ``index`` that keeps part of a sentence's group
    or mixes groups."""
    rows = index.view(-1, group) if index.numel() % group == 0 else None
    sentences = None if rows is None else rows[:, 0] // group
    if rows is None or not bool((rows // group == sentences[:, None]).all()):
        raise GenerationError(f"a {cache} keeps whole source sentences: rows in groups of {group}, each within its "
                              "own sentence's group")
    return sentences

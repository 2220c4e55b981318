"""Batches of whole examples (token id lists with a per-token "trained" mask), padded or packed, and the summed
log-probability of labelled tokens -- shared by supervised fine-tuning, preference and policy optimisation.

Labels are already aligned with the logits: ``labels[:, t]`` is the target of ``logits[:, t]`` (the id at
``t + 1`` when that token is trained, else -100), so a loss is ``cross_entropy(logits, labels)`` with no shift.
Shapes: B rows, T positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import DataError

IGNORE = -100  # the label of a position that is not scored


def _labels_of(ids: Sequence[int], trained: Sequence[bool] | None) -> list[int]:
    """Aligned labels of one example: label ``t`` = ``ids[t + 1]`` if that token is trained, else -100; the last
    position predicts nothing."""
    n = len(ids)
    if trained is not None and len(trained) != n:
        raise ValueError(f"an example has {n} ids but {len(trained)} trained flags")
    labels = [int(ids[t + 1]) if (trained is None or trained[t + 1]) else IGNORE for t in range(n - 1)]
    return labels + [IGNORE] * (n > 0)


def pad_sequences(rows: Sequence[Sequence[int]], trained: Sequence[Sequence[bool]] | None,
                  pad_id: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded (ids (B, T), labels (B, T), attention_mask (B, T)) of ``rows`` (T = the longest row).

    ``labels[b, t]`` is ``rows[b][t + 1]`` where that token is trained (``trained`` None: every token after the
    first), else -100 (untrained, the last token, padding); ``attention_mask`` is 1 on real tokens, 0 on padding
    (written with ``pad_id``, 0 when None)."""
    if not rows:
        raise ValueError("pad_sequences needs at least one row")
    width = max(len(r) for r in rows)
    pad = 0 if pad_id is None else int(pad_id)
    B = len(rows)
    ids = torch.full((B, width), pad, dtype=torch.long)
    labels = torch.full((B, width), IGNORE, dtype=torch.long)
    mask = torch.zeros((B, width), dtype=torch.long)
    for b, row in enumerate(rows):
        n = len(row)
        if n:
            ids[b, :n] = torch.as_tensor(list(row), dtype=torch.long)
            labels[b, :n] = torch.as_tensor(_labels_of(row, None if trained is None else trained[b]), dtype=torch.long)
            mask[b, :n] = 1
    return ids, labels, mask


def sequence_logprobs(model: nn.Module, ids: Tensor, labels: Tensor, attention_mask: Tensor | None = None,
                      **forward: object) -> tuple[Tensor, Tensor]:
    """(sum of log p(label) over the labelled positions (B,) float32, number of labelled positions (B,)).

    ``model(ids, attention_mask=..., **forward)`` gives logits (B, T, V); their log-softmax is taken in float32 and
    gathered at ``labels`` (aligned: ``labels[:, t]`` is the target of ``logits[:, t]``; -100 is not counted).
    Right padding needs no ``attention_mask`` for a causal model (no real token attends to a later pad)."""
    if attention_mask is not None:
        forward["attention_mask"] = attention_mask
    logits = model(ids, **forward)  # (B, T, V)
    return labelled_logprobs(logits, labels)


def labelled_logprobs(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(sum over t of log_softmax(logits[:, t])[labels[:, t]] where labels != -100 (B,) float32, counts (B,))."""
    scored = labels != IGNORE  # (B, T)
    logp = F.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)
    return (picked * scored).sum(-1), scored.sum(-1)


@dataclass
class Packed:
    """Examples packed into rows of ``seq_len``: ids, aligned labels (-100 off the trained tokens, at each example's
    last token and on padding), ``documents`` (1, 2, ... per example within a row, 0 on padding: attention stays
    inside an example) and ``positions`` (restarting at 0 for every example). All (N, seq_len) long tensors;
    ``rows[i]`` lists the examples (indices into the input) packed into row ``i``."""

    ids: Tensor  # (N, seq_len)
    labels: Tensor  # (N, seq_len)
    documents: Tensor  # (N, seq_len)
    positions: Tensor  # (N, seq_len)
    rows: list[list[int]]  # the examples of each row, in order


def pack_groups(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Examples (by their lengths), in order, grouped into rows of at most ``seq_len`` tokens: an example joins the
    current row while it fits, else starts the next (none is split; one longer than ``seq_len`` is a
    :class:`DataError`; empty ones are left out). Returns each row's example indices."""
    groups: list[list[int]] = []
    used = seq_len
    for i, n in enumerate(lengths):
        if n > seq_len:
            raise DataError(f"example {i} has {n} tokens, more than the {seq_len} of a packed row (truncate it first)")
        if n == 0:
            continue
        if used + n > seq_len:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


def packed_rows(rows: Sequence[Sequence[int]], trained: Sequence[Sequence[bool]] | None,
                groups: Sequence[Sequence[int]], seq_len: int, pad_id: int | None = None) -> Packed:
    """The :class:`Packed` tensors of ``groups`` (each a row's example indices into ``rows``)."""
    N = len(groups)
    pad = 0 if pad_id is None else int(pad_id)
    ids = torch.full((N, seq_len), pad, dtype=torch.long)
    labels = torch.full((N, seq_len), IGNORE, dtype=torch.long)
    documents = torch.zeros((N, seq_len), dtype=torch.long)
    positions = torch.zeros((N, seq_len), dtype=torch.long)
    for r, group in enumerate(groups):
        start = 0
        for d, i in enumerate(group, start=1):
            row = rows[i]
            n = len(row)
            if start + n > seq_len:
                raise DataError(f"row {r}'s examples hold more than {seq_len} tokens")
            ids[r, start:start + n] = torch.as_tensor(list(row), dtype=torch.long)
            labels[r, start:start + n] = torch.as_tensor(_labels_of(row, None if trained is None else trained[i]),
                                                         dtype=torch.long)
            documents[r, start:start + n] = d
            positions[r, start:start + n] = torch.arange(n)
            start += n
    return Packed(ids, labels, documents, positions, [list(g) for g in groups])


def pack_sequences(rows: Sequence[Sequence[int]], trained: Sequence[Sequence[bool]] | None, seq_len: int,
                   pad_id: int | None = None) -> Packed:
    """Pack examples, in order, into rows of ``seq_len`` tokens (:func:`pack_groups`, :func:`packed_rows`)."""
    return packed_rows(rows, trained, pack_groups([len(r) for r in rows], seq_len), seq_len, pad_id)

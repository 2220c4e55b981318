"""Encoding inputs longer than an encoder's context in overlapping chunks.

A row is cut into chunks of ``c = chunk`` positions whose starts advance by the stride ``s = chunk - overlap``;
the last chunk is aligned to end at the row's last token, so every token is covered (that chunk may overlap its
neighbour by more than ``overlap``). Each row is cut by its own length (its tokens in ``mask``, right-padded), so
a padded batch gives every row what it would get alone. The chunks of all rows are encoded independently, as
one batch (or ``max_batch`` at a time), each with its positions counted from 0. No position attends across a
chunk's edge: the interaction across chunks is lost, and accepted; the overlap gives the tokens near an edge
context on both sides in a neighbouring chunk.

For a row of L tokens the starts are 0, s, 2s, ... up to L - c, then L - c if the grid does not reach it (a
single chunk at 0 when L <= c: :func:`chunk_starts`). Chunk k (row b_k, start s_k) is encoded to e_k (c, C);
position t of row b lies in the chunks K_bt = {k : b_k = b, s_k <= t < s_k + c}.

Fusion into (B, T, C), :func:`fuse_chunks`:

* ``mean``: h_bt = (1 / |K_bt|) * sum_{k in K_bt} e_k[t - s_k].
* ``max_context`` (BERT's SQuAD rule, ``token_is_max_context``): h_bt = e_k[t - s_k] of the one chunk k in K_bt
  with the most context on the nearer side, argmax_k min(t - s_k, s_k + c - 1 - t), the earliest on ties.

A padding position's state is unspecified, as in a plain encode (0 where no chunk covers it).

Pooling into (B, C) for classifiers, :func:`pool_chunks`: each chunk's mean over its tokens (mask m_k),
v_k = sum_j m_k[j] e_k[j] / max(1, sum_j m_k[j]), then over the row's chunks: ``mean`` p_b = mean_{k: b_k = b} v_k,
``max`` p_b = the elementwise max_{k: b_k = b} v_k.

Example::

    memory = encode_in_chunks(model.encode, source, source_mask, chunk=256, overlap=64)  # (B, T, C)
    chunks = split_chunks(ids, mask, chunk=512, overlap=128)
    pooled = pool_chunks(encode_chunks(encode, chunks), chunks, how="max")  # (B, C)

Shapes: B rows, T positions, N chunks of all rows, c chunk length (min(chunk, T)), C channels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ..config import check

Encode = Callable[[Tensor, Tensor | None], Tensor]  # (n, c) ids, (n, c) mask | None -> (n, c, C) states
FUSIONS = ("mean", "max_context")
POOLINGS = ("mean", "max")


def check_chunking(chunk: int, overlap: int) -> None:
    """``chunk`` a positive integer, ``overlap`` an integer in [0, chunk) (a :class:`~tokenloom.errors.ConfigError`
    naming the values otherwise)."""
    check(isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 1,
          f"chunk must be a positive integer, got {chunk!r}")
    check(isinstance(overlap, int) and not isinstance(overlap, bool) and 0 <= overlap < chunk,
          f"overlap must be an integer in [0, chunk={chunk}), got {overlap!r}")


def chunk_starts(length: int, chunk: int, overlap: int) -> list[int]:
    """The first positions of the chunks of a row of ``length`` tokens: 0, s, 2s, ... (s = chunk - overlap) up
    to length - chunk, and length - chunk where the grid does not reach it; [0] when length <= chunk."""
    check_chunking(chunk, overlap)
    if length <= chunk:
        return [0]
    starts = list(range(0, length - chunk + 1, chunk - overlap))
    return starts if starts[-1] == length - chunk else [*starts, length - chunk]


class Chunks(NamedTuple):
    """The chunks of a (B, T) input: their ids and mask, each chunk's row and start."""

    ids: Tensor  # (N, c)
    mask: Tensor | None  # (N, c), None where the input had no mask
    row: Tensor  # (N,) long: the input row of each chunk
    start: Tensor  # (N,) long: its first position in that row
    shape: tuple[int, int]  # (B, T) of the input

    def index(self) -> Tensor:
        """(N, c) long: each chunk position's flat index b * T + t into the input."""
        c = self.ids.shape[1]
        return self.row[:, None] * self.shape[1] + self.start[:, None] + torch.arange(c, device=self.ids.device)

    def coverage(self) -> Tensor:
        """(B, T) long: how many chunks hold each position (|K_bt|; 0 for padding past a row's last chunk)."""
        index = self.index().reshape(-1)
        counts = torch.zeros(self.shape[0] * self.shape[1], dtype=torch.long, device=index.device)
        return counts.index_add_(0, index, torch.ones_like(index)).view(self.shape)


def right_padded_lengths(mask: Tensor, T: int) -> list[int]:
    """Each row's number of tokens of a (B, T) mask (1 = token), which must hold its tokens first."""
    if mask.dim() != 2 or mask.shape[1] != T:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not match ids of {T} positions per row")
    lengths = mask.bool().sum(1)
    if not bool((mask.bool() == (torch.arange(T, device=mask.device) < lengths[:, None])).all()):
        raise ValueError("mask must be right-padded (each row's tokens first) to be cut into chunks")
    return lengths.tolist()


def split_chunks(ids: Tensor, mask: Tensor | None = None, *, chunk: int, overlap: int) -> Chunks:
    """Cut ids (B, T) (``mask`` (B, T), 1 = token, right-padded) into the chunks of :func:`chunk_starts`, each
    row by its own length: :class:`Chunks` of c = min(chunk, T) positions."""
    check_chunking(chunk, overlap)
    B, T = ids.shape
    lengths = [T] * B if mask is None else right_padded_lengths(mask, T)
    rows, starts = [], []
    for b, length in enumerate(lengths):
        row_starts = chunk_starts(length, chunk, overlap)
        rows += [b] * len(row_starts)
        starts += row_starts
    row = torch.tensor(rows, dtype=torch.long, device=ids.device)
    start = torch.tensor(starts, dtype=torch.long, device=ids.device)
    where = start[:, None] + torch.arange(min(chunk, T), device=ids.device)  # (N, c) positions in the row
    return Chunks(ids[row[:, None], where], None if mask is None else mask[row[:, None], where], row, start, (B, T))


def encode_chunks(encode: Encode, chunks: Chunks, max_batch: int | None = None) -> Tensor:
    """Every chunk encoded independently, ``max_batch`` chunks per ``encode`` call (None: all in one):
    (N, c, C)."""
    check(max_batch is None or (isinstance(max_batch, int) and max_batch >= 1),
          f"max_batch must be a positive integer or null, got {max_batch!r}")
    N, c = chunks.ids.shape
    step = max_batch or N
    parts = [encode(chunks.ids[i:i + step], None if chunks.mask is None else chunks.mask[i:i + step])
             for i in range(0, N, step)]
    states = parts[0] if len(parts) == 1 else torch.cat(parts)
    if states.shape[:2] != (N, c):
        raise ValueError(f"encode gave states of shape {tuple(states.shape)} for {N} chunks of {c} positions")
    return states


def fuse_chunks(states: Tensor, chunks: Chunks, fusion: str = "mean") -> Tensor:
    """The chunks' states (N, c, C) fused into the input's positions (B, T, C) by ``fusion`` (``mean`` or
    ``max_context``, the formulas in the module docstring); positions no chunk covers are 0."""
    check(fusion in FUSIONS, f"fusion must be one of {', '.join(FUSIONS)}, got {fusion!r}")
    (B, T), C = chunks.shape, states.shape[-1]
    index = chunks.index().reshape(-1)  # (N*c,)
    flat = states.reshape(-1, C)  # (N*c, C)
    if fusion == "max_context":
        keep = max_context(chunks).reshape(-1)
        index, flat = index[keep], flat[keep]
    total = states.new_zeros(B * T, C).index_add_(0, index, flat)
    if fusion == "mean":
        count = states.new_zeros(B * T).index_add_(0, index, states.new_ones(index.shape))
        total = total / count.clamp(min=1)[:, None]
    return total.view(B, T, C)


def max_context(chunks: Chunks) -> Tensor:
    """(N, c) bool: True at the one chunk position that ``max_context`` fusion takes for each covered position
    (the most context on its nearer side, the earliest chunk on ties)."""
    N, c = chunks.ids.shape
    offset = torch.arange(c, device=chunks.ids.device)
    context = torch.minimum(offset, c - 1 - offset)  # (c,) positions on the nearer side inside the chunk
    key = context[None, :] * N + (N - 1 - torch.arange(N, device=offset.device))[:, None]  # (N, c): unique per t
    index = chunks.index()
    best = torch.full((chunks.shape[0] * chunks.shape[1],), -1, dtype=key.dtype, device=key.device)
    best = best.scatter_reduce_(0, index.reshape(-1), key.reshape(-1), "amax")
    return key == best[index]


def pool_chunks(states: Tensor, chunks: Chunks, how: str = "mean") -> Tensor:
    """One vector per input row from its chunks' states (N, c, C): each chunk's mean over its tokens, then the
    ``mean`` or the elementwise ``max`` over the row's chunks: (B, C)."""
    check(how in POOLINGS, f"how must be one of {', '.join(POOLINGS)}, got {how!r}")
    B, C = chunks.shape[0], states.shape[-1]
    if chunks.mask is None:
        vectors = states.mean(1)  # (N, C)
    else:
        m = chunks.mask.to(states.dtype)[..., None]  # (N, c, 1)
        vectors = (states * m).sum(1) / m.sum(1).clamp(min=1)
    if how == "mean":
        total = vectors.new_zeros(B, C).index_add_(0, chunks.row, vectors)
        return total / torch.bincount(chunks.row, minlength=B).to(vectors.dtype)[:, None]
    pooled = vectors.new_full((B, C), -torch.inf)
    return pooled.scatter_reduce_(0, chunks.row[:, None].expand(-1, C), vectors, "amax")


def encode_in_chunks(encode: Encode, ids: Tensor, mask: Tensor | None = None, *, chunk: int, overlap: int,
                     fusion: str = "mean", max_batch: int | None = None) -> Tensor:
    """ids (B, T) (``mask`` (B, T), 1 = token, right-padded) encoded in overlapping chunks of ``chunk``
    positions advancing by ``chunk - overlap`` and fused by ``fusion``: (B, T, C). ``encode(ids, mask)`` encodes
    a batch of chunks (an encoder's ``encode``); T <= chunk is one plain ``encode(ids, mask)`` call."""
    check_chunking(chunk, overlap)
    check(fusion in FUSIONS, f"fusion must be one of {', '.join(FUSIONS)}, got {fusion!r}")
    check(max_batch is None or (isinstance(max_batch, int) and max_batch >= 1),
          f"max_batch must be a positive integer or null, got {max_batch!r}")
    if ids.shape[1] <= chunk:
        return encode(ids, mask)
    chunks = split_chunks(ids, mask, chunk=chunk, overlap=overlap)
    return fuse_chunks(encode_chunks(encode, chunks, max_batch), chunks, fusion)

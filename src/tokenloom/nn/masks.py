"""Attention masks.

Masks are boolean with ``True`` meaning "may attend"; :func:`additive_mask` turns one into the float
form (0 / the dtype's minimum) that can be summed with a position bias. :func:`attention_mask` is the one
builder every model and cache strategy uses. Shapes: B batch, H heads, Tq queries,
Tk keys.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def causal_mask(q_len: int, k_len: int, device: torch.device | None = None, group: int = 1) -> Tensor:
    """(Tq, Tk) bool: query i (the last ``q_len`` of ``k_len`` positions) sees keys ``<= k_len - q_len + i``;
    with ``group`` > 1 (group-causal), every key of its own and earlier groups of ``group`` positions."""
    offset = k_len - q_len
    q = group_end(torch.arange(q_len, device=device)[:, None] + offset, group)
    k = torch.arange(k_len, device=device)[None, :]
    return k <= q


def group_end(index: Tensor, group: int) -> Tensor:
    """The last position of each index's group of ``group`` positions (the index itself for ``group`` 1): a query
    that sees every key up to it sees exactly the keys of its own and earlier groups (semi-autoregressive)."""
    return index if group == 1 else (index // group + 1) * group - 1


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """(B, T) 0/1 mask with left padding -> (B, T) position ids counting real tokens from 0 (pads get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True = may attend) as an additive float mask: 0 where allowed, the dtype's minimum
    elsewhere (finite, so a fully masked row gives a uniform softmax rather than NaN)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


class KeySpan(NamedTuple):
    """Which keys a call's T new queries see, as a cache strategy (or a whole-sequence pass) describes it.

    ``past`` (dense): positions already cached, the queries at ``[past, keys)`` (None: ``queries`` given);
    ``keys``: S, the keys attended; ``queries`` (B|1, T) the queries' key indices where ``past`` is None (their
    positions where ``key_positions`` is given); ``valid`` (B|1, S) bool, False for padding keys, or None; ``ragged``:
    rows at different lengths (one query each, a server's running batch), which attention computes with the
    one-query kernel (:class:`~.attention.Context`). A strategy whose keys are not in position order (the rolling
    ring of sliding-window attention) gives their ``key_positions`` (B|1, S), and ``windowed`` when it holds only
    keys inside the queries' window (nothing left for the window to hide). ``extent``: one past the last column
    written, where the strategy knows it as a number (dense, rolling): the model checks it against its context.
    ``layout``: a strategy that runs attention itself over its own storage (the paged cache's groups of rows)."""

    past: int | None
    keys: int
    queries: Tensor | None = None
    valid: Tensor | None = None
    ragged: bool = False
    windowed: bool = False
    key_positions: Tensor | None = None
    extent: int | None = None
    layout: object = None  # a paged cache's attention plan (:class:`~.paged.PagedLayout`): it attends itself
    documents: Tensor | None = None  # (B, S) example ids of packed rows (whole-sequence passes only): a query sees
    #   only the keys of its own example (equal ids; 0 = padding)


def sequence_span(length: int, valid: Tensor | None = None, documents: Tensor | None = None) -> KeySpan:
    """A whole-sequence pass (no cache): ``length`` queries over the same keys; ``valid`` (B, S) 1 = token;
    ``documents`` (B, S) the example id of each position of packed rows (0 = padding; attention stays inside an
    example; ``valid`` defaults to ``documents != 0``)."""
    if documents is not None and valid is None:
        valid = documents != 0
    return KeySpan(0, length, None, None if valid is None else valid.bool(), extent=length, documents=documents)


def document_positions(documents: Tensor) -> Tensor:
    """(B, T) example ids of packed rows (contiguous runs, 0 = padding) -> (B, T) positions restarting at 0 at the
    start of every example (padding gets 0)."""
    T = documents.shape[-1]
    index = torch.arange(T, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values  # the start of each one's run
    return (index - first).masked_fill_(documents == 0, 0)


def attention_mask(span: KeySpan, T: int, *, causal: bool, position=None, window=None, dtype: torch.dtype,
                   device: torch.device, group: int = 1) -> tuple[Tensor | None, bool]:
    """The one mask builder: (attn_mask, is_causal) for T queries over ``span`` — every model and cache strategy
    builds its masks here, built once per forward and shared by every layer.

    ``causal``: a query sees the keys at or before its own index; ``span.documents`` (packed rows): only the keys of
    its own example; ``position`` (a :class:`~.positions.Position`)
    adds its score bias (ALiBi, T5) where it has one; ``window`` (a :class:`~.sliding.Window`) hides the keys
    outside each query's sliding window; ``group`` > 1 with ``causal`` (semi-autoregressive decoding, no window):
    group-causal, a query sees every key of its own and earlier groups of ``group`` positions. The mask is None (or
    ``is_causal`` True: the fused kernels' own causal path) where nothing needs masking, a bool (Tq, S) causal mask
    for a dense cache without padding or bias, else an additive float (B|1, H|1, T, S) mask in ``dtype`` (0 / the
    dtype's minimum, plus the bias)."""
    has_bias = position is not None and position.has_bias
    if window is not None and (span.windowed or (span.key_positions is None and window.covers(span.keys))):
        window = None  # every key is inside the window already
    if span.windowed:
        causal = False
    if span.past is not None and span.valid is None and not has_bias and window is None and span.documents is None:
        if T == 1 or not causal:
            return None, False
        if group > 1:  # None when every query sees every key (a dense cache's one new, whole group)
            if T == group and span.past % group == 0:
                return None, False
            return causal_mask(T, span.keys, device, group), False
        if span.past == 0:
            return None, True
        return causal_mask(T, span.keys, device), False
    index = span.key_positions if span.key_positions is not None else torch.arange(span.keys, device=device)
    index = index if index.dim() == 2 else index[None]  # (B|1, S)
    queries = span.queries if span.queries is not None else torch.arange(span.past, span.keys, device=device)[None]
    allowed = None
    if window is not None:
        q_pos, k_pos = queries, index
        if window.globals and span.valid is not None and span.key_positions is None:  # positions count real tokens
            k_pos = span.valid.long().cumsum(-1) - 1
            q_pos = k_pos.gather(1, queries.expand(k_pos.shape[0], -1))
        allowed = window.allowed(q_pos[..., None], k_pos[:, None, :])[:, None]  # (B|1, 1, T, S)
        if causal and not window.causal:
            allowed = allowed & (index[:, None, :] <= queries[..., None])[:, None]
    elif causal and (span.past is None or T > 1):  # (a dense cache's single query sees every key anyway)
        allowed = (index[:, None, :] <= group_end(queries, group)[..., None])[:, None]  # (B|1, 1, T, S)
    if span.valid is not None:
        pad = span.valid[:, None, None, :]  # (B, 1, 1, S)
        allowed = pad if allowed is None else allowed & pad
    if span.documents is not None:  # packed examples: a query sees only its own example's keys
        docs = span.documents
        same = (docs[:, -T:, None] == docs[:, None, :])[:, None]  # (B, 1, T, S)
        allowed = same if allowed is None else allowed & same
    mask = None if allowed is None else additive_mask(allowed, dtype)
    if has_bias:
        keys = index if span.key_positions is not None else index[0]
        bias = position.bias(queries if span.queries is not None else queries[0], keys)  # (B|1, H, T, S)
        if bias is not None:
            mask = bias.to(dtype) if mask is None else mask + bias.to(dtype)
    return mask, False

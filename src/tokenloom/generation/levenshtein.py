"""Levenshtein Transformer decoding (kind ``levenshtein``, :mod:`tokenloom.models.nat_kinds.levenshtein`).

Every sentence starts from ``[BOS, EOS]``; each round (:func:`levenshtein_round`) makes three decoder passes:

1. deletion: the argmax of the deletion classifier at every token but BOS / EOS; the deleted are removed
   (skipped in round one, which has nothing to delete);
2. placeholders: the argmax count of each adjacent pair, inserted as ``<plh>`` (``mask_id``); a sentence's length
   (BOS and EOS included) is capped at the decoder's positions, ``max_target_len``, slots filled left to right;
3. fill: the argmax token (``banned_ids`` banned) at each placeholder.

A sentence stops when a round leaves it unchanged, or after ``iterations`` rounds, and leaves the batch; its
rounds (that last one included) are recorded. Every step is per row, so padding (the batch's other sentences)
does not change a sentence's result.

Shapes: tokens (N, T) right-padded with BOS and EOS, memory (N, S, C), source_mask (N, S).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..models.nat import NonAutoregressiveTransformer
from ..models.nat_kinds.edits import delete_tokens, insert_placeholders
from ..models.nat_kinds.levenshtein import decoder_states, deletion_logits, placeholder_logits, token_logits
from .parallel import NAT_DECODINGS, ban, record_rounds

MemoryKV = list[tuple[Tensor, Tensor]]


def inner_positions(tokens: Tensor, pad_id: int) -> Tensor:
    """(N, T) bool: the real positions but the first (BOS) and the last (EOS) of each row."""
    lengths = (tokens != pad_id).sum(1, keepdim=True)
    positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
    return (positions > 0) & (positions < lengths - 1)


def cap_counts(counts: Tensor, room: Tensor) -> Tensor:
    """Placeholder counts (N, P) cut so that each row inserts at most ``room`` (N,) in all, slots served left to
    right."""
    before = counts.cumsum(1) - counts  # (N, P): placeholders asked for by the slots to the left
    return torch.minimum(counts, (room[:, None] - before).clamp(min=0))


def pad_to(tokens: Tensor, width: int, pad_id: int) -> Tensor:
    """tokens (N, T) right-padded to (N, width) (width >= T)."""
    return F.pad(tokens, (0, width - tokens.shape[1]), value=pad_id)


def unchanged(old: Tensor, new: Tensor, pad_id: int) -> Tensor:
    """(N,) bool: rows of ``old`` and ``new`` (right-padded, any widths) that hold the same sequence."""
    width = max(old.shape[1], new.shape[1])
    return (pad_to(old, width, pad_id) == pad_to(new, width, pad_id)).all(1)


def levenshtein_round(model: NonAutoregressiveTransformer, tokens: Tensor, memory: Tensor, source_mask: Tensor,
                      memory_kv: MemoryKV, delete: bool) -> Tensor:
    """One round of edits (deletion when ``delete``, placeholders, fill) of ``tokens`` (N, T) -> (N, T')."""
    c = model.config
    if delete:
        hidden = decoder_states(model, tokens, memory, source_mask, memory_kv)
        deleted = (deletion_logits(model, hidden).argmax(-1) == 1) & inner_positions(tokens, c.pad_id)
        tokens = delete_tokens(tokens, deleted, c.pad_id)
    hidden = decoder_states(model, tokens, memory, source_mask, memory_kv)
    lengths = (tokens != c.pad_id).sum(1)
    pairs = torch.arange(tokens.shape[1] - 1, device=tokens.device)[None] < lengths[:, None] - 1  # (N, T - 1)
    counts = placeholder_logits(model, hidden).argmax(-1) * pairs
    counts = cap_counts(counts, (c.max_target_len - lengths).clamp(min=0))
    if not bool(counts.any()):
        return tokens
    tokens = insert_placeholders(tokens, counts, c.mask_id, c.pad_id)
    where = tokens == c.mask_id
    hidden = decoder_states(model, tokens, memory, source_mask, memory_kv)
    logits = ban(token_logits(model, hidden, where).float(), c.banned_ids)  # (P, V)
    return tokens.index_put((where,), logits.argmax(-1))


@NAT_DECODINGS.register("levenshtein")
def levenshtein_decoding(model: NonAutoregressiveTransformer, source: Tensor, source_mask: Tensor, memory: Tensor,
                         *, iterations: int, length_beam: int, rescorer: nn.Module | None,
                         rounds: list[int] | None = None) -> list[list[int]]:
    """Iterative deletion / insertion from ``[BOS, EOS]`` for at most ``iterations`` rounds (see the module
    docstring); ``length_beam`` and ``rescorer`` do not apply."""
    c = model.config
    B = source.shape[0]
    memory_kv = model.memory_kv(memory)  # once: each round reads the rows still decoding
    tokens = torch.tensor([[c.bos_id, c.eos_id]], device=source.device).expand(B, 2)
    active = torch.arange(B, device=source.device)
    results: list[list[int]] = [[] for _ in range(B)]
    used = [iterations] * B
    for r in range(iterations):
        kv = [(k[active], v[active]) for k, v in memory_kv]
        new = levenshtein_round(model, tokens, memory[active], source_mask[active], kv, delete=r > 0)
        done = unchanged(tokens, new, c.pad_id) if r < iterations - 1 \
            else torch.ones(len(active), dtype=torch.bool, device=source.device)
        lengths = (new != c.pad_id).sum(1).tolist()
        for i in done.nonzero().flatten().tolist():
            b = int(active[i])
            results[b], used[b] = new[i, 1:lengths[i] - 1].tolist(), r + 1
        active, tokens = active[~done], new[~done]
        if len(active) == 0:
            break
        tokens = tokens[:, :int((tokens != c.pad_id).sum(1).max())]  # the rows left: their own width
    record_rounds(rounds, B, used)
    return results

"""Insertion Transformer decoding (kind ``insertion``, :mod:`tokenloom.models.nat_kinds.insertion`): parallel
insertion from the empty hypothesis ``[BOS, EOS]``.

Each round the decoder reads every unfinished hypothesis once and every slot (between two adjacent positions)
takes its argmax over the vocabulary (``config.banned_ids`` banned, ``<end-of-slot>`` allowed); the argmax token
is inserted into every slot whose argmax is not ``<end-of-slot>``, all at once. A sentence is finished when every
slot says ``<end-of-slot>``, after ``iterations`` rounds, or when it fills the decoder's positions
(``max_target_len``, BOS and EOS included; when a round would overfill it, the leftmost insertions are kept);
finished sentences leave the batch. The rounds recorded per sentence are the decoder passes it took, the last
one (all ``<end-of-slot>``) included: a balanced tree of L tokens takes ceil(log2(L + 1)) insertion rounds + 1.

The loop (:func:`insertion_loop`) takes the per-slot argmax as a callable (:data:`SlotArgmax`), so the model's
(:func:`model_slot_argmax`) and a stand-in (an oracle, in the tests) run the same loop.

Shapes: N unfinished sentences, T hypothesis positions (BOS and EOS included), right-padded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..errors import GenerationError
from ..models.nat import NonAutoregressiveTransformer
from ..models.nat_kinds.edits import insert_placeholders
from ..models.nat_kinds.insertion import hypothesis_slot_logits
from .parallel import NAT_DECODINGS, ban, record_rounds

# (rows (N,): the sentences' indices in the batch, hypotheses (N, T)) -> each slot's argmax id (N, T - 1)
SlotArgmax = Callable[[Tensor, Tensor], Tensor]


def insert_tokens(hypotheses: Tensor, lengths: Tensor, picks: Tensor, insert: Tensor,
                  pad_id: int) -> tuple[Tensor, Tensor]:
    """Insert ``picks`` (N, T - 1) into the slots where ``insert`` (N, T - 1) is True (slot l: between positions l
    and l + 1) of ``hypotheses`` (N, T) of ``lengths`` (N,) -> (new hypotheses (N, T'), new lengths (N,)): one
    placeholder per chosen slot (:func:`~tokenloom.models.nat_kinds.edits.insert_placeholders`, the Levenshtein
    decoding's), then the picks in their place, slot order being reading order."""
    out = insert_placeholders(hypotheses, insert.long(), -1, pad_id)  # -1: an id no hypothesis holds
    out[out == -1] = picks[insert]
    return out, lengths + insert.long().sum(1)


def insertion_loop(slot_argmax: SlotArgmax, batch: int, *, bos_id: int, eos_id: int, pad_id: int, end_id: int,
                   iterations: int, max_len: int, device: torch.device | str = "cpu") -> tuple[list[list[int]],
                                                                                              list[int]]:
    """Parallel insertion for ``batch`` sentences from ``[BOS, EOS]`` (see the module docstring) -> (token ids per
    sentence without BOS / EOS, decoder rounds per sentence)."""
    if iterations < 1:
        raise GenerationError(f"iterations must be >= 1, got {iterations}")
    results: list[list[int]] = [[] for _ in range(batch)]
    used = [0] * batch
    active = torch.arange(batch, device=device)
    hypotheses = torch.tensor([[bos_id, eos_id]], device=device).repeat(batch, 1)  # (N, 2)
    lengths = torch.full((batch,), 2, device=device)
    for round_ in range(1, iterations + 1):
        if not len(active):
            break
        picks = slot_argmax(active, hypotheses)  # (N, T - 1)
        T = hypotheses.shape[1]
        insert = (picks != end_id) & (torch.arange(T - 1, device=device)[None] < (lengths - 1)[:, None])
        insert &= insert.long().cumsum(1) <= (max_len - lengths)[:, None]  # the leftmost that fit
        hypotheses, lengths = insert_tokens(hypotheses, lengths, picks, insert, pad_id)
        done = ~insert.any(1) | (lengths >= max_len) | (round_ == iterations)
        for i in done.nonzero().flatten().tolist():
            b = int(active[i])
            results[b], used[b] = hypotheses[i, 1:int(lengths[i]) - 1].tolist(), round_
        active, hypotheses, lengths = active[~done], hypotheses[~done], lengths[~done]
        if len(active):
            hypotheses = hypotheses[:, :int(lengths.max())]
    return results, used


def model_slot_argmax(model: NonAutoregressiveTransformer, source: Tensor, source_mask: Tensor,
                      memory: Tensor) -> SlotArgmax:
    """The model's per-slot argmax (``config.banned_ids`` banned) for rows of source (B, S) encoded as ``memory``
    (B, S, C); the cross-attention keys and values computed once."""
    memory_kv = model.memory_kv(memory)
    banned = model.config.banned_ids

    def pick(rows: Tensor, hypotheses: Tensor) -> Tensor:
        kv = [(k[rows], v[rows]) for k, v in memory_kv]
        logits = hypothesis_slot_logits(model, source[rows], source_mask[rows], memory[rows], hypotheses, kv)
        return ban(logits.float(), banned).argmax(-1)

    return pick


@NAT_DECODINGS.register("insertion")
def insertion_decoding(model: NonAutoregressiveTransformer, source: Tensor, source_mask: Tensor, memory: Tensor, *,
                       iterations: int, length_beam: int, rescorer: nn.Module | None,
                       rounds: list[int] | None = None) -> list[list[int]]:
    """Parallel insertion (:func:`insertion_loop`) with the model's slot argmax, at most ``iterations`` rounds
    (``length_beam`` and ``rescorer`` do not apply)."""
    c = model.config
    results, used = insertion_loop(model_slot_argmax(model, source, source_mask, memory), source.shape[0],
                                   bos_id=c.bos_id, eos_id=c.eos_id, pad_id=c.pad_id, end_id=c.blank_id,
                                   iterations=iterations, max_len=c.max_target_len, device=source.device)
    record_rounds(rounds, source.shape[0], used)
    return results

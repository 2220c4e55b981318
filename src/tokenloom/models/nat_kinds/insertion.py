"""Kind ``insertion`` (the Insertion Transformer, Stern, Chan, Kiros & Uszkoreit 2019): the decoder reads the
current hypothesis with its boundaries, ``[BOS] y [EOS]``, and each slot between two adjacent positions predicts a
token to insert there or ``<end-of-slot>`` (the ``<blank>`` id, ``blank_id``). No length predictor: the length comes
from the insertions. Decoded by parallel insertion (:mod:`tokenloom.generation.insertion`).

Slot l of a hypothesis of T positions (l = 0..T-2, between positions l and l+1) is represented by
``Linear(2C, C)`` over the concatenated decoder states (h_l, h_{l+1}) (``model.kind_heads["slot"]``) and projected
by the shared output layer (``model.lm_head``): one softmax over the vocabulary (``<end-of-slot>`` included) per slot.

Training (the balanced-binary-tree loss, paper §3.2 / §4): per pair a partial hypothesis is drawn, k uniform in
0..n then a uniformly random subset of k target tokens kept in order. Slot l then misses the span
y_{i_l..j_l} of the target between its two kept neighbours; its loss is
-sum_{i in span} w_l(i) log p(y_i | slot l) with w_l(i) = softmax over the span of -|(i_l + j_l) / 2 - i| / tau
(:data:`TAU`), or -log p(<end-of-slot> | slot l) for an empty span. The loss is the mean over every slot of the
batch. Label smoothing mixes each slot's target distribution with the uniform one as cross-entropy does:
(1 - eps) x the slot loss + eps x the mean of -log p over the vocabulary.

A hypothesis holds at most ``max_target_len - 2`` tokens (BOS and EOS take two decoder positions), so a target of
``max_target_len - 1`` tokens (the data's longest) is trained from partial hypotheses of at most that many.

Shapes: tokens (B, T) = [BOS] y [EOS] right-padded -> inputs (B, T, C), mask (B, T); hidden (B, T, C) -> slot
logits (B, T - 1, V); targets (B, L) of lengths (B,).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ...config import check
from .base import NAT_KINDS, ReadsTokens

TAU = 1.0  # temperature of the balanced-binary-tree weights (the paper's tau = 1.0); large tau: uniform weights


def slot_pairs(hidden: Tensor) -> Tensor:
    """Decoder states (B, T, C) -> the concatenated states of each adjacent pair (h_l, h_{l+1}), (B, T - 1, 2C)."""
    return torch.cat([hidden[:, :-1], hidden[:, 1:]], dim=-1)


def slot_logits(model: Any, hidden: Tensor) -> Tensor:
    """Decoder states (B, T, C) -> per-slot logits (B, T - 1, V) (``<end-of-slot>`` is ``blank_id``)."""
    return model.lm_head(model.kind_heads["slot"](slot_pairs(hidden)))


def hypothesis_slot_logits(model: Any, source: Tensor, source_mask: Tensor, memory: Tensor, tokens: Tensor,
                           memory_kv: list[tuple[Tensor, Tensor]] | None = None) -> Tensor:
    """Hypotheses ``tokens`` (B, T) ([BOS] y [EOS], right-padded) for source (B, S) encoded as ``memory``
    (B, S, C) -> slot logits (B, T - 1, V); slots past a row's last real position are padding."""
    inputs, mask = model.decoder_inputs(source, source_mask, tokens=tokens)
    return slot_logits(model, model.decode_hidden(inputs, mask, memory, source_mask, memory_kv))


def random_kept(real: Tensor, limit: int, generator: torch.Generator | None = None) -> Tensor:
    """The partial hypotheses of training: in each row of ``real`` (B, L) (True = a target token) k uniform in
    0..min(n_i, ``limit``) (n_i the row's tokens), then k of its tokens chosen uniformly -> kept (B, L) bool."""
    B, L = real.shape
    most = real.sum(1).clamp(max=limit)
    counts = (torch.rand(B, generator=generator, device=real.device) * (most + 1)).long().clamp(max=most)
    scores = torch.rand(B, L, generator=generator, device=real.device).masked_fill(~real, 2.0)
    rank = torch.empty_like(scores, dtype=torch.long).scatter_(
        1, scores.argsort(dim=1), torch.arange(L, device=real.device).expand(B, L))
    return (rank < counts[:, None]) & real


def hypotheses(tokens: Tensor, kept: Tensor, bos_id: int, eos_id: int, pad_id: int) -> Tensor:
    """Target tokens (B, L) and the kept ones (B, L) bool -> the hypotheses [BOS] kept tokens in order [EOS],
    right-padded, (B, K + 2) with K the most kept in a row."""
    B = tokens.shape[0]
    k = kept.sum(1)  # (B,)
    width = int(k.max()) + 2 if B else 2
    out = torch.full((B, width), pad_id, dtype=torch.long, device=tokens.device)
    out[:, 0] = bos_id
    rows, cols = kept.nonzero(as_tuple=True)  # row-major: each row's kept tokens in order
    out[rows, 1 + (kept.long().cumsum(1) - 1)[rows, cols]] = tokens[rows, cols]
    out[torch.arange(B, device=tokens.device), k + 1] = eos_id
    return out


def tree_weights(kept: Tensor, real: Tensor, tau: float = TAU) -> tuple[Tensor, Tensor]:
    """For kept (B, L) and real (B, L) masks: each missing target token's slot (the number of kept tokens before it;
    (B, L) long) and its weight w_l(i) = softmax over its span y_{i_l..j_l} of -|(i_l + j_l) / 2 - i| / tau
    ((B, L) float, 0 at kept tokens and padding)."""
    B, L = kept.shape
    index = torch.arange(L, device=kept.device).expand(B, L)
    slot = kept.long().cumsum(1) - kept.long()
    boundary = kept | ~real  # a span ends at the next kept token or at the end of the target
    previous = torch.where(boundary, index, -1).cummax(1).values  # last boundary at or before i
    following = torch.where(boundary, index, L).flip(1).cummin(1).values.flip(1)  # first boundary at or after i
    start, end = previous + 1, following - 1  # i_l, j_l of the span holding i
    distance = ((start + end).float() / 2 - index).abs()  # d_l(i)
    nearest = ((end - start) % 2).float() / 2  # the centre's distance: 0 for an odd span, 1/2 for an even one
    missing = real & ~kept
    scores = torch.exp(-(distance - nearest) / tau) * missing  # numerators of the softmax (max 1 per span)
    totals = torch.zeros(B, L + 1, device=kept.device).scatter_add_(1, slot, scores)
    return slot, scores / totals.gather(1, slot).clamp(min=1e-30)


def tree_loss(logits: Tensor, targets: Tensor, kept: Tensor, real: Tensor, end_id: int, label_smoothing: float = 0.0,
              tau: float = TAU) -> Tensor:
    """The balanced-binary-tree loss (see the module docstring): slot logits (B, K + 1, V) of the hypotheses that
    keep ``kept`` (B, L) of ``targets`` (B, L) (real (B, L)) -> the mean over every slot of the batch."""
    log_probs = F.log_softmax(logits.float(), dim=-1)  # (B, K + 1, V)
    B, slots, _ = log_probs.shape
    slot, weights = tree_weights(kept, real, tau)
    missing = real & ~kept
    slot = slot.clamp(max=slots - 1)  # (padding's slots: weight 0)
    rows = torch.arange(B, device=logits.device)[:, None]
    token_lp = log_probs[rows, slot, targets]  # (B, L): log p(y_i | the slot of i)
    losses = torch.zeros(B, slots, device=logits.device).scatter_add_(
        1, slot, -(weights * token_lp).masked_fill(~missing, 0.0))
    counts = torch.zeros(B, slots, device=logits.device).scatter_add_(1, slot, missing.float())
    valid = torch.arange(slots, device=logits.device)[None] <= kept.sum(1)[:, None]  # (B, K + 1): slots 0..k_i
    empty = (counts == 0) & valid
    losses = losses - log_probs[..., end_id] * empty
    if label_smoothing:
        losses = (1 - label_smoothing) * losses - label_smoothing * log_probs.mean(-1)
    return (losses * valid).sum() / valid.sum()


class Insertion(ReadsTokens):
    reads: ClassVar[str] = "the hypothesis tokens ([BOS] y [EOS])"
    name: ClassVar[str] = "Insertion"
    paper_gap: ClassVar[str] = "~1-2 BLEU (Stern et al. 2019)"
    has_length_head: ClassVar[bool] = False
    length_rule: ClassVar[str] = "its length comes from its insertions"
    decoding: ClassVar[str] = "insertion"
    # the cap on parallel insertion rounds: a balanced tree needs ~log2(L) + 1; 64 lets even a one-token-a-round
    # decoding finish a 62-token sentence (the length cap, max_target_len, stops it anyway)
    options: ClassVar[dict[str, int]] = {"iterations": 64}

    def check(self, config: Any) -> None:
        check(0 <= config.blank_id < config.vocab_size, f"blank_id={config.blank_id} is outside the vocabulary "
              f"[0, {config.vocab_size}) (kind insertion needs one: its <end-of-slot>)")
        check(config.max_target_len >= 3, f"max_target_len={config.max_target_len} must be >= 3 "
              "(kind insertion: BOS, EOS and one token)")

    def heads(self, config: Any) -> dict[str, nn.Module]:
        return {"slot": nn.Linear(2 * config.embed_dim, config.embed_dim)}

    def kept_id(self, config: Any) -> int:
        return config.blank_id  # <end-of-slot>: the decoding reads it, never inserts it

    def loss(self, model: Any, source: Tensor, source_mask: Tensor, tokens: Tensor, lengths: Tensor,
             label_smoothing: float, generator: torch.Generator | None = None) -> tuple[Tensor, int, int]:
        c = model.config
        real = torch.arange(tokens.shape[1], device=tokens.device)[None] < lengths[:, None]
        kept = random_kept(real, c.max_target_len - 2, generator)
        memory = model.encode(source, source_mask)
        logits = hypothesis_slot_logits(model, source, source_mask, memory,
                                        hypotheses(tokens, kept, c.bos_id, c.eos_id, c.pad_id))
        return tree_loss(logits, tokens, kept, real, c.blank_id, label_smoothing), int(lengths.sum()), 0


NAT_KINDS.register("insertion")(Insertion())

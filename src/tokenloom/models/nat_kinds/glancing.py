"""Glancing training (GLAT, Qian et al. 2021) for the single-pass kinds (``nat``, ``ctc``): a training option
(``NATConfig.glancing_ratio`` = lambda), not a kind of its own, and not a decoding (a glancing model decodes as
its kind does, in one pass).

Per training batch:

1. one parallel pass without gradients over the kind's plain decoder inputs gives the prediction Y^ (argmax);
2. its distance to the reference, d = the number of positions where they differ (Hamming distance: the
   reference is the target for kind ``nat``; for kind ``ctc`` the target's most probable alignment under the
   same pass, :func:`ctc_best_alignment`, as glancing CTC does, Gu & Kong 2021);
3. N = floor(lambda * d) positions of each sentence, drawn uniformly, have their decoder inputs replaced by
   the reference tokens' embeddings (:func:`glance`);
4. the training pass runs on those inputs; kind ``nat`` leaves the glanced positions out of the loss (they were
   given), kind ``ctc`` keeps its full CTC loss.

A sentence the model already gets right (d = 0) is trained as without glancing; so is every sentence when lambda
is 0 (then the extra pass is skipped). The first pass runs in the model's current mode (dropout on, as GLAT's).

Shapes: B batch, T decoder length, C embed_dim, V vocab_size, L target length.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F


def glance_counts(predicted: Tensor, reference: Tensor, real: Tensor, ratio: float) -> Tensor:
    """(B,) the positions to glance per sentence: floor(ratio * d), d the number of real positions (``real``
    (B, T) bool) where ``predicted`` (B, T) differs from ``reference`` (B, T)."""
    distance = ((predicted != reference) & real).sum(1)
    return torch.floor(ratio * distance.double()).long()  # as GLAT's code: a lone error in a short
    # sentence (d = 1, ratio < 1) glances nothing, so every sentence is also trained on its plain inputs


def choose_positions(real: Tensor, counts: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """(B, T) bool: in each row of ``real`` (B, T) exactly ``counts`` (B,) of its real positions (all when it has
    fewer), chosen uniformly at random."""
    B, T = real.shape
    scores = torch.rand(B, T, generator=generator, device=real.device).masked_fill(~real, 2.0)
    rank = torch.empty_like(scores, dtype=torch.long).scatter_(
        1, scores.argsort(dim=1), torch.arange(T, device=real.device).expand(B, T))
    return (rank < counts[:, None]) & real


def glance(model: Any, inputs: Tensor, reference: Tensor, chosen: Tensor) -> Tensor:
    """``inputs`` (B, T, C) with the positions ``chosen`` (B, T) replaced by the embeddings of ``reference``
    (B, T) (the target embedding table, at the decoder inputs' scale)."""
    embedded = model.scale_embeddings(model.tgt_embed(reference))  # (B, T, C)
    return torch.where(chosen[..., None], embedded.to(inputs.dtype), inputs)


def ctc_best_alignment(log_probs: Tensor, lengths: Tensor, targets: Tensor, target_lengths: Tensor,
                       blank_id: int) -> Tensor:
    """The most probable CTC alignment (Viterbi) of each target under ``log_probs`` (B, T, V) whose first
    ``lengths`` (B,) positions are real: (B, T) labels (a target token or ``blank_id`` per position; ``blank_id``
    past each row's length). Every target must fit (L + adjacent repeats <= its length), as the CTC loss needs.

    The path runs over the extended label sequence (blank, y1, blank, y2, ..., yL, blank): each step stays, moves
    one label on, or skips a blank between two different tokens; it starts at the first blank or y1 and ends at
    the last blank or yL."""
    B, T, _ = log_probs.shape
    L = targets.shape[1]
    S = 2 * L + 1
    device = log_probs.device
    labels = torch.full((B, S), blank_id, dtype=torch.long, device=device)
    labels[:, 1::2] = targets
    states = torch.arange(S, device=device)
    in_range = states[None] < (2 * target_lengths[:, None] + 1)  # (B, S)
    skip_ok = torch.zeros(B, S, dtype=torch.bool, device=device)  # s-2 -> s allowed: a token unlike the one before
    skip_ok[:, 3::2] = targets[:, 1:] != targets[:, :-1]
    neg = torch.tensor(float("-inf"), device=device)
    emit = log_probs.float().gather(2, labels[:, None, :].expand(B, T, S))  # (B, T, S)
    score = torch.full((B, S), float("-inf"), device=device)
    score[:, 0] = emit[:, 0, 0]
    score[:, 1] = torch.where(target_lengths > 0, emit[:, 0, 1], neg)
    score = score.masked_fill(~in_range, float("-inf"))
    moves = torch.zeros(T, B, S, dtype=torch.long, device=device)  # 0 stay, 1 from s-1, 2 from s-2
    for t in range(1, T):
        one = F.pad(score, (1, 0), value=float("-inf"))[:, :S]
        two = F.pad(score, (2, 0), value=float("-inf"))[:, :S].masked_fill(~skip_ok, float("-inf"))
        best, move = torch.stack([score, one, two]).max(dim=0)
        active = (t < lengths)[:, None]  # past a row's length its scores stay as they are
        score = torch.where(active, (best + emit[:, t]).masked_fill(~in_range, float("-inf")), score)
        moves[t] = torch.where(active, move, 0)
    last = 2 * target_lengths  # the final blank; or yL just before it
    end_blank = score.gather(1, last[:, None]).squeeze(1)
    end_token = score.gather(1, (last - 1).clamp(min=0)[:, None]).squeeze(1)
    state = torch.where((end_token > end_blank) & (target_lengths > 0), last - 1, last)
    path = torch.full((B, T), blank_id, dtype=torch.long, device=device)
    rows = torch.arange(B, device=device)
    for t in range(T - 1, -1, -1):
        path[:, t] = torch.where(t < lengths, labels[rows, state], blank_id)
        state = state - moves[t, rows, state]
    return path

"""Kind ``levenshtein`` (the Levenshtein Transformer, Gu, Wang & Zhao 2019): one decoder edits a sequence by
deletions and insertions. The decoder reads the current sequence ``[BOS] y [EOS]`` (``<plh>`` placeholders are
``mask_id``); three predictions share its states:

* deletion: a 2-way classifier (keep / delete) over each token's state (BOS / EOS are never deleted);
* placeholders: a classifier over the concatenated states of each adjacent pair, into 0..M placeholders for the
  slot between them (M = ``max_placeholders(config)``);
* tokens: the output layer (``model.lm_head``) at each placeholder.

Trained by imitation learning (:meth:`Levenshtein.loss`): the expert is an optimal insertion/deletion alignment
(:func:`edit_labels`). Decoded by :func:`tokenloom.generation.levenshtein.levenshtein_decoding` from
``[BOS, EOS]``; no length predictor (its length comes from its insertions and deletions).

Shapes: tokens (B, T) (right-padded, with BOS and EOS), hidden (B, T, C), pair logits (B, T - 1, M + 1).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ...config import check
from .base import NAT_KINDS, ReadsTokens, token_cross_entropy
from .edits import delete_tokens, insert_placeholders  # noqa: F401 (delete_tokens: importable from here too)

MAX_PLACEHOLDERS = 64  # the most placeholders one slot may receive, at most (and at most max_target_len)


def max_placeholders(config: Any) -> int:
    """M: the most placeholders the placeholder classifier gives one slot (classes 0..M)."""
    return min(config.max_target_len, MAX_PLACEHOLDERS)


# ---- the expert: an optimal insertion/deletion alignment --------------------------------------------

def edit_labels(hypothesis: list[int], target: list[int]) -> tuple[list[bool], list[int]]:
    """An optimal alignment of ``hypothesis`` to ``target`` under insertions and deletions only (the kept tokens
    are a longest common subsequence): (keep, one flag per hypothesis token; counts, the target tokens to insert
    into each of the k + 1 slots of ``[BOS] kept [EOS]``, k kept tokens). Ties broken deterministically: equal
    tokens are matched at once, else a deletion goes before an insertion."""
    n, m = len(hypothesis), len(target)
    # common[i][j]: length of a longest common subsequence of hypothesis[i:] and target[j:]
    common = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        row, below = common[i], common[i + 1]
        for j in range(m - 1, -1, -1):
            row[j] = below[j + 1] + 1 if hypothesis[i] == target[j] else max(below[j], row[j + 1])
    keep, counts = [False] * n, [0]
    i = j = 0
    while i < n or j < m:
        if i < n and j < m and hypothesis[i] == target[j]:
            keep[i] = True
            counts.append(0)
            i, j = i + 1, j + 1
        elif i < n and (j == m or common[i + 1][j] >= common[i][j + 1]):
            i += 1  # delete hypothesis[i]
        else:
            counts[-1] += 1  # insert target[j]
            j += 1
    return keep, counts


def placeholder_row(kept: list[int], counts: list[int], target: list[int], limit: int, bos: int, eos: int,
                    plh: int, pad: int) -> tuple[list[int], list[int]]:
    """``[BOS] kept [EOS]`` with min(count, ``limit``) placeholders inserted in each slot, and its token targets
    (the target tokens the placeholders stand for; ``pad`` elsewhere); ``kept`` is a subsequence of ``target``
    aligned by ``counts`` (from :func:`edit_labels`)."""
    tokens, targets, j = [bos], [pad], 0
    for slot, count in enumerate(counts):
        taken = min(count, limit)
        tokens += [plh] * taken
        targets += target[j:j + taken]
        j += count
        if slot < len(kept):
            tokens.append(kept[slot])
            targets.append(pad)
            j += 1
    return tokens + [eos], targets + [pad]


# ---- tensors: padding, deletion, insertion ---------------------------------------------------------

def pad_rows(rows: list[list[int]], pad_id: int, device: torch.device | None = None) -> Tensor:
    """Lists of ids -> (B, T) right-padded with ``pad_id`` (T = the longest row)."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def expert_insertions(kept_rows: list[list[int]], targets: list[list[int]], config: Any,
                      device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The insertion roll-in's states and labels for subsequences ``kept_rows`` of ``targets`` (token lists without
    BOS / EOS): ``[BOS] kept [EOS]`` (B, T); the expert's placeholder count of each adjacent pair, at most M (B,
    T - 1; -1 at padding); that sequence with the placeholders inserted (B, T'); the target token under each
    placeholder (B, T'; padding elsewhere)."""
    c, limit = config, max_placeholders(config)
    counts = [edit_labels(kept, target)[1] for kept, target in zip(kept_rows, targets, strict=True)]
    built = [placeholder_row(kept, n, target, limit, c.bos_id, c.eos_id, c.mask_id, c.pad_id)
             for kept, n, target in zip(kept_rows, counts, targets, strict=True)]
    return (pad_rows([[c.bos_id, *kept, c.eos_id] for kept in kept_rows], c.pad_id, device),
            pad_rows([[min(n, limit) for n in row] for row in counts], -1, device),
            pad_rows([b[0] for b in built], c.pad_id, device), pad_rows([b[1] for b in built], c.pad_id, device))


def expert_deletions(hypotheses: Tensor, targets: list[list[int]], pad_id: int) -> Tensor:
    """hypotheses (B, T) (``[BOS] ... [EOS]``, right-padded) -> (B, T) the expert's deletion labels: 1 at the
    tokens an optimal alignment to the target does not keep, 0 at the kept, -1 at BOS, EOS and padding."""
    lengths = (hypotheses != pad_id).sum(1).tolist()
    inner = [row[1:n - 1] for row, n in zip(hypotheses.tolist(), lengths, strict=True)]
    return pad_rows([[-1, *(int(not k) for k in edit_labels(hyp, target)[0]), -1]
                     for hyp, target in zip(inner, targets, strict=True)], -1, hypotheses.device)


# ---- the three predictions over the shared decoder --------------------------------------------------

def decoder_states(model: Any, tokens: Tensor, memory: Tensor, source_mask: Tensor,
                   memory_kv: list[tuple[Tensor, Tensor]] | None = None) -> Tensor:
    """The decoder's final states (B, T, C) over the sequences ``tokens`` (B, T) (right-padded)."""
    inputs, decoder_mask = model.decoder_inputs(None, source_mask, tokens=tokens)
    return model.decode_hidden(inputs, decoder_mask, memory, source_mask, memory_kv)


def deletion_logits(model: Any, hidden: Tensor) -> Tensor:
    """(B, T, C) states -> (B, T, 2) keep / delete logits."""
    return model.kind_heads["deletion"](hidden)


def placeholder_logits(model: Any, hidden: Tensor) -> Tensor:
    """(B, T, C) states -> (B, T - 1, M + 1) logits of the placeholder count between positions i and i + 1."""
    return model.kind_heads["placeholders"](torch.cat([hidden[:, :-1], hidden[:, 1:]], dim=-1))


def token_logits(model: Any, hidden: Tensor, where: Tensor) -> Tensor:
    """(B, T, C) states, ``where`` (B, T) bool (the placeholders) -> (P, V) token logits there."""
    return model.lm_head(hidden[where])


def random_keep(real: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """The insertion roll-in's deletions (as fairseq's ``_random_delete``): in each row of ``real`` (B, L) keep a
    uniformly random number k in 0..L_i of the tokens, chosen uniformly -> (B, L) bool. (fairseq keeps at most
    L_i - 1; keeping all of them, 1 / (L_i + 1) of the time, teaches the placeholder classifier to insert nothing
    into a finished sentence, where decoding stops.)"""
    B, L = real.shape
    lengths = real.sum(1)
    counts = (torch.rand(B, generator=generator, device=real.device) * (lengths + 1)).long().clamp(max=lengths)
    scores = torch.rand(B, L, generator=generator, device=real.device).masked_fill(~real, 2.0)
    rank = torch.empty_like(scores, dtype=torch.long).scatter_(
        1, scores.argsort(dim=1), torch.arange(L, device=real.device).expand(B, L))
    return (rank < counts[:, None]) & real


def _mean_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of (N, K) logits against (N,) labels; 0 (with a gradient path) when N = 0."""
    if labels.numel() == 0:
        return logits.sum() * 0.0
    return F.cross_entropy(logits.float(), labels)


class Levenshtein(ReadsTokens):
    reads: ClassVar[str] = "the current sequence (tokens with BOS and EOS)"
    name: ClassVar[str] = "Levenshtein"
    paper_gap: ClassVar[str] = "~0 (Gu et al. 2019)"
    has_length_head: ClassVar[bool] = False
    length_rule: ClassVar[str] = "its length comes from its insertions and deletions"
    decoding: ClassVar[str] = "levenshtein"
    options: ClassVar[dict[str, int]] = {"iterations": 10}  # the cap on decoding rounds

    def check(self, config: Any) -> None:
        check(0 <= config.mask_id < config.vocab_size, f"mask_id={config.mask_id} is outside the vocabulary "
              f"[0, {config.vocab_size}) (kind levenshtein needs one for its <plh> placeholder)")

    def heads(self, config: Any) -> dict[str, nn.Module]:
        C = config.embed_dim
        heads = {"deletion": nn.Linear(C, 2), "placeholders": nn.Linear(2 * C, max_placeholders(config) + 1)}
        for head in heads.values():
            nn.init.normal_(head.weight, std=0.02)
            nn.init.zeros_(head.bias)
        return heads

    def bench_variants(self, can_rescore: bool) -> list[dict[str, Any]]:
        return [dict(iterations=3), dict(iterations=10)]

    def loss(self, model: Any, source: Tensor, source_mask: Tensor, tokens: Tensor, lengths: Tensor,
             label_smoothing: float, generator: torch.Generator | None = None) -> tuple[Tensor, int, int]:
        """Placeholder-count + token + deletion cross-entropy (each a mean over its positions) of the two
        roll-ins: (a) insertion: the target with a random subset deleted, the expert's placeholders, the targets
        at them (``label_smoothing``); (b) deletion: the model's own argmax fill of those placeholders, the
        expert's deletions. Targets longer than the decoder allows (max_target_len - 2 tokens) are cut."""
        c = model.config
        lengths = lengths.clamp(max=c.max_target_len - 2)
        rows = [row[:n] for row, n in zip(tokens.tolist(), lengths.tolist(), strict=True)]
        keep = random_keep(torch.arange(tokens.shape[1], device=tokens.device)[None] < lengths[:, None], generator)
        kept_rows = [[t for t, k in zip(row, flags, strict=False) if k] for row, flags in zip(rows, keep.tolist(),
                                                                                            strict=True)]
        memory = model.encode(source, source_mask)
        # (a) insertion roll-in: placeholders between the tokens kept, then the tokens at the placeholders
        deleted, count_labels, inserted, targets = expert_insertions(kept_rows, rows, c, tokens.device)
        hidden = decoder_states(model, deleted, memory, source_mask)
        placeholder_loss = _mean_cross_entropy(placeholder_logits(model, hidden)[count_labels >= 0],
                                               count_labels[count_labels >= 0])
        where = inserted == c.mask_id
        logits = token_logits(model, decoder_states(model, inserted, memory, source_mask), where)  # (P, V)
        token_loss = token_cross_entropy(logits, targets[where], label_smoothing, c.pad_id) if where.any() \
            else logits.sum() * 0.0
        # (b) deletion roll-in: the model's own fill; the expert deletes what an optimal alignment does not keep
        fill = logits.detach().float()
        fill[:, c.banned_ids] = float("-inf")
        filled = inserted.index_put((where,), fill.argmax(-1))
        labels = expert_deletions(filled, rows, c.pad_id)
        states = decoder_states(model, filled, memory, source_mask)
        deletion_loss = _mean_cross_entropy(deletion_logits(model, states)[labels >= 0], labels[labels >= 0])
        return placeholder_loss + token_loss + deletion_loss, int(lengths.sum()), 0

NAT_KINDS.register("levenshtein")(Levenshtein())

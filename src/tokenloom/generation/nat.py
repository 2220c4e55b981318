"""Parallel decoding of non-autoregressive translation models (:mod:`tokenloom.models.nat`).

:func:`nat_decode` encodes the sources and hands them to the decoding that the model's kind names
(``NATKind.decoding``, :mod:`tokenloom.models.nat_kinds`), one of ``NAT_DECODINGS``:

* ``argmax`` (kind nat): the top-``length_beam`` lengths of the length predictor, one parallel argmax pass for
  each, the candidate with the best average log-probability kept (or the best under an autoregressive
  ``rescorer``);
* ``mask_predict`` (kind cmlm): Mask-Predict over the top-``length_beam`` lengths: iteration 0 predicts every
  position; after iteration t (of T) the n = floor(L (T - 1 - t) / T) least confident tokens are re-masked and
  predicted again (only masked positions change, with their probabilities); T = 1 is the plain parallel argmax;
* ``ctc`` (kind ctc): one argmax pass over the upsampled source, repeats merged, blanks dropped.

A decoding is ``decode(model, source, source_mask, memory, *, iterations, length_beam, rescorer, rounds)`` ->
token ids per sentence (``rounds``: None, or a list to which it appends the decoder rounds each sentence used);
those over length candidates share :func:`decode_length_candidates`. The edit-based decodings live in their own
modules (:mod:`.levenshtein`, :mod:`.insertion`), imported at the end of this one so they register.

Shapes: source (B, S) ids right-padded, source_mask (B, S); results are lists of token ids per sentence
(no BOS / EOS / padding).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..errors import GenerationError
from ..models.nat import NonAutoregressiveTransformer
from ..models.nat_kinds import NAT_KINDS
from ..models.nat_kinds.ctc import ctc_collapse
from .parallel import NAT_DECODINGS, NATDecoding, ban, record_rounds  # noqa: F401 (importable from here too)

# (model, source, source_mask, memory, lengths, scored) -> (tokens (N, T), log-probabilities (N, T) or None when
# not scored, real-position mask (N, T)) for N rows of length candidates
CandidateFill = Callable[[NonAutoregressiveTransformer, Tensor, Tensor, Tensor, Tensor, bool],
                         tuple[Tensor, Tensor | None, Tensor]]


def remask(log_probs: Tensor, real: Tensor, lengths: Tensor, iteration: int, iterations: int) -> Tensor:
    """After ``iteration`` (0-based) of ``iterations``: (N, T) bool, True at the n = floor(L (T' - 1 - t) / T')
    real positions of lowest ``log_probs`` in each row (T' = iterations, L = the row's length)."""
    N, T = log_probs.shape
    counts = (lengths * (iterations - 1 - iteration)) // iterations  # (N,)
    order = log_probs.masked_fill(~real, float("inf")).argsort(dim=1, stable=True)  # ascending confidence
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(T, device=order.device).expand(N, T))
    return (rank < counts[:, None]) & real


def mask_predict(model: NonAutoregressiveTransformer, source: Tensor, source_mask: Tensor, memory: Tensor,
                 lengths: Tensor, iterations: int) -> tuple[Tensor, Tensor, Tensor]:
    """Mask-Predict for N = B * l rows (sources, masks and memory already repeated per length candidate) of
    ``lengths`` (N,) -> (tokens (N, T), their log-probabilities (N, T), real-position mask (N, T))."""
    c = model.config
    N, T = lengths.shape[0], int(lengths.max())
    real = torch.arange(T, device=lengths.device)[None] < lengths[:, None]
    tokens = torch.full((N, T), c.mask_id, dtype=torch.long, device=lengths.device).masked_fill(~real, c.pad_id)
    log_probs = torch.zeros(N, T, device=lengths.device)
    masked = real.clone()
    memory_kv = model.memory_kv(memory) if iterations > 1 else None  # computed once for every iteration
    for t in range(iterations):
        inputs, decoder_mask = model.decoder_inputs(source, source_mask, tokens=tokens)
        hidden = model.decode_hidden(inputs, decoder_mask, memory, source_mask, memory_kv)  # (N, T, C)
        where = masked.nonzero(as_tuple=True)  # the output layer only at the masked positions (all at t = 0)
        logits = ban(model.lm_head(hidden[where]).float(), c.banned_ids)  # (M, V)
        best_lp, best = F.log_softmax(logits, dim=-1).max(dim=-1)  # (M,)
        tokens = tokens.index_put(where, best)
        log_probs = log_probs.index_put(where, best_lp)
        if t == iterations - 1:
            break
        masked = remask(log_probs, real, lengths, t, iterations)
        tokens = tokens.masked_fill(masked, c.mask_id)
    return tokens, log_probs, real


def best_candidates(scores: Tensor) -> Tensor:
    """(B, l) candidate scores -> (B,) index of the highest-scoring candidate of each sentence (the first on
    ties)."""
    return scores.argmax(dim=1)


@torch.no_grad()
def rescore(rescorer: nn.Module, source: Tensor, source_mask: Tensor, tokens: Tensor, real: Tensor) -> Tensor:
    """Average log-probability of each candidate (N, T) under an autoregressive encoder-decoder ``rescorer``
    (teacher forcing: BOS + tokens -> tokens + EOS) -> (N,)."""
    c = rescorer.config
    N = tokens.shape[0]
    lengths = real.sum(1)
    body = tokens.masked_fill(~real, c.pad_id)
    bos = torch.full((N, 1), c.bos_id, dtype=torch.long, device=tokens.device)
    pad = torch.full((N, 1), c.pad_id, dtype=torch.long, device=tokens.device)
    target_in = torch.cat([bos, body], dim=1)
    target_out = torch.cat([body, pad], dim=1).scatter(1, lengths[:, None], c.eos_id)
    logp = F.log_softmax(rescorer(source, target_in, source_mask).float(), dim=-1)
    token_lp = logp.gather(-1, target_out[..., None]).squeeze(-1)  # (N, T + 1)
    keep = torch.arange(target_out.shape[1], device=tokens.device)[None] <= lengths[:, None]
    return (token_lp * keep).sum(1) / keep.sum(1)


@torch.no_grad()
def nat_decode(model: NonAutoregressiveTransformer, source: Tensor, source_mask: Tensor, *, iterations: int = 10,
               length_beam: int = 1, rescorer: nn.Module | None = None,
               rounds: list[int] | None = None, lengths: Tensor | None = None) -> list[list[int]]:
    """Translate a batch of sources in parallel with the decoding of the model's kind; see the module docstring.
    ``iterations`` applies to mask_predict (cmlm), ``length_beam`` to decodings over length candidates (nat,
    cmlm), ``rescorer`` (an autoregressive model on the same vocabulary) picks among the length candidates instead
    of their own average log-probability. ``rounds``, when given, gets the decoder rounds each sentence used
    appended (in batch order; :func:`record_rounds`): 1 for one pass, the iterations of Mask-Predict, the
    rounds until nothing changed for the edit-based decodings. ``lengths`` (B,), for kinds with a length predictor
    (nat, cmlm): decode at these target lengths instead of the predicted ones (the oracle lengths of a diagnosis:
    the references' lengths separate length prediction from token prediction); ``length_beam`` then does not
    apply."""
    if iterations < 1:
        raise GenerationError(f"iterations must be >= 1, got {iterations}")
    if length_beam < 1:
        raise GenerationError(f"length_beam must be >= 1, got {length_beam}")
    kind = NAT_KINDS.get(model.config.kind)
    extra = {}
    if lengths is not None:
        if not kind.has_length_head:
            raise GenerationError(f"kind {model.config.kind} predicts no target length: oracle lengths apply to "
                                  "kinds nat and cmlm")
        if lengths.shape != (source.shape[0],) or int(lengths.min()) < 1:
            raise GenerationError(f"lengths must be one target length >= 1 per sentence ({source.shape[0]}), got "
                                  f"shape {tuple(lengths.shape)}")
        extra = {"lengths": lengths.to(source.device)}
    memory = model.encode(source, source_mask)
    return NAT_DECODINGS.get(kind.decoding)(model, source, source_mask, memory, iterations=iterations,
                                            length_beam=length_beam, rescorer=rescorer, rounds=rounds, **extra)


def decode_length_candidates(model: NonAutoregressiveTransformer, source: Tensor, source_mask: Tensor,
                             memory: Tensor, length_beam: int, rescorer: nn.Module | None,
                             fill: CandidateFill, lengths: Tensor | None = None) -> list[list[int]]:
    """The top-``length_beam`` lengths of the length predictor, each filled by ``fill``; the candidate with the best
    average log-probability (or the best under ``rescorer``) kept; one candidate is kept unscored. Given
    ``lengths`` (B,), those alone (one candidate each)."""
    c = model.config
    B = source.shape[0]
    beam = 1 if lengths is not None else min(length_beam, c.num_length_classes)
    if lengths is None:
        classes = model.length_logits(memory, source_mask).float().topk(beam, dim=-1).indices  # (B, l)
        lengths = model.lengths_of(classes, source_mask.sum(1)).reshape(-1)  # (B * l,)
    src, src_mask, mem = (t.repeat_interleave(beam, dim=0) for t in (source, source_mask, memory))
    tokens, log_probs, real = fill(model, src, src_mask, mem, lengths, beam > 1)
    if beam == 1:  # one candidate: nothing to score
        return [tokens[b, :int(real[b].sum())].tolist() for b in range(B)]
    if rescorer is not None:
        scores = rescore(rescorer, src, src_mask, tokens, real)
    else:
        scores = (log_probs * real).sum(1) / real.sum(1)
    choice = best_candidates(scores.view(B, beam))
    rows = torch.arange(B, device=source.device) * beam + choice
    return [tokens[r, :int(real[r].sum())].tolist() for r in rows.tolist()]


def argmax_fill(model: NonAutoregressiveTransformer, source: Tensor, source_mask: Tensor, memory: Tensor,
                lengths: Tensor, scored: bool) -> tuple[Tensor, Tensor | None, Tensor]:
    """One parallel pass for rows of ``lengths`` (N,): the argmax tokens (N, T), their log-probabilities (when
    ``scored``) and the real positions."""
    inputs, decoder_mask = model.decoder_inputs(source, source_mask, lengths)
    logits = ban(model.decode_parallel(inputs, decoder_mask, memory, source_mask).float(), model.config.banned_ids)
    real = decoder_mask.bool()
    if not scored:  # the argmax of the logits is the answer
        return logits.argmax(dim=-1), None, real
    log_probs, tokens = F.log_softmax(logits, dim=-1).max(dim=-1)
    return tokens, log_probs, real


@NAT_DECODINGS.register("argmax")
def argmax_decoding(model: NonAutoregressiveTransformer, source: Tensor, source_mask: Tensor, memory: Tensor, *,
                    iterations: int, length_beam: int, rescorer: nn.Module | None,
                    rounds: list[int] | None = None, lengths: Tensor | None = None) -> list[list[int]]:
    """One argmax pass per length candidate (``iterations`` does not apply); ``lengths``: the given ones alone."""
    record_rounds(rounds, source.shape[0], 1)
    return decode_length_candidates(model, source, source_mask, memory, length_beam, rescorer, argmax_fill,
                                    lengths)


@NAT_DECODINGS.register("mask_predict")
def mask_predict_decoding(model: NonAutoregressiveTransformer, source: Tensor, source_mask: Tensor, memory: Tensor,
                          *, iterations: int, length_beam: int, rescorer: nn.Module | None,
                          rounds: list[int] | None = None, lengths: Tensor | None = None) -> list[list[int]]:
    """Mask-Predict (:func:`mask_predict`, ``iterations``) per length candidate; ``lengths``: the given ones
    alone."""
    record_rounds(rounds, source.shape[0], iterations)

    def fill(model: NonAutoregressiveTransformer, source: Tensor, source_mask: Tensor, memory: Tensor,
             lengths: Tensor, scored: bool) -> tuple[Tensor, Tensor, Tensor]:
        return mask_predict(model, source, source_mask, memory, lengths, iterations)

    return decode_length_candidates(model, source, source_mask, memory, length_beam, rescorer, fill, lengths)


@NAT_DECODINGS.register("ctc")
def ctc_decoding(model: NonAutoregressiveTransformer, source: Tensor, source_mask: Tensor, memory: Tensor, *,
                 iterations: int, length_beam: int, rescorer: nn.Module | None,
                 rounds: list[int] | None = None) -> list[list[int]]:
    """One argmax pass over the decoder inputs of the source alone, repeats merged, blanks dropped (the options
    do not apply)."""
    record_rounds(rounds, source.shape[0], 1)
    c = model.config
    inputs, decoder_mask = model.decoder_inputs(source, source_mask)
    logits = ban(model.decode_parallel(inputs, decoder_mask, memory, source_mask).float(), c.banned_ids)
    best = logits.argmax(-1)
    lengths = decoder_mask.sum(1).tolist()
    return [ctc_collapse(best[b, :lengths[b]].tolist(), c.blank_id) for b in range(source.shape[0])]


from . import insertion, levenshtein  # noqa: E402, F401  (their decodings register themselves in NAT_DECODINGS)

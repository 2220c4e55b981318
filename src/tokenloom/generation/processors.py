"""Logits processors: small callables ``(input_ids (B, S), scores (B, V)) -> scores (B, V)``.

``input_ids`` is the sequence so far (prompt and generated tokens), ``scores`` the next-token logits.
A :class:`LogitsProcessorList` applies them in order; :func:`create_processors` builds the list a
:class:`GenerationConfig` asks for, leaving out the ones that would change nothing. Order: logit bias,
presence/frequency penalties, repetition penalty (these change the argmax, so greedy decoding keeps them), then,
when sampling, temperature, top-k, top-p (as in Hugging Face transformers).

:class:`PresenceFrequencyProcessor` is stateful: it counts only the generated tokens, taking the length of
``input_ids`` at its first call as the prompt's, so it needs a fresh list per generation whose first call comes
right after the prefill (as ``create_processors`` per ``generate`` call, per served request, gives).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from ..errors import GenerationError
from .config import MAX_FLOAT32, MIN_TEMPERATURE, PENALTY_LIMIT, GenerationConfig


class LogitsProcessor(Protocol):
    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor: ...


class LogitsProcessorList(list):
    """Processors applied in order: ``scores = p(input_ids, scores)`` for each."""

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


class TemperatureProcessor:
    """``scores / temperature``: below 1 sharpens the distribution, above 1 flattens it."""

    def __init__(self, temperature: float) -> None:
        if not MIN_TEMPERATURE <= temperature <= MAX_FLOAT32:  # a normal float32: 0 or inf there would make NaN
            raise ValueError(f"temperature must be in [{MIN_TEMPERATURE:.3g}, {MAX_FLOAT32:.3g}], got {temperature}")
        self.temperature = temperature

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        # the largest score subtracted first (softmax and the filters after it are shift-invariant): every score
        # becomes <= 0, so dividing by any temperature down to the smallest normal float overflows only to -inf
        top = scores.amax(dim=-1, keepdim=True)
        return (scores - top.masked_fill(~torch.isfinite(top), 0.0)) / self.temperature


class TopKProcessor:
    """Keep the ``top_k`` highest scores (and any tied with the k-th), set the rest to -inf."""

    def __init__(self, top_k: int) -> None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.top_k = top_k

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        kth = torch.topk(scores, min(self.top_k, scores.shape[-1]), dim=-1).values[..., -1:]  # (B, 1)
        return scores.masked_fill(scores < kth, float("-inf"))


class TopPProcessor:
    """Nucleus filtering: keep the smallest set of most likely tokens whose probabilities sum to at least
    ``top_p`` (always at least the top token), set the rest to -inf. Ties are ranked by token id (lower
    first); ``top_p = 1`` keeps everything."""

    def __init__(self, top_p: float) -> None:
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.top_p = top_p

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.top_p >= 1:
            return scores
        ranked, order = scores.sort(dim=-1, descending=True, stable=True)  # (B, V)
        probs = ranked.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability of the better-ranked tokens
        drop = before >= self.top_p  # the better-ranked tokens already reach p
        drop[..., 0] = False  # never the top token, even for a p that rounds to 0 in the scores' dtype
        return scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


class LogitBiasProcessor:
    """``scores[:, t] += bias[t]`` for each token id ``t`` of ``logit_bias`` (OpenAI's ``logit_bias``): a bias
    of -100 all but bans a token, +100 all but forces it. A banned (-inf) score stays banned."""

    def __init__(self, logit_bias: dict[int, float]) -> None:
        self.ids = list(logit_bias)
        self.values = [float(v) for v in logit_bias.values()]
        self._dense: Tensor | None = None  # (V,) the bias of every id, built at the first call

    def _bias(self, scores: Tensor) -> Tensor:
        V = scores.shape[-1]
        dense = self._dense
        if dense is None or dense.shape[0] != V or dense.device != scores.device or dense.dtype != scores.dtype:
            outside = [t for t in self.ids if t >= V]
            if outside:
                raise GenerationError(f"logit_bias names token id {outside[0]}, outside the model's vocabulary of "
                                      f"{V} ids")
            dense = torch.zeros(V, dtype=scores.dtype, device=scores.device)
            dense[torch.tensor(self.ids, dtype=torch.long, device=scores.device)] = torch.tensor(
                self.values, dtype=scores.dtype, device=scores.device)
            self._dense = dense
        return dense

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        return scores + self._bias(scores)


class PresenceFrequencyProcessor:
    """OpenAI's penalties over the generated tokens: ``scores[:, t] -= presence * (count[t] > 0) + frequency *
    count[t]``, ``count[t]`` the times token ``t`` appears in the row after the prompt.

    Stateful: the length of ``input_ids`` at the first call is taken as the prompt length (the first call comes
    right after the prefill, before any token is generated), and only the tokens after it are counted. Use one
    instance per generation (:func:`create_processors` makes a fresh one). Histories padded with stand-in tokens
    (speculative verification) would count those: :class:`GenerationConfig` keeps these penalties away from
    speculative decoding."""

    def __init__(self, presence: float = 0.0, frequency: float = 0.0) -> None:
        for name, value in (("presence", presence), ("frequency", frequency)):
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ValueError(f"{name} penalty must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {value}")
        self.presence, self.frequency = presence, frequency
        self.prompt_len: int | None = None  # set at the first call

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.prompt_len is None:
            self.prompt_len = input_ids.shape[1]
        generated = input_ids[:, self.prompt_len:]  # (B, S - prompt)
        if generated.shape[1] == 0:
            return scores
        V = scores.shape[-1]
        inside = (generated >= 0) & (generated < V)  # a pad id written after a finished row may be anything
        counts = torch.zeros_like(scores).scatter_add_(1, generated.clamp(0, V - 1), inside.to(scores.dtype))  # (B, V)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class RepetitionPenaltyProcessor:
    """CTRL's penalty (Keskar et al. 2019) as in Hugging Face: for every token already in ``input_ids``,
    a negative score is multiplied by ``penalty`` and a positive one divided by it."""

    def __init__(self, penalty: float) -> None:
        if not MIN_TEMPERATURE <= penalty <= MAX_FLOAT32:  # a normal float32: 0 or inf there would make NaN
            raise ValueError(f"repetition penalty must be in [{MIN_TEMPERATURE:.3g}, {MAX_FLOAT32:.3g}], got {penalty}")
        self.penalty = penalty

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        seen = scores.gather(-1, input_ids)  # (B, S)
        penalized = torch.where(seen < 0, seen * self.penalty, seen / self.penalty)
        # a huge score divided by a penalty < 1 (or multiplied by one > 1) overflows: it stays at the dtype's largest
        # finite value instead (+inf would make softmax NaN); a banned token (-inf) stays banned
        finfo = torch.finfo(scores.dtype)
        penalized = torch.where(torch.isneginf(seen), seen, penalized.clamp(finfo.min, finfo.max))
        return scores.scatter(-1, input_ids, penalized)


def create_processors(config: GenerationConfig) -> LogitsProcessorList:
    """The processors ``config`` asks for, in order, without no-ops (a fresh list each call: one holds state).
    Greedy decoding keeps the logit bias and the penalties: temperature, top-k and top-p never change the
    argmax."""
    processors = LogitsProcessorList()
    if config.logit_bias:
        processors.append(LogitBiasProcessor(config.logit_bias))
    if config.presence_penalty or config.frequency_penalty:
        processors.append(PresenceFrequencyProcessor(config.presence_penalty, config.frequency_penalty))
    if config.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyProcessor(config.repetition_penalty))
    if config.greedy:
        return processors
    if config.temperature != 1.0:
        processors.append(TemperatureProcessor(config.temperature))
    if config.top_k is not None:
        processors.append(TopKProcessor(config.top_k))
    if config.top_p is not None and config.top_p < 1.0:
        processors.append(TopPProcessor(config.top_p))
    return processors

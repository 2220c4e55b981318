"""What a caller hands the serving engine (:class:`Request`) and what the engine fills in for it, the log-probability
entries of its tokens (:data:`TokenLogprob`, :func:`token_entries`), and :class:`QueueFull`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..generation.config import GenerationConfig

TokenLogprob = tuple[int, float, list[tuple[int, float]]]  # (token id, its log-probability, the k likeliest
#   (id, log-probability) pairs): log_softmax of the model's float32 logits (the vocabulary limited), before any
#   sampling setting (temperature, penalties, logit_bias) changes them


class QueueFull(Exception):
    """The engine's queue of waiting requests is full (HTTP 429)."""


@dataclass
class Request:
    """One generation: prompt ids, settings, and the sink for its events."""

    prompt_ids: list[int]
    config: GenerationConfig
    emit: Callable[[tuple], None]
    deadline: float | None = None  # time.monotonic() after which it ends with a timeout error
    stop_strings: list[str] = field(default_factory=list)
    speculative: bool = True  # drafts when the engine has a drafter (False: plain decoding)
    logprobs: int | None = None  # None: none; k >= 0: each new token's log-probability and its k likeliest
    #   alternatives (token_logprobs)
    echo: bool = False  # also the prompt tokens' log-probabilities (prompt_logprobs): no cached prefix is read
    score_only: bool = False  # prefill only (echo with max_tokens 0): ends "length" with no new token
    constraint: object = None  # a stateful logits processor keeping the text in a grammar (response_format:
    #   tokenloom.generation.constraints.Constraint), after the request's own processors; the request ends ("stop")
    #   once the text is complete and nothing may follow (its ``done``); no drafts for it
    siblings: list[Request] = field(default_factory=list)  # the other samples (n > 1) of the same prompt and
    #   settings but their seeds: the engine prefills the prompt once and forks its blocks; submit only this one
    cancelled: bool = False
    # filled in by the engine
    new_ids: list[int] = field(default_factory=list)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new id (with ``logprobs``)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # one per prompt id, the first None
    #   (with ``echo``)
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    sent_chars: int = 0  # characters of the new text already emitted
    submitted: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finish_reason: str | None = None
    drafted: int = 0  # draft tokens verified for it
    accepted: int = 0  # of those, the ones kept

    def cancel(self) -> None:
        """Called from any thread: the engine drops the request before its next step."""
        self.cancelled = True


def token_entries(scores: Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """(n, V) float32 scores and the n tokens chosen after them -> their :data:`TokenLogprob` entries."""
    logp = torch.log_softmax(scores, -1)
    chosen = logp.gather(1, torch.tensor(tokens, device=scores.device)[:, None])[:, 0].tolist()
    if not k:
        return [(t, c, []) for t, c in zip(tokens, chosen, strict=True)]
    values, ids = logp.topk(min(k, logp.shape[-1]), -1)
    return [(t, c, list(zip(i, v, strict=True)))
            for t, c, i, v in zip(tokens, chosen, ids.tolist(), values.tolist(), strict=True)]

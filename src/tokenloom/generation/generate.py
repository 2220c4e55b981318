"""Autoregressive decoding (greedy and sampling) with a KV cache: :func:`generate` and :func:`stream`.

Shape legend: B batch, T prompt length (left padding included), n new tokens, V vocabulary size.

The model protocol (:class:`tokenloom.models.GPT` follows it)::

    logits = model(ids (B, T), positions=(B, T), attention_mask=(B, S) | None, cache=cache)  # (B, T, V)
    cache = model.create_cache(batch_size, max_len)     # the model advances cache.length
    model.config.max_seq_len, model.config.vocab_size

* Prompts of different lengths are left-padded and marked by ``attention_mask`` (1 = token, 0 = padding);
  positions count real tokens only, so a row decodes exactly as it would alone.
* The prompt (padding included) plus ``max_new_tokens`` must fit in ``max_seq_len``, or
  :class:`GenerationError` says by how much it does not, except for a sliding-window model (``attention_window``;
  a rolling cache of the window) or a Transformer-XL one (``memory_len``) whose position scheme extrapolates:
  those decode past it.
* A row stops after its EOS token or once its new text contains a stop string (decoded with ``tokenizer``
  over a tail window of the new tokens); the tokens that completed the stop string stay in the output,
  and every later position of that row holds ``pad_token_id``. Decoding ends when all rows have
  stopped or after ``max_new_tokens`` steps.
* Stopped rows leave the batch once they are an eighth of it (``cache.select(rows)``, where the model's
  cache offers it): the rows still decoding run on a smaller batch. The results are the same.
* ``config.compile``: after the eager prefill, each one-token step runs compiled over a static cache
  (:mod:`tokenloom.generation.compiled`; rows that stop then stay in the batch); the tokens are the same.
* ``config.exit_threshold``: depth-adaptive early exit (:mod:`tokenloom.generation.early_exit`): each position
  leaves the layer stack once its exit head is confident enough; ``exit_heads`` are the heads (default: shared, the
  model's own final norm and output layer), ``exit_tally`` (an :class:`~.early_exit.ExitTally`) adds up the layers
  the one-token steps ran.
* ``draft=`` (a draft model of the same protocol and vocabulary, or a drafter) or ``config.prompt_lookup``:
  speculative decoding (:mod:`tokenloom.generation.speculative`): the drafter proposes ``config.num_draft_tokens``
  tokens, the model verifies them in one pass and keeps the ones it agrees with; ``draft_tally`` adds up the passes.
* :func:`generate` is :func:`stream` run to the end; both run under ``torch.inference_mode()`` with the
  model in eval mode (its previous mode is restored afterwards).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from ..errors import GenerationError
from ..nn.exits import ExitHeads
from ..nn.modes import enter_eval, restore_training
from .choose import choose_next, limit_vocabulary, vocabulary_limit
from .compiled import StaticDecodeStep, StaticKVCache, static_cache_length, why_not_compiled
from .config import GenerationConfig
from .drafting import Drafter
from .early_exit import EarlyExit, ExitTally
from .processors import create_processors
from .requests import StopStrings, Tokenizer, check_prompt, check_sampling_request, prompt_rows
from .speculative import DraftTally, SpeculativeDecoding, create_drafter


def generate(model: nn.Module, input_ids: Tensor, config: GenerationConfig | None = None,
             attention_mask: Tensor | None = None, tokenizer: Tokenizer | None = None, *,
             exit_heads: ExitHeads | None = None, exit_tally: ExitTally | None = None,
             draft: nn.Module | Drafter | None = None, draft_tally: DraftTally | None = None) -> Tensor:
    """(B, T) prompt ids -> (B, T + n) prompt and new ids, n <= ``config.max_new_tokens`` (fewer when every
    row stops early); positions after a row stopped hold ``config.pad_token_id``. With ``config.num_beams``
    > 1 this is beam search's best hypothesis per row (:func:`tokenloom.generation.beam_search` gives the
    n best and their scores). With ``draft`` (a model, or a drafter such as
    :class:`~tokenloom.generation.drafting.PromptLookup`) or ``config.prompt_lookup``: speculative decoding
    (:mod:`tokenloom.generation.speculative`), the same tokens when greedy, the same distribution when sampling;
    ``draft_tally`` (a :class:`~tokenloom.generation.speculative.DraftTally`) adds up its passes and acceptance."""
    config = config or GenerationConfig()
    if config.num_beams > 1 and draft is None:
        if exit_heads is not None or exit_tally is not None or draft_tally is not None:
            raise GenerationError("exit_heads, exit_tally and draft_tally apply to early exit and speculative "
                                  "decoding, which beam search does not run")
        from .beam import beam_search

        return beam_search(model, input_ids, config, attention_mask, tokenizer).sequences[:, 0].contiguous()
    decoding = _create(model, input_ids, config, attention_mask, tokenizer, exit_heads, exit_tally, draft,
                       draft_tally)
    steps = sum(1 for _ in decoding)
    out = decoding.sequences[:, :decoding.prompt_len + steps]
    if decoding.padded:
        out[:, :decoding.prompt_len] = input_ids  # the padding positions held a stand-in while decoding
    return out


def stream(model: nn.Module, input_ids: Tensor, config: GenerationConfig | None = None,
           attention_mask: Tensor | None = None, tokenizer: Tokenizer | None = None, *,
           exit_heads: ExitHeads | None = None, exit_tally: ExitTally | None = None,
           draft: nn.Module | Drafter | None = None, draft_tally: DraftTally | None = None) -> Iterator[Tensor]:
    """Yield each step's new tokens, (B,) ids, as they are produced (a stopped row yields
    ``pad_token_id``; speculative decoding yields a column once every row has produced it). The arguments are
    checked here, before the first step."""
    return iter(_create(model, input_ids, config or GenerationConfig(), attention_mask, tokenizer, exit_heads,
                        exit_tally, draft, draft_tally))


def _create(model: nn.Module, input_ids: Tensor, config: GenerationConfig, attention_mask: Tensor | None,
            tokenizer: Tokenizer | None, exit_heads: ExitHeads | None, exit_tally: ExitTally | None,
            draft: nn.Module | Drafter | None, draft_tally: DraftTally | None) -> _Decoding | SpeculativeDecoding:
    """The decoding run a request asks for: speculative when it has a drafter, else plain."""
    drafter = create_drafter(draft, config)
    if drafter is None:
        if draft_tally is not None:
            raise GenerationError("draft_tally applies to speculative decoding: give draft= or set prompt_lookup")
        return _Decoding(model, input_ids, config, attention_mask, tokenizer, exit_heads, exit_tally)
    if exit_heads is not None or exit_tally is not None:
        raise GenerationError("exit_heads and exit_tally apply to early exit, which speculative decoding does not run")
    return SpeculativeDecoding(model, input_ids, config, attention_mask, tokenizer, drafter, draft_tally)


class _Decoding:
    """One decoding run: checks the request, preallocates the (B, T + n) output, iterates the steps."""

    def __init__(self, model: nn.Module, input_ids: Tensor, config: GenerationConfig,
                 attention_mask: Tensor | None, tokenizer: Tokenizer | None, exit_heads: ExitHeads | None = None,
                 exit_tally: ExitTally | None = None) -> None:
        self.model, self.config, self.tokenizer = model, config, tokenizer
        # what each step calls: the model, or the model under early exit (the protocol's call, cache and config)
        self.forward = model
        if config.exit_threshold is not None:
            self.forward = EarlyExit(model, config.exit_threshold, exit_heads, exit_tally)
        elif exit_heads is not None or exit_tally is not None:
            raise GenerationError("exit_heads and exit_tally apply to early exit: set exit_threshold")
        if config.num_beams > 1:
            raise GenerationError(f"num_beams={config.num_beams}: beam search cannot stream (its best hypothesis "
                                  "is known only at the end); use generate() or beam_search()")
        check_sampling_request(config, tokenizer)
        n = config.max_new_tokens
        mask = check_prompt(model, input_ids, attention_mask, n)
        B, T = input_ids.shape
        prompt, positions, full_mask, _ = prompt_rows(input_ids, mask, n)
        self.prompt_len, self.padded = T, mask is not None
        self.sequences = torch.empty(B, T + n, dtype=torch.long, device=input_ids.device)  # (B, T + n) output
        self.sequences[:, :T] = prompt
        if full_mask is not None:
            self.mask = full_mask  # (B, T + n)
        self.positions = positions
        # per-step views of the output, made once
        self.columns = self.sequences[:, T:].split(1, dim=1)  # n x (B, 1)
        self.yielded = self.sequences[:, T:].unbind(1)  # n x (B,)
        self.processors = create_processors(config)
        # a model whose vocabulary is padded past its tokenizer's (common in imports) never emits those ids
        self.vocab_limit = vocabulary_limit(tokenizer, getattr(getattr(model, "config", None), "vocab_size", None))
        self.generator = None
        if not config.greedy and config.seed is not None:
            self.generator = torch.Generator(device=input_ids.device).manual_seed(config.seed)

    def __iter__(self) -> Iterator[Tensor]:
        model, forward, config, sequences = self.model, self.forward, self.config, self.sequences
        B, T, n = sequences.shape[0], self.prompt_len, config.max_new_tokens
        processors, generator, greedy = self.processors, self.generator, config.greedy
        columns, yielded = self.columns, self.yielded
        full_mask = self.mask if self.padded else None
        eos, pad = config.eos_token_id, config.pad_token_id
        stops = StopStrings(config.stop_strings, self.tokenizer, B) if config.stop_strings else None
        track = eos is not None or stops is not None
        inference = torch.inference_mode()  # entered around each step, never across a yield
        switched = enter_eval(model)
        try:
            finished = torch.zeros(B, 1, dtype=torch.bool, device=sequences.device)  # rows that stopped
            static = None  # the compiled step (config.compile), None = eager steps
            with inference:
                if config.compile and (reason := why_not_compiled(model, length=T + n)) is not None:
                    warnings.warn(f"generate(compile=True): {reason}; decoding eagerly", stacklevel=2)
                elif config.compile:
                    M = static_cache_length(T + n, getattr(getattr(model, "config", None), "max_seq_len", None))
                    cache = StaticKVCache(model.create_cache(B, M, rolling=False))
                    key_mask = None
                    if full_mask is not None:  # (B, M): the prompt's padding is never attended
                        key_mask = torch.ones(B, M, dtype=torch.bool, device=sequences.device)
                        key_mask[:, :T + n] = full_mask.bool()
                    static = StaticDecodeStep(model, cache, key_mask)
                if static is None:
                    cache = model.create_cache(B, T + n)
            can_drop = track and callable(getattr(cache, "select", None)) and static is None
            rows = None  # the rows still decoding (their batch indices) once stopped rows were dropped; None: all
            tokens, positions = sequences[:, :T], self.positions  # the prompt, then (A, 1) per step
            mask = full_mask[:, :T] if full_mask is not None else None
            step_pos = positions[:, :T]
            for t in range(n):
                with inference:
                    logits = static(tokens, step_pos) if static is not None and t else None  # (B, 1, V) | None
                    if logits is None:
                        logits = forward(tokens, positions=step_pos, attention_mask=mask, cache=cache)  # (A, T|1, V)
                        if t and static is not None:  # its compilation failed: eager from now on
                            static = None
                    scores = limit_vocabulary(logits[:, -1], self.vocab_limit)  # (A, V) float32
                    history = None
                    if processors:
                        history = sequences[:, :T + t] if rows is None else sequences[:, :T + t][rows]
                    tokens = choose_next(scores, history, processors, greedy, generator)  # (A, 1)
                    if rows is not None:
                        columns[t].fill_(pad)
                        columns[t][rows] = tokens.masked_fill(finished[rows], pad)
                        if eos is not None:
                            finished[rows] |= tokens == eos
                    elif track:
                        columns[t].copy_(tokens.masked_fill(finished, pad))
                        if eos is not None:
                            finished |= tokens == eos
                    else:
                        columns[t].copy_(tokens)
                if stops is not None:
                    stops.update(yielded[t], finished)
                yield yielded[t]
                if track and bool(finished.all()):
                    return
                if can_drop:  # drop the stopped rows from the batch once they are an eighth of it
                    live = ~(finished if rows is None else finished[rows]).view(-1)  # (A,)
                    if 8 * (live.numel() - int(live.sum())) >= live.numel():
                        keep = live.nonzero().view(-1)
                        with inference:
                            cache.select(keep)
                            rows = keep if rows is None else rows[keep]
                            tokens, positions = tokens[keep], positions[keep]
                            full_mask = full_mask[keep] if full_mask is not None else None
                step_pos = positions[:, T + t:T + t + 1]
                if full_mask is not None:
                    mask = full_mask[:, :T + t + 1]
        finally:
            restore_training(switched)

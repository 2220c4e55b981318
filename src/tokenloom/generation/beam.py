"""Beam search over the decoding model protocol (see :mod:`tokenloom.generation.generate`): :func:`beam_search`.

Shape legend: B batch (prompts), N ``num_beams``, K = 2N candidates kept per prompt and step, T prompt length
(left padding included), n ``max_new_tokens``, V vocabulary size, R ``num_return_sequences``.

It uses only the protocol every decoder shares (GPT, and an encoder-decoder's decoder adapter)::

    logits = model(ids (B*N, t), positions=(B*N, t), attention_mask=(B*N, S) | None, cache=cache)
    cache = model.create_cache(B * N, T + n);  cache.reorder(index)   # row i <- old row index[i]
    cache.select(rows)   # optional: keep only these rows (fewer), row i <- old row rows[i]
    model.config.vocab_size, model.config.max_seq_len

Row ``b*N + k`` holds beam k of prompt b; ``cache.reorder`` only ever moves rows within a prompt's block of N.
An encoder-decoder's rows of one prompt therefore share one encoder memory, which needs no reordering
(tokenloom's :class:`~tokenloom.models.seq2seq.Seq2SeqDecoder` folds a prompt's N rows into the queries of
one cross-attention call instead of copying the memory N times).

The algorithm is Hugging Face transformers' (5.x) ``_beam_search``, vectorised the same way: one batch of
B*N rows through the model per step, one KV cache of B*N rows reordered by the chosen beams.

* Every prompt starts with one live beam (the others score -inf). Each step, each live beam's score (the
  sum of the log-probabilities of its generated tokens; ``log_softmax`` of the fp32 logits, after the bans
  below) is extended by every token, and the top K = 2N of the N*V candidates per prompt are kept.
* A candidate ending in ``eos_token_id`` among the best N of those K is a *finished hypothesis* scored
  ``sum_logprobs / generated_length ** length_penalty``, ``generated_length`` counting the new tokens
  including the EOS (the prompt and its padding do not count). A prompt keeps its N best finished
  hypotheses. At the last step (``max_new_tokens``) the best N candidates are finished the same way
  (length n, no EOS). Hugging Face uses exactly this formula (``cur_len + 1 - decoder_prompt_len``).
* The N best candidates that did not end in EOS are the live beams of the next step.
* A prompt is *done* (takes no new hypotheses) once all N slots hold finished hypotheses and
  ``early_stopping`` is True; or, for False, once the best live beam scored at its current length
  (``running_sum / t ** length_penalty``, t new tokens) is no better than the worst finished one (HF's
  heuristic, not exact when ``length_penalty`` > 0); or, for "never", once no live beam can beat it at any
  length (the bound uses ``max_new_tokens`` when ``length_penalty`` > 0: exact beam search). Decoding
  stops when every prompt is done or after ``max_new_tokens`` steps.
* A prompt that is done leaves the batch: its rows are dropped from the cache (``cache.select(rows)``,
  where the cache offers it), so the other prompts decode on fewer rows; Hugging Face keeps computing
  finished prompts until the whole batch is done. The results are the same either way.
* ``no_repeat_ngram_size`` = m bans every token that would complete an m-gram already in the row (prompt
  included, padding excluded; HF also matches n-grams through left padding). Banned tokens get
  log-probability -inf without renormalising the rest (as in HF). A model vocabulary padded past the
  tokenizer's (``tokenizer.vocab_size``) never emits the extra ids, as in :func:`generate`.
* ``do_sample`` must be off (no beam sampling); ``temperature``, ``top_k`` and ``top_p`` are ignored;
  ``repetition_penalty`` and ``stop_strings`` are refused (:class:`GenerationConfig` checks all this).

Differences from HF appear only in degenerate cases: where HF marks impossible candidates with -1e9
(and can then continue a beam past its EOS or finish a beam that was never started), candidates here
are -inf and never become hypotheses; when fewer than R hypotheses exist (a vocabulary smaller than the
beam, or bans), the missing ones have score -inf, length 0 and only ``pad_token_id`` after the prompt.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..errors import GenerationError
from ..nn.modes import enter_eval, restore_training
from .choose import vocabulary_limit
from .config import GenerationConfig
from .requests import Tokenizer, check_prompt, prompt_rows


class BeamOutput(NamedTuple):
    """The ``num_return_sequences`` best finished hypotheses per prompt, best first."""

    sequences: Tensor  # (B, R, T + L) long: the prompt as given, the new tokens, then pad_token_id
    scores: Tensor  # (B, R) float32: log_probs / lengths ** length_penalty (what the ranking uses)
    log_probs: Tensor  # (B, R) float32: sum of the new tokens' log-probabilities (EOS included)
    lengths: Tensor  # (B, R) long: new tokens (EOS included); L = the largest


def _check_memory(model: nn.Module, B: int, N: int, T: int, n: int) -> None:
    """Refuse, before allocating, a search whose key/value cache (B * N rows of T + n positions; twice: the cache
    and the buffer its reorder gathers into), prompt log-probabilities (B * N x T x vocabulary, float32) and
    hypotheses (live, finished, final: 3 x B x N x n token ids) cannot fit in memory (:mod:`tokenloom.budget`)."""
    from ..models.sizes import check_kv_cache

    weight = next(iter(model.parameters()), None)
    vocab = getattr(model.config, "vocab_size", 0)
    check_kv_cache(model.config, B * N, T + n, weight.element_size() if weight is not None else 4,
                   f"beam search with num_beams={N} over {B} prompt(s) of {T} tokens", copies=2,
                   extra=[(f"log-probabilities of the prompt ({B * N} x {T} x {vocab})", 4 * B * N * T * vocab),
                          (f"hypotheses (3 x {B * N} x {n} token ids)", 3 * 8 * B * N * n)])


def beam_search(model: nn.Module, input_ids: Tensor, config: GenerationConfig,
                attention_mask: Tensor | None = None, tokenizer: Tokenizer | None = None) -> BeamOutput:
    """(B, T) prompt ids (left-padded, with ``attention_mask``, when of different lengths) -> the
    ``config.num_return_sequences`` best hypotheses of a ``config.num_beams``-wide beam search per prompt,
    with their scores (module docstring: the exact rules, and how they match Hugging Face)."""
    mask = _check_request(model, input_ids, config, attention_mask)
    B, T = input_ids.shape
    N, n = config.num_beams, config.max_new_tokens
    _check_memory(model, B, N, T, n)
    prompt, positions, full_mask, real_len = prompt_rows(input_ids, mask, n, copies=N)
    bans = _NoRepeatNGram(config.no_repeat_ngram_size, prompt, real_len, N) if config.no_repeat_ngram_size else None
    vocab_limit = vocabulary_limit(tokenizer, model.config.vocab_size)
    search = _Search(B, N, n, model.config.vocab_size, config, input_ids.device)
    switched = enter_eval(model)
    try:
        with torch.inference_mode():
            cache = model.create_cache(B * N, T + n)
            can_drop = callable(getattr(cache, "select", None))
            tokens = prompt.repeat_interleave(N, dim=0)  # (BN, T), then (BN, 1) per step
            step_pos = positions[:, :T]
            step_mask = full_mask[:, :T] if full_mask is not None else None
            for t in range(n):
                logits = model(tokens, positions=step_pos, attention_mask=step_mask, cache=cache)[:, -1]  # (Ba*N, V)
                logp = F.log_softmax(logits.float(), dim=-1)
                if bans is not None:
                    logp.masked_fill_(bans(search.live_tokens[:, :, :t], logp.shape[-1]), float("-inf"))
                if vocab_limit is not None:
                    logp[:, vocab_limit:] = float("-inf")
                rows = search.step(t, logp)  # (Ba, N) cache row of each new beam
                if rows is None:
                    break
                if can_drop and bool(search.closed.any()):  # retire the closed prompts, keep decoding the others
                    keep, kept_rows = search.retire()
                    positions = positions[kept_rows]
                    full_mask = full_mask[kept_rows] if full_mask is not None else None
                    if bans is not None:
                        bans.select(kept_rows)
                    cache.select(rows[keep].view(-1))
                else:
                    cache.reorder(rows.view(-1))
                tokens = search.live_tokens[:, :, t].reshape(-1, 1)
                step_pos = positions[:, T + t:T + t + 1]
                if full_mask is not None:
                    step_mask = full_mask[:, :T + t + 1]
    finally:
        restore_training(switched)
    return search.output(input_ids, config.num_return_sequences)


class _Search:
    """The state of one beam search over B prompts (the rules: the module docstring). Live beams: scores (Ba, N),
    new tokens (Ba, N, n), of the Ba prompts still decoding (``active``: their indices in the batch); finished
    hypotheses ``done`` (Ba, N); a prompt that closes is retired into ``final`` (B, N) and dropped from the batch
    (:meth:`retire`, when the cache has ``select``)."""

    def __init__(self, B: int, N: int, n: int, vocab: int, config: GenerationConfig, device: torch.device) -> None:
        self.N, self.n, self.K = N, n, min(2 * N, N * vocab)
        self.eos, self.pad, self.lp = config.eos_token_id, config.pad_token_id, float(config.length_penalty)
        self.early_stopping = config.early_stopping
        self.live_scores = torch.full((B, N), float("-inf"), device=device)
        self.live_scores[:, 0] = 0.0
        self.live_tokens = torch.full((B, N, n), self.pad, dtype=torch.long, device=device)
        self.done = _Hypotheses.empty(B, N, n, self.pad, device)
        self.final = _Hypotheses.empty(B, N, n, self.pad, device)
        self.active = torch.arange(B, device=device)
        self.closed = torch.zeros(B, dtype=torch.bool, device=device)  # prompts that take no more hypotheses
        self.in_top_n = torch.arange(self.K, device=device) < N  # (K,) only the best N candidates may finish
        self.any_full = False  # some prompt holds N finished hypotheses

    def step(self, t: int, logp: Tensor) -> Tensor | None:
        """Extend the live beams by step ``t``'s log-probabilities (Ba*N, V): the (Ba, N) cache row of each new
        live beam, or None when the search is over (the last step, or every prompt closed)."""
        N, n, eos = self.N, self.n, self.eos
        Ba, V = self.live_scores.shape[0], logp.shape[-1]
        candidates = (self.live_scores.reshape(Ba * N, 1) + logp).view(Ba, N * V)
        top_sums, top_index = candidates.topk(self.K, dim=1)  # (Ba, K), best first
        parent, token = top_index // V, top_index % V  # (Ba, K) beam of the prompt, next token
        last = t == n - 1  # max_new_tokens: every candidate finishes
        ends = token == eos if eos is not None else None  # (Ba, K) candidates that end in EOS
        if last or (ends is not None and bool(ends[:, :N].any())):  # finishing among the best N: merge them
            cand_tokens = self.live_tokens.gather(1, parent[:, :, None].expand(-1, -1, n))  # (Ba, K, n)
            cand_tokens[:, :, t] = token
            new = self.in_top_n & ~self.closed[:, None] & (top_sums > float("-inf"))
            if not last:
                new &= ends
            new_scores = (top_sums / ((t + 1) ** self.lp)).masked_fill(~new, float("-inf"))
            self.done = self.done.merge(new_scores, top_sums, t + 1, cand_tokens)
            if last:
                return None
            self.any_full = bool((self.done.scores[:, -1] > float("-inf")).any())  # sorted: the last is the worst
            open_sums = top_sums.masked_fill(ends, float("-inf"))  # live beams: the N best that did not end
            chosen = open_sums.topk(N, dim=1).indices  # (Ba, N)
            self.live_scores = open_sums.gather(1, chosen)
            self.live_tokens = cand_tokens.gather(1, chosen[:, :, None].expand(-1, -1, n))
            beams = parent.gather(1, chosen)  # (Ba, N)
        else:  # none of the best N ended: they are the live beams
            self.live_scores, beams = top_sums[:, :N], parent[:, :N]
            self.live_tokens = self.live_tokens.gather(1, beams[:, :, None].expand(-1, -1, n))
            self.live_tokens[:, :, t] = token[:, :N]
        if self.any_full and self._close(t):
            return None
        return beams + torch.arange(Ba, device=beams.device)[:, None] * N

    def _close(self, t: int) -> bool:
        """Close the prompts whose N finished hypotheses the live beams cannot beat; whether all are closed."""
        full = self.done.scores[:, -1] > float("-inf")
        if self.early_stopping is True:
            self.closed |= full
        else:
            length = self.n if self.early_stopping == "never" and self.lp > 0 else t + 1
            self.closed |= full & (self.live_scores[:, 0] / (length ** self.lp) <= self.done.scores[:, -1])
        return bool(self.closed.all())

    def retire(self) -> tuple[Tensor, Tensor]:
        """Move the closed prompts' hypotheses into ``final`` and keep decoding the others: (the kept prompts'
        indices among the live ones, their beams' rows)."""
        N = self.N
        self.final.store(self.active[self.closed], self.done.take(self.closed))
        keep = (~self.closed).nonzero().view(-1)
        kept_rows = (keep[:, None] * N + torch.arange(N, device=keep.device)).view(-1)
        self.active, self.closed, self.done = self.active[keep], self.closed[keep], self.done.take(keep)
        self.live_scores, self.live_tokens = self.live_scores[keep], self.live_tokens[keep]
        return keep, kept_rows

    def output(self, input_ids: Tensor, R: int) -> BeamOutput:
        """The R best hypotheses of every prompt after the prompt ``input_ids`` (B, T) as given."""
        final = self.final
        final.store(self.active, self.done)
        empty = final.scores == float("-inf")  # slots no hypothesis reached (degenerate cases only)
        done_sums = final.sums.masked_fill(empty, float("-inf"))
        done_lengths = final.lengths.masked_fill(empty, 0)
        done_tokens = final.tokens.masked_fill(empty[:, :, None], self.pad)
        B, T = input_ids.shape
        lengths = done_lengths[:, :R]
        L = int(lengths.max())
        sequences = torch.cat((input_ids[:, None].expand(B, R, T), done_tokens[:, :R, :L]), dim=2)
        return BeamOutput(sequences=sequences, scores=final.scores[:, :R].clone(),  # clone: not an inference tensor
                          log_probs=done_sums[:, :R], lengths=lengths)


class _Hypotheses(NamedTuple):
    """Each prompt's N best finished hypotheses, best first: scores (P, N) (ranking), sums (P, N) (raw
    log-probabilities), lengths (P, N), tokens (P, N, n)."""

    scores: Tensor
    sums: Tensor
    lengths: Tensor
    tokens: Tensor

    @classmethod
    def empty(cls, P: int, N: int, n: int, pad: int, device: torch.device) -> _Hypotheses:
        inf = float("-inf")
        return cls(torch.full((P, N), inf, device=device), torch.full((P, N), inf, device=device),
                   torch.zeros((P, N), dtype=torch.long, device=device),
                   torch.full((P, N, n), pad, dtype=torch.long, device=device))

    def merge(self, scores: Tensor, sums: Tensor, length: int, tokens: Tensor) -> _Hypotheses:
        """Keep the N best of these and K new candidates: scores (P, K) (-inf: not a hypothesis), raw
        sums (P, K), one length, tokens (P, K, n)."""
        P, N = self.scores.shape
        merged = torch.cat((self.scores, scores), dim=1)  # (P, N + K)
        keep = merged.topk(N, dim=1).indices  # (P, N), best first
        lengths = torch.cat((self.lengths, self.lengths.new_full(scores.shape, length)), dim=1)
        return _Hypotheses(merged.gather(1, keep), torch.cat((self.sums, sums), dim=1).gather(1, keep),
                           lengths.gather(1, keep),
                           torch.cat((self.tokens, tokens), dim=1).gather(1, keep[:, :, None].expand(-1, -1,
                                                                                                    tokens.shape[2])))

    def take(self, index: Tensor) -> _Hypotheses:
        """The prompts ``index`` (indices or a bool mask)."""
        return _Hypotheses(*(x[index] for x in self))

    def store(self, prompts: Tensor, other: _Hypotheses) -> None:
        """Write ``other``'s rows into this one's rows ``prompts``."""
        for mine, theirs in zip(self, other, strict=True):
            mine[prompts] = theirs


class _NoRepeatNGram:
    """Bans, per beam, every token that would complete an m-gram already in its row (real tokens only)."""

    def __init__(self, size: int, prompt: Tensor, real_len: Tensor, num_beams: int) -> None:
        self.m, self.N = size, num_beams
        self.prompt = prompt.repeat_interleave(num_beams, dim=0)  # (BN, T)
        self.pad_len = (prompt.shape[1] - real_len).repeat_interleave(num_beams)  # (BN,) padding per row

    def select(self, rows: Tensor) -> None:
        """Keep only the beams ``rows`` (the prompts still decoding)."""
        self.prompt, self.pad_len = self.prompt[rows], self.pad_len[rows]

    def __call__(self, new_tokens: Tensor, vocab: int) -> Tensor:
        """(B, N, t) new tokens -> (BN, V) bool: banned next tokens."""
        m, prompt = self.m, self.prompt
        BN, T = prompt.shape
        t = new_tokens.shape[-1]
        banned = torch.zeros(BN, vocab, device=prompt.device)
        S = T + t
        if S < m:
            return banned.bool()
        rows = torch.cat((prompt, new_tokens.reshape(BN, t)), dim=1)  # (BN, S)
        grams = rows.unfold(1, m, 1)  # (BN, S - m + 1, m)
        starts = torch.arange(S - m + 1, device=rows.device)
        hit = starts[None] >= self.pad_len[:, None]  # (BN, W) n-grams of real tokens only
        if m > 1:
            tail = rows[:, S - m + 1:]  # (BN, m - 1) the row's last m - 1 tokens
            hit &= (grams[:, :, :-1] == tail[:, None]).all(-1)
            hit &= (S - m + 1 >= self.pad_len)[:, None]  # the tail itself holds no padding
        banned.scatter_add_(1, grams[:, :, -1], hit.float())
        return banned > 0


def _check_request(model: nn.Module, input_ids: Tensor, config: GenerationConfig,
                   attention_mask: Tensor | None) -> Tensor | None:
    """The checks of :func:`generate` plus beam search's own; returns the (B, T) mask or None (no padding)."""
    if not isinstance(config, GenerationConfig):
        raise GenerationError(f"config must be a GenerationConfig, got {type(config).__name__}")
    if not config.greedy:
        raise GenerationError(f"beam search needs do_sample=False (beam sampling is not supported), got "
                              f"do_sample={config.do_sample} with temperature={config.temperature}")
    if config.repetition_penalty != 1.0 or config.stop_strings or config.presence_penalty or \
            config.frequency_penalty or config.logit_bias:
        raise GenerationError("beam search takes no repetition_penalty, presence_penalty, frequency_penalty, "
                              "logit_bias or stop_strings")
    if not 1 <= config.num_return_sequences <= config.num_beams:
        raise GenerationError(f"num_return_sequences={config.num_return_sequences} must be in [1, "
                              f"num_beams={config.num_beams}]")
    return check_prompt(model, input_ids, attention_mask, config.max_new_tokens)

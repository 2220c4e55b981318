"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a cheap drafter proposes k tokens, the model checks
them all in one forward pass over ``[newest token, d_1 .. d_k]`` (k + 1 positions, with its KV cache) and keeps the
longest prefix it agrees with plus one token of its own: the correction at the first disagreement, or the bonus
token after k agreements. :func:`tokenloom.generation.generate` and ``stream`` run it when given ``draft=`` (a model
of the same protocol and vocabulary, or a :class:`~.drafting.Drafter` such as :class:`~.drafting.PromptLookup`) or
``config.prompt_lookup`` > 0; ``config.num_draft_tokens`` is k.

Shape legend: B batch, A rows still in the batch, T prompt length (left padding included), k draft tokens,
V vocabulary size.

**The rule.** p_i and q_i are the model's and the drafter's distributions after the request's logits processors
(temperature, top-k, top-p, repetition penalty; the penalty of position i sees the earlier drafts d_1 .. d_{i-1}
as plain decoding would). Greedy: d_i is kept while it is the model's argmax; the next token is the argmax after
the kept ones: the same tokens as plain greedy decoding. Sampling: d_i is kept with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection the next token is drawn from norm(max(0, p_i - q_i)), after k
acceptances from p_{k+1}: every token has the model's distribution (:func:`accept_sampled`). A drafter without
a distribution (prompt lookup) has q one-hot on its proposal: d is kept with probability p(d), else the next token
is drawn from p without d.

**Rows advance by different amounts.** After a verification row b drops its rejected tail, ``drop[b]`` positions;
the cache rolls back by ``min(drop)`` and a row that dropped more moves right by the difference, its left padding
growing (:meth:`~tokenloom.nn.kv_cache.KVCache.rewind`). Every row's text still ends at the cache's length: the batch
stays a left-padded batch, which every position scheme handles (positions count each row's real tokens, so a row
decodes as it would alone). Grown padding that every live row shares is trimmed away when the cache would overflow
(:meth:`~tokenloom.nn.kv_cache.KVCache.trim`), so the cache never needs more than plain decoding's T + n columns.
A model whose protocol takes no left-padded rows (an encoder-decoder's decoder: ``decoding_of`` is not
``causal_lm``) advances all its rows by the smallest number of tokens any live row got: still exact (a prefix of a
verified run is verified), fewer tokens per pass at batch > 1.

**Rows that stop** keep plain decoding's semantics: a round's tokens are cut at the row's EOS, its stop string and
``max_new_tokens``; later positions hold ``pad_token_id``; finished rows leave the batch once they are an eighth of
it. Caches that cannot drop positions (a rolling sliding-window cache, a Transformer-XL memory, a recurrent state),
compiled steps, early exit and beam search are refused with a one-line :class:`GenerationError`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import GenerationError
from ..models.registry import decoding_of
from ..nn.modes import enter_eval, restore_training
from .choose import limit_vocabulary, vocabulary_limit
from .config import GenerationConfig
from .drafting import Drafter, DraftRun, ModelDrafter, PromptLookup, create_rows, model_vocab
from .processors import create_processors
from .requests import StopStrings, Tokenizer, check_prompt, check_sampling_request, prompt_rows


@dataclass
class DraftTally:
    """What speculative decoding did, added up over the runs it is given to: ``rounds`` verification passes of the
    model, ``rows`` rows verified over them (each live row of each pass), ``drafted`` draft tokens verified,
    ``accepted`` those the model kept, ``emitted`` tokens produced."""

    rounds: int = 0
    rows: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (NaN before any draft)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def mean_accepted(self) -> float:
        """Drafts kept per row and pass (of up to k)."""
        return self.accepted / self.rows if self.rows else float("nan")

    @property
    def tokens_per_pass(self) -> float:
        """Tokens produced per row and pass of the model (1 for plain decoding)."""
        return self.emitted / self.rows if self.rows else float("nan")


def create_drafter(draft: nn.Module | Drafter | None, config: GenerationConfig) -> Drafter | None:
    """The drafter a request asks for: ``draft`` (a :class:`Drafter`, or a model wrapped in a
    :class:`~.drafting.ModelDrafter`), or a :class:`~.drafting.PromptLookup` of ``config.prompt_lookup``; None for
    plain decoding."""
    if draft is not None and config.prompt_lookup:
        raise GenerationError(f"two drafters: draft= and prompt_lookup={config.prompt_lookup}; give one")
    if config.prompt_lookup:
        return PromptLookup(config.prompt_lookup)
    if draft is None or isinstance(draft, Drafter):
        return draft
    return ModelDrafter(draft)


def accept_greedy(targets: Tensor, drafts: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """``targets`` (A, k + 1) the model's argmax after ``[newest, d_1 .. d_i]``, ``drafts`` (A, k), ``counts`` (A,)
    the drafts each row proposed -> (kept (A,) long, next (A,)): the drafts agreeing with the model, and its token
    after them."""
    k = drafts.shape[1]
    agree = (drafts == targets[:, :k]) & (torch.arange(k, device=drafts.device) < counts[:, None])  # (A, k)
    kept = agree.long().cumprod(1).sum(1)
    return kept, targets.gather(1, kept[:, None]).view(-1)


def accept_sampled(p: Tensor, drafts: Tensor, q: Tensor | None, counts: Tensor,
                   generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """The sampling rule: ``p`` (A, k + 1, V) the model's distributions after ``[newest, d_1 .. d_i]``, ``drafts``
    (A, k) drawn from ``q`` (A, k, V) (None: one-hot on the drafts), ``counts`` (A,) the drafts each row proposed
    -> (kept (A,) long, next (A,)). d_i is kept with probability min(1, p(d_i) / q(d_i)); the next token comes from
    norm(max(0, p - q)) at the first rejection, from p after the last draft."""
    A, k = drafts.shape
    rows = torch.arange(A, device=p.device)
    kept = torch.zeros(A, dtype=torch.long, device=p.device)
    if k:
        p_draft = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # (A, k)
        q_draft = q.gather(-1, drafts[..., None]).squeeze(-1) if q is not None else torch.ones_like(p_draft)
        u = torch.rand(A, k, generator=generator, device=p.device, dtype=p.dtype)
        agree = (u * q_draft < p_draft) & (torch.arange(k, device=p.device) < counts[:, None])  # u < p / q
        kept = agree.long().cumprod(1).sum(1)
    target = p[rows, kept]  # (A, V)
    residual = target
    if k:
        at = kept.clamp(max=k - 1)
        q_at = q[rows, at] if q is not None else \
            torch.zeros_like(target).scatter_(1, drafts[rows, at][:, None], 1.0)  # (A, V)
        rejected = (kept < counts)[:, None]
        residual = torch.where(rejected, (target - q_at).clamp(min=0), target)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target)  # (rounding: p == q)
    return kept, torch.multinomial(residual, 1, generator=generator).view(-1)


class SpeculativeDecoding:
    """One speculative decoding run (the module docstring): checks the request, preallocates the (B, T + n) output
    as plain decoding does, and iterates its columns (B,) as every row has produced them."""

    def __init__(self, model: nn.Module, input_ids: Tensor, config: GenerationConfig,
                 attention_mask: Tensor | None, tokenizer: Tokenizer | None, drafter: Drafter,
                 tally: DraftTally | None = None) -> None:
        conflict = config.speculative_conflict()
        if conflict is not None:
            raise GenerationError(conflict)
        check_sampling_request(config, tokenizer)
        n = config.max_new_tokens
        mask = check_prompt(model, input_ids, attention_mask, n)
        B, T = input_ids.shape
        prompt = prompt_rows(input_ids, mask, n)[0]
        self.model, self.config, self.drafter, self.tally = model, config, drafter, tally
        self.prompt, self.mask, self.prompt_len, self.padded = prompt, mask, T, mask is not None
        self.sequences = torch.empty(B, T + n, dtype=torch.long, device=input_ids.device)  # (B, T + n) output
        self.sequences[:, :T] = prompt
        self.sequences[:, T:] = prompt[:, :1]  # a stand-in until written, neutral for the repetition penalty
        self.columns = self.sequences[:, T:].unbind(1)  # n x (B,)
        self.processors = create_processors(config)
        self.vocab_limit = vocabulary_limit(tokenizer, model_vocab(model))
        generator = None
        if not config.greedy and config.seed is not None:
            generator = torch.Generator(device=input_ids.device).manual_seed(config.seed)
        self.generator = generator
        run = DraftRun(self.processors, config.greedy, generator, self.vocab_limit, T + n, n)
        self.rows = create_rows(model, run, B, input_ids.device, "the model")
        drafter.bind(model, run, prompt, mask)
        self.independent = decoding_of(model) == "causal_lm" and drafter.pads()
        self.stops = StopStrings(config.stop_strings, tokenizer, B) if config.stop_strings else None

    def __iter__(self) -> Iterator[Tensor]:
        inference = torch.inference_mode()  # entered around each round, never across a yield
        switched = enter_eval(self.model)
        try:
            with inference:
                self._start()
            yielded = 0
            while True:
                with inference:
                    self._round()
                    self._drop_finished()
                unfinished = [p for p, f in zip(self.produced, self.finished, strict=True) if not f]
                ready = min(unfinished) if unfinished else max(self.produced)
                for j in range(yielded, ready):
                    yield self.columns[j]
                yielded = ready
                if not unfinished:
                    return
        finally:
            restore_training(switched)
            self.drafter.finish()

    def _start(self) -> None:
        """Cache the prompt but its last column (the first round's newest token) and start the drafter."""
        B, T = self.prompt.shape
        self.rows.prefill(self.prompt[:, :T - 1], None if self.mask is None else self.mask[:, :T - 1])
        self.drafter.start(self.prompt, self.mask)
        device = self.prompt.device
        self.index = torch.arange(B, device=device)  # (A,) the batch rows still in the batch
        self.live = torch.ones(B, dtype=torch.bool, device=device)  # (A,) not finished
        self.last = self.prompt[:, -1]  # (A,) each row's newest token, not yet in the model's cache
        self.produced, self.finished = [0] * B, [False] * B  # per batch row

    def _round(self) -> None:
        """Draft, verify in one pass, keep each row's agreeing drafts and the model's next token, rewind."""
        config, rows, live, n = self.config, self.rows, self.live, self.config.max_new_tokens
        A, device = self.index.numel(), self.last.device
        self._base = None
        budget = torch.tensor([n - self.produced[b] for b in self.index.tolist()], device=device)  # (A,)
        k = max(0, min(config.num_draft_tokens, int(budget[live].max()) - 1))
        k = rows.room(k + 1, live) - 1  # also for a plain step: the cache may have to drop common padding first
        draft = self.drafter.propose(self.last, k, self._history, live) if k > 0 else None
        counts = torch.zeros(A, dtype=torch.long, device=device)
        if draft is not None:
            counts = torch.minimum(draft.counts, budget - 1).masked_fill_(~live, 0)
        kr = int(counts.max())
        drafts = draft.tokens[:, :kr] if draft is not None else self.last[:, None][:, :0]  # (A, kr)
        logits = rows.feed(torch.cat((self.last[:, None], drafts), 1))  # (A, kr + 1, V)
        scores = limit_vocabulary(logits.reshape(A * (kr + 1), -1), self.vocab_limit)
        if self.processors:
            scores = self.processors(self._verify_history(drafts), scores)
        scores = scores.view(A, kr + 1, -1)
        if config.greedy:
            kept, nxt = accept_greedy(scores.argmax(-1), drafts, counts)
        else:
            q = draft.q[:, :kr] if draft is not None and draft.q is not None else None
            kept, nxt = accept_sampled(scores.softmax(-1), drafts, q, counts, self.generator)
        tokens = torch.cat((drafts, nxt[:, None]), 1).scatter_(1, kept[:, None], nxt[:, None])  # (A, kr + 1)
        if self.tally is not None:
            self.tally.rounds += 1
            self.tally.rows += int(live.sum())
            self.tally.drafted += int(counts.sum())
            self.tally.accepted += int(kept[live].sum())
        if not self.independent:  # every row advances by the fewest tokens a live row got
            kept = kept.clamp(max=int(kept[live].min()))
            nxt = tokens.gather(1, kept[:, None]).view(-1)
        emitted = self._emit(tokens, kept)
        if bool(self.live.any()):
            kept = torch.where(self.live, kept, kept[self.live].max())  # finished rows: no shifts for the others
            rows.rewind(kr - kept)
            if draft is not None:
                self.drafter.update(kept, emitted)
        self.last = nxt

    def _emit(self, tokens: Tensor, kept: Tensor) -> list[list[int]]:
        """Write each live row's kept drafts and next token, cut at its EOS, stop string and ``max_new_tokens``;
        mark the rows that stop. -> each row's new tokens."""
        T, n, eos, pad = self.prompt_len, self.config.max_new_tokens, self.config.eos_token_id, self.config.pad_token_id
        emitted: list[list[int]] = []
        live = self.live.tolist()
        for a, (b, row, m) in enumerate(zip(self.index.tolist(), tokens.tolist(), kept.tolist(), strict=True)):
            new = row[:m + 1] if live[a] else []
            for j, token in enumerate(new):
                if token == eos or (self.stops is not None and self.stops.append(b, token)):
                    new = new[:j + 1]
                    self.finished[b] = True
                    break
            start = T + self.produced[b]
            if new:
                self.sequences[b, start:start + len(new)] = torch.tensor(new, device=self.sequences.device)
            self.produced[b] += len(new)
            if self.produced[b] == n:
                self.finished[b] = True
            if live[a] and self.finished[b]:
                self.sequences[b, T + self.produced[b]:] = pad
                live[a] = False
            emitted.append(new)
        if self.tally is not None:
            self.tally.emitted += sum(len(new) for new in emitted)
        self.live = torch.tensor(live, dtype=torch.bool, device=self.live.device)
        return emitted

    def _drop_finished(self) -> None:
        """Finished rows leave the batch once they are an eighth of it (the model's and the drafter's caches)."""
        A, live = self.live.numel(), self.live
        dead = A - int(live.sum())
        if not dead or dead == A or 8 * dead < A:
            return
        keep = live.nonzero().view(-1)
        self.rows.select(keep)
        self.drafter.select(keep)
        self.index, self.live, self.last = self.index[keep], live[keep], self.last[keep]

    def _history(self, drafts: Tensor) -> Tensor:
        """What the processors see after ``drafts`` (A, j): each row's tokens so far (stand-ins after them, and for
        the finished rows), then the drafts; (A, W + j)."""
        if self._base is None:
            W = self.prompt_len + max(self.produced[b] for b in self.index.tolist())
            base = self.sequences.index_select(0, self.index)[:, :W]  # (A, W)
            if not bool(self.live.all()):
                base = torch.where(self.live[:, None], base, base[:, :1])
            self._base = base
        return torch.cat((self._base, drafts), 1)

    def _verify_history(self, drafts: Tensor) -> Tensor:
        """The histories of the verification's k + 1 positions, position i after ``drafts[:, :i]`` (A, k):
        (A * (k + 1), W + k), the drafts after i replaced by a stand-in."""
        base = self._history(drafts[:, :0])  # (A, W)
        A, k = drafts.shape
        j = torch.arange(k, device=drafts.device)
        i = torch.arange(k + 1, device=drafts.device)
        part = torch.where(j[None, None] < i[None, :, None], drafts[:, None], base[:, :1, None])  # (A, k + 1, k)
        full = torch.cat((base[:, None].expand(A, k + 1, base.shape[1]), part), 2)
        return full.reshape(A * (k + 1), -1)

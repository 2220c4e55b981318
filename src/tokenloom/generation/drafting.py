"""Drafters for speculative decoding (:mod:`tokenloom.generation.speculative`): :class:`ModelDrafter` (a small model of
the same protocol and vocabulary) and :class:`PromptLookup` (n-grams of the context), behind the small
:class:`Drafter` interface; and :class:`CacheRows`, a model's rewindable cache with the bookkeeping of its rows.

Shape legend: A rows still in the batch, T prompt length (left padding included), k draft tokens, V vocabulary size,
M cache columns.

A drafter serves one decoding run at a time: the run calls :meth:`Drafter.bind` (checks, allocation) and
:meth:`Drafter.start` (the prompt), then each round :meth:`Drafter.propose` and, after the model's verification,
:meth:`Drafter.update` with what each row kept; :meth:`Drafter.select` when finished rows leave the batch and
:meth:`Drafter.finish` at the end. Which objects are drafters is a type (:class:`Drafter`), never probed; which
caches can rewind is declared with the cache class (:func:`tokenloom.nn.kv_cache.declare_rewind`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch
from torch import Tensor, nn

from ..errors import GenerationError
from ..models.registry import decoding_of
from ..nn.kv_cache import RollingKVCache, SegmentMemory, rewinds
from ..nn.masks import positions_from_mask
from ..nn.modes import enter_eval, restore_training
from ..nn.recurrent import RecurrentState
from .choose import limit_vocabulary
from .processors import LogitsProcessorList
from .requests import check_prompt

# why a known cache strategy cannot drop rejected drafts (the others: it was not declared with declare_rewind)
WHY_NOT_REWIND: dict[type, str] = {
    RollingKVCache: "a sliding-window model's rolling cache has overwritten what a rejected draft displaced",
    SegmentMemory: "a Transformer-XL memory has pushed out the positions a rejected draft displaced",
    RecurrentState: "a recurrent state has folded every token in and cannot forget one",
}


def why_not_rewind(cache: object) -> str | None:
    """Why speculative decoding cannot run over ``cache`` (one line), or None when its strategy rewinds."""
    if rewinds(cache):
        return None
    reason = next((WHY_NOT_REWIND[base] for base in type(cache).__mro__ if base in WHY_NOT_REWIND),
                  "its strategy was not declared to rewind (tokenloom.nn.kv_cache.declare_rewind)")
    return f"speculative decoding drops rejected drafts from the cache, and {type(cache).__name__} cannot: {reason}"


class Draft(NamedTuple):
    """A round's proposal for A rows."""

    tokens: Tensor  # (A, k) proposed ids; a row's positions from its count on hold any id
    counts: Tensor  # (A,) long: how many tokens each row proposes, 0..k
    q: Tensor | None  # (A, k, V) the distribution each token was sampled from; None: one-hot on the tokens


class DraftRun(NamedTuple):
    """What a decoding run tells its drafter once."""

    processors: LogitsProcessorList  # the request's logits processors (history, scores) -> scores
    greedy: bool  # argmax (True) or sample
    generator: torch.Generator | None  # the request's seeded generator (None: the global one)
    vocab_limit: int | None  # ids from here on are never chosen (a tokenizer smaller than the model's vocabulary)
    capacity: int  # columns of the caches (the prompt, padding included, and max_new_tokens)
    max_new_tokens: int


History = Callable[[Tensor], Tensor]  # drafts (A, j) -> (A, W + j): what the processors see after them


class Drafter:
    """Proposes tokens for the model to verify (see the module docstring for the calls a run makes); a subclass
    implements :meth:`propose` and the hooks it needs."""

    def pads(self) -> bool:
        """Whether the drafter follows rows that advance by different amounts (their left padding grows); else
        the run advances every row by the same number of tokens."""
        return True

    def bind(self, model: nn.Module, run: DraftRun, prompt: Tensor, mask: Tensor | None) -> None:
        """Check the drafter against ``model`` and the (B, T) ``prompt`` (its padding a stand-in, ``mask`` (B, T)
        or None), and allocate what it needs; one-line :class:`GenerationError` s."""
        self.run = run

    def start(self, prompt: Tensor, mask: Tensor | None) -> None:
        """The run begins (under inference mode): the model has cached ``prompt[:, :T-1]``; its last column is
        the first round's newest token."""

    def propose(self, last: Tensor, k: int, history: History, live: Tensor) -> Draft:
        """Up to ``k`` tokens per row after each row's newest token ``last`` (A,); ``live`` (A,) bool marks the rows
        still decoding (the others' proposals are ignored). ``history(drafts (A, j))`` is what the request's
        processors see after the first j drafts."""
        raise NotImplementedError(f"{type(self).__name__} does not implement propose()")

    def update(self, kept: Tensor, emitted: list[list[int]]) -> None:
        """After the verification of the last proposal: ``kept`` (A,) long, the drafts each row kept (a row that
        finished holds the most any live row kept), ``emitted`` each row's new tokens (the kept drafts and the
        model's next token)."""

    def select(self, index: Tensor) -> None:
        """Only the rows ``index`` (A',) go on."""

    def finish(self) -> None:
        """The run is over (also after an error)."""


class CacheRows:
    """A model with a rewindable cache of M columns, and what its calls need per row: the (B, M) mask of the columns
    (left padding 0) and ``count`` (B,), the real positions cached. Rows advance together when nothing is padded
    (no mask is passed then); after a :meth:`rewind` that moved rows, the mask marks their grown padding."""

    def __init__(self, model: nn.Module, cache, capacity: int, batch_size: int, device: torch.device) -> None:
        self.model, self.cache, self.capacity = model, cache, capacity
        self.mask = torch.ones(batch_size, capacity, dtype=torch.long, device=device)  # (B, M)
        self.count = torch.zeros(batch_size, dtype=torch.long, device=device)  # (B,)
        self.padded = False

    def prefill(self, ids: Tensor, mask: Tensor | None) -> None:
        """Cache ``ids`` (B, t) of the prompt (``mask`` (B, t) or None), discarding the logits."""
        t = ids.shape[1]
        if t == 0:
            return
        if mask is not None and not bool(mask.all()):
            self.mask[:, :t] = mask
            self.padded = True
            positions = positions_from_mask(mask)
            self.count += mask.sum(-1)
        else:
            positions = torch.arange(t, device=ids.device)[None].expand(ids.shape[0], t)
            self.count += t
        self.model(ids, positions=positions, attention_mask=self.mask[:, :t] if self.padded else None,
                   cache=self.cache)

    def feed(self, ids: Tensor) -> Tensor:
        """(A, t) new ids, real tokens of every row -> (A, t, V) logits; they are cached."""
        L, t = self.cache.length, ids.shape[1]
        positions = self.count[:, None] + torch.arange(t, device=ids.device)  # (A, t)
        mask = None
        if self.padded:
            self.mask[:, L:L + t] = 1
            mask = self.mask[:, :L + t]
        logits = self.model(ids, positions=positions, attention_mask=mask, cache=self.cache)
        self.count += t
        return logits

    def room(self, t: int, live: Tensor) -> int:
        """The most of ``t`` new columns that fit (>= 1); makes room first where the ``live`` (A,) rows' common
        left padding can go (:meth:`~tokenloom.nn.kv_cache.KVCache.trim`)."""
        L = self.cache.length
        if L + t > self.capacity and self.padded:
            low = int((L - self.count)[live].min())
            if low > 0:
                self.cache.trim(low)
                self.mask[:, :L - low] = self.mask[:, low:L].clone()
                self.count.clamp_(max=L - low)  # (the rows that finished: what they hold no longer matters)
        return max(1, min(t, self.capacity - self.cache.length))

    def rewind(self, drop: Tensor) -> None:
        """Row b forgets its last ``drop[b]`` positions ((A,) long); rows moved right get their new padding
        masked."""
        shifts = self.cache.rewind(drop)
        self.count -= drop
        if bool(shifts.any()):
            L = self.cache.length
            source = torch.arange(L, device=drop.device)[None] - shifts[:, None]  # (A, L)
            moved = self.mask[:, :L].gather(1, source.clamp(min=0))
            self.mask[:, :L] = moved.masked_fill_(source < 0, 0)
            self.padded = True

    def select(self, index: Tensor) -> None:
        self.cache.select(index)
        self.mask, self.count = self.mask[index], self.count[index]


def create_rows(model: nn.Module, run: DraftRun, batch_size: int, device: torch.device, who: str) -> CacheRows:
    """:class:`CacheRows` over a new cache of ``model`` for ``run``; refuses a cache that cannot rewind."""
    cache = model.create_cache(batch_size, run.capacity)
    reason = why_not_rewind(cache)
    if reason is not None:
        raise GenerationError(f"{who}: {reason}")
    return CacheRows(model, cache, run.capacity, batch_size, device)


def model_vocab(model: object) -> int | None:
    return getattr(getattr(model, "config", None), "vocab_size", None)


class ModelDrafter(Drafter):
    """A small model of the same protocol and vocabulary (a small GPT; for an encoder-decoder, a decoder bound to
    the same sources) drafting k tokens autoregressively from its own cache: greedy when the request is, else sampled
    from its processed distribution q (returned with the tokens). After a verification its cache is rewound like the
    model's. Each round feeds what it has not cached (the model's newest token; after a round that kept every draft,
    also the last draft), then its own drafts but the last: k calls per round."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def pads(self) -> bool:
        return decoding_of(self.model) == "causal_lm"  # the causal LM protocol takes left-padded rows

    def bind(self, model: nn.Module, run: DraftRun, prompt: Tensor, mask: Tensor | None) -> None:
        super().bind(model, run, prompt, mask)
        mine, theirs = model_vocab(self.model), model_vocab(model)
        if mine != theirs:
            raise GenerationError(f"the draft model's vocabulary has {mine} ids and the model's {theirs}: a drafter "
                                  "must share the model's vocabulary")
        check_prompt(self.model, prompt, mask, run.max_new_tokens)
        self.rows = create_rows(self.model, run, prompt.shape[0], prompt.device, "the draft model")
        self.switched: list = []

    def start(self, prompt: Tensor, mask: Tensor | None) -> None:
        self.switched = enter_eval(self.model)
        T = prompt.shape[1]
        self.rows.prefill(prompt[:, :T - 1], None if mask is None else mask[:, :T - 1])
        self.carry: Tensor | None = None  # (A, 1): the token before the newest that the cache lacks; None: none
        self.drafted = 0

    def propose(self, last: Tensor, k: int, history: History, live: Tensor) -> Draft:
        run = self.run
        ids = last[:, None] if self.carry is None else torch.cat((self.carry, last[:, None]), dim=1)  # (A, 1|2)
        k = min(k, self.rows.room(ids.shape[1] + k - 1, live) - ids.shape[1] + 1)
        tokens: list[Tensor] = []
        dists: list[Tensor] = []
        for _ in range(k):
            scores = limit_vocabulary(self.rows.feed(ids)[:, -1], run.vocab_limit)  # (A, V) float32
            if run.processors:
                scores = run.processors(history(torch.stack(tokens, 1) if tokens else last[:, None][:, :0]), scores)
            if run.greedy:
                token = scores.argmax(-1)
            else:
                dists.append(scores.softmax(-1))
                token = torch.multinomial(dists[-1], 1, generator=run.generator).view(-1)
            tokens.append(token)
            ids = token[:, None]
        self.drafted, self.previous = k, torch.stack([last, *tokens], 1)  # (A, k + 1)
        counts = torch.full_like(last, k)
        return Draft(self.previous[:, 1:], counts, torch.stack(dists, 1) if dists else None)

    def update(self, kept: Tensor, emitted: list[list[int]]) -> None:
        # cached this round: the carry, the newest token and the drafts but the last. A row that kept j < k drafts
        # has its last kept token cached: it keeps it, and the next round feeds only the model's next token. A row
        # that kept all k lacks d_k: then every row keeps one token less and feeds it again with the next one.
        if bool((kept == self.drafted).any()):
            self.rows.rewind(self.drafted - kept)
            self.carry = self.previous.gather(1, kept[:, None])  # (A, 1) the last kept draft, or the newest token
        else:
            self.rows.rewind(self.drafted - 1 - kept)
            self.carry = None

    def select(self, index: Tensor) -> None:
        self.rows.select(index)
        if self.carry is not None:
            self.carry = self.carry[index]

    def finish(self) -> None:
        restore_training(self.switched)
        self.switched = []


LOOKUP_MAX_WAIT = 64  # the most rounds a prompt-lookup row waits after misses before it proposes again


class LookupRow:
    """One row's n-gram table: for each n, each n-gram's latest end in the row (with a token after it), and the same
    over the row's extra context (an encoder-decoder's source). :class:`PromptLookup` keeps one per row; a server
    keeps one per request (:meth:`PromptLookup.row`).

    It backs off where lookups miss: a proposal of which less than half is kept (read from the tokens the row
    grows by: the kept drafts are a prefix of them) is a miss, and after m misses in a row the row proposes nothing
    for 4^m - 1 rounds (at most :data:`LOOKUP_MAX_WAIT`), so open-ended text, where a verification of several positions
    costs more than it gains, falls back to plain one-token steps; a hit resets it. (On an AVX2 CPU a verification of
    4 positions cost about 3 one-token steps: with 2^m - 1 the open-ended Shakespeare samples still ran at 0.86x.)"""

    def __init__(self, tokens: list[int], extra: list[int], min_n: int, max_n: int) -> None:
        self.tokens, self.extra, self.min_n, self.max_n = tokens, extra, min_n, max_n
        self.pending: list[int] = []  # the last proposal, until the row grows
        self.misses, self.wait = 0, 0  # misses in a row; rounds left without proposals
        self.table: dict[tuple[int, ...], int] = {}
        self.extra_table: dict[tuple[int, ...], int] = {}
        self.done = 0  # n-grams ending before this index are in the table
        self._register(extra, 0, self.extra_table)
        self._register(tokens, 0, self.table)

    def _register(self, seq: list[int], start: int, table: dict[tuple[int, ...], int]) -> None:
        """Record the n-grams of ``seq`` ending at ``start`` .. len - 2 (a token follows each)."""
        for end in range(start, len(seq) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                table[tuple(seq[end + 1 - n:end + 1])] = end
        if seq is self.tokens:
            self.done = max(self.done, len(seq) - 1)

    def extend(self, new: list[int]) -> None:
        if self.pending:  # the kept drafts are the prefix of the new tokens that matches the proposal
            kept = next((i for i, (a, b) in enumerate(zip(self.pending, new, strict=False)) if a != b),
                        min(len(self.pending), len(new)))
            self.misses = 0 if 2 * kept >= len(self.pending) else self.misses + 1
            self.wait = min(4 ** self.misses - 1, LOOKUP_MAX_WAIT)
            self.pending = []
        self.tokens.extend(new)
        self._register(self.tokens, self.done, self.table)

    def propose(self, k: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest suffix n-gram (the row's own text
        first, then the extra context), at most ``k`` (a match in the row's text whose continuation reaches the
        suffix goes on periodically); [] when no n-gram of min_n or more recurs, or while the row backs off."""
        self.pending = self._match(k)
        return self.pending

    def _match(self, k: int) -> list[int]:
        if self.wait:
            self.wait -= 1
            return []
        tokens, m = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, m), self.min_n - 1, -1):
            key = tuple(tokens[m - n:])
            end = self.table.get(key)
            if end is not None:  # a match running into the row's end repeats with its period (an overlapping copy)
                proposal, period = tokens[end + 1:end + 1 + k], m - 1 - end
                while len(proposal) < k:
                    proposal.append(proposal[-period])
                return proposal
            end = self.extra_table.get(key)
            if end is not None:
                return self.extra[end + 1:end + 1 + k]
        return []


class PromptLookup(Drafter):
    """Prompt-lookup decoding: for each row the longest suffix n-gram (``max_ngram`` down to ``min_ngram`` tokens) of
    its tokens so far that also occurs earlier in its context (the prompt and the generated text; ``context``: extra
    ids per row, e.g. an encoder-decoder's source, (B, S) with ``context_mask`` or lists) — the most recent
    occurrence — proposes the up-to-k tokens that followed it. Its q is one-hot on the proposal, so sampling still
    keeps the model's distribution. A round in which no row finds a match is a plain one-token step."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1,
                 context: Tensor | Sequence[Sequence[int]] | None = None, context_mask: Tensor | None = None) -> None:
        for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise GenerationError(f"prompt lookup's {name} must be a positive integer, got {value!r}")
        if min_ngram > max_ngram:
            raise GenerationError(f"prompt lookup's min_ngram={min_ngram} exceeds max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.context: list[list[int]] | None = None
        if isinstance(context, Tensor):
            keep = context_mask.bool() if context_mask is not None else torch.ones_like(context, dtype=torch.bool)
            self.context = [row[m].tolist() for row, m in zip(context, keep, strict=True)]
        elif context is not None:
            self.context = [list(row) for row in context]

    def row(self, tokens: list[int]) -> LookupRow:
        """A one-row table over ``tokens`` (a copy) with this drafter's n-gram sizes: ``propose(k)`` after them,
        ``extend(new)`` as the row grows."""
        return LookupRow(list(tokens), [], self.min_ngram, self.max_ngram)

    def bind(self, model: nn.Module, run: DraftRun, prompt: Tensor, mask: Tensor | None) -> None:
        super().bind(model, run, prompt, mask)
        if self.context is not None and len(self.context) != prompt.shape[0]:
            raise GenerationError(f"prompt lookup has extra context for {len(self.context)} rows and the batch has "
                                  f"{prompt.shape[0]}")

    def start(self, prompt: Tensor, mask: Tensor | None) -> None:
        T = prompt.shape[1]
        real = [T] * prompt.shape[0] if mask is None else mask.sum(-1).tolist()
        extra = self.context or [[] for _ in real]
        self.rows = [LookupRow(row[T - n:], list(e), self.min_ngram, self.max_ngram)
                     for row, n, e in zip(prompt.tolist(), real, extra, strict=True)]

    def propose(self, last: Tensor, k: int, history: History, live: Tensor) -> Draft:
        proposals = [row.propose(k) if alive else [] for row, alive in zip(self.rows, live.tolist(), strict=True)]
        tokens = torch.tensor([p + [0] * (k - len(p)) for p in proposals], dtype=torch.long, device=last.device)
        counts = torch.tensor([len(p) for p in proposals], dtype=torch.long, device=last.device)
        return Draft(tokens.view(len(proposals), k), counts, None)

    def update(self, kept: Tensor, emitted: list[list[int]]) -> None:
        for row, new in zip(self.rows, emitted, strict=True):
            row.extend(new)

    def select(self, index: Tensor) -> None:
        self.rows = [self.rows[i] for i in index.tolist()]


class _Fingerprinted(Protocol):
    @property
    def fingerprint(self) -> str: ...


def check_draft_tokenizer(tokenizer: _Fingerprinted, draft_tokenizer: _Fingerprinted) -> None:
    """One-line :class:`GenerationError` unless a draft model's tokenizer encodes as the model's does (equal
    fingerprints): ids are compared, not text, so they must mean the same."""
    if tokenizer.fingerprint != draft_tokenizer.fingerprint:
        raise GenerationError("the draft model's tokenizer differs from the model's: speculative decoding compares "
                              "token ids, so both must share one tokenizer")

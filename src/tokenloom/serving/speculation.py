"""Speculative decoding in the serving engine (:class:`~tokenloom.serving.engine.Engine`, ``tokenloom serve --draft
RUN | --prompt-lookup N``): each step, the running requests that opted in (``Request.speculative``) get up to k
drafted tokens, and one pass of the model over the ragged cache verifies them all, T = 1 + the most drafts any row
has: row b writes its T positions from its own length, its query t sees its keys up to ``lengths[b] + t``
(:class:`~tokenloom.nn.kv_cache.RaggedView`). A row with fewer drafts (a request that opted out has none) rides in
the same pass, its later positions padding whose outputs are ignored; the engine then advances each row by the
tokens it kept (its agreeing drafts and the model's next token), so rows advance independently, with no shifting:
what a row wrote past them is masked and overwritten later. The acceptance rule is the offline one
(:func:`~tokenloom.generation.speculative.accept_greedy`, :func:`~tokenloom.generation.speculative.accept_sampled`),
per request with its own logits processors and seeded generator; a row without drafts chooses as a plain step does.

Shape legend: A running rows, k drafts per row (its own count from 0 to ``num_draft_tokens``), T = k + 1 positions
verified, V vocabulary size, M cache columns.

Drafters: prompt lookup (one :class:`~tokenloom.generation.drafting.LookupRow` per request, over its prompt and
output), or a draft model of the same vocabulary with its own slot cache beside the engine's: each request's prompt
is prefilled into its row, and each round feeds what the row's draft cache lacks (the newest token, and the last
kept draft after a round that kept every draft) then its drafts but the last, k calls over the draft cache's ragged
view. After the verification its length becomes the row's kept length where its drafts were right.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..devices import device_of
from ..errors import ConfigError
from ..generation.choose import limit_vocabulary
from ..generation.drafting import Drafter, PromptLookup
from ..generation.speculative import accept_greedy, accept_sampled
from ..nn.kv_cache import KVCache


@dataclass
class Proposal:
    """A round's drafts for A rows: ``tokens`` (A, k) (a row's positions from its count on hold any id), ``counts``
    (A,) long, ``q`` (A, k, V) the distributions sampled rows drew from (None: one-hot on the tokens)."""

    tokens: Tensor
    counts: Tensor
    q: Tensor | None


def history(slot) -> list[int]:  # noqa: ANN001 - an engine slot
    """The request's tokens so far: the prompt and its new tokens (the newest, not yet cached, last)."""
    return slot.request.prompt_ids + slot.request.new_ids


def _processed(slot, scores: Tensor, drafts: list[int]) -> Tensor:  # noqa: ANN001 - an engine slot
    """``scores`` (t, V) of the positions after the request's tokens and ``drafts[:i]`` (i < t) through its
    processors, each position seeing its earlier drafts (the later ones replaced by a stand-in already in the
    history, neutral for the repetition penalty), as plain decoding would."""
    if not slot.processors:
        return scores
    base = history(slot)
    t = scores.shape[0]
    rows = [base + drafts[:i] + [base[0]] * (t - 1 - i) for i in range(t)]
    return slot.processors(torch.tensor(rows, device=scores.device), scores)


def accept(slots: list, scores: Tensor, proposal: Proposal) -> tuple[list[int], list[int]]:
    """The verification's (A, T, V) float32 ``scores`` (the vocabulary limited) of ``[newest, d_1 .. d_k]`` per row
    -> (the drafts each row keeps, its next token): greedy rows by the model's argmax, sampled rows by the sampling
    rule with their own generator; a row without drafts chooses from its first position as a plain step."""
    drafts, counts = proposal.tokens, proposal.counts
    A = len(slots)
    kept, nxt = [0] * A, [0] * A
    listed, count = drafts.tolist(), counts.tolist()
    plain = [b for b, s in enumerate(slots) if s.request.config.greedy and not s.processors]
    if plain:
        rows = torch.tensor(plain, device=scores.device)
        k, n = accept_greedy(scores[rows].argmax(-1), drafts[rows], counts[rows])
        for b, kb, nb in zip(plain, k.tolist(), n.tolist(), strict=True):
            kept[b], nxt[b] = kb, nb
    for b, slot in enumerate(slots):
        if slot.request.config.greedy and not slot.processors:
            continue
        c = count[b]
        processed = _processed(slot, scores[b, :c + 1], listed[b][:c])  # (c + 1, V)
        if slot.request.config.greedy:
            k, n = accept_greedy(processed.argmax(-1)[None], drafts[b:b + 1, :c], counts[b:b + 1])
        elif c == 0:
            k, n = counts[b:b + 1], torch.multinomial(processed[:1].softmax(-1), 1, generator=slot.generator)
        else:
            q = proposal.q[b:b + 1, :c] if proposal.q is not None else None
            k, n = accept_sampled(processed.softmax(-1)[None], drafts[b:b + 1, :c], q, counts[b:b + 1],
                                  slot.generator)
        kept[b], nxt[b] = int(k), int(n.view(-1)[0])
    return kept, nxt


class Speculator:
    """The engine's drafter: ``draft`` a :class:`~tokenloom.generation.drafting.PromptLookup` (one table per
    request) or a draft model (its own slot cache of ``max_batch`` rows); ``k`` drafts per row and round at most.
    The engine's cache needs :attr:`extra_columns` columns past the context (the padded positions of a row near
    its end)."""

    def __init__(self, draft: nn.Module | PromptLookup, k: int, model: nn.Module, max_batch: int,
                 vocab_limit: int | None) -> None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(f"--num-draft-tokens must be an integer >= 1, got {k!r}")
        self.k, self.max_len, self.vocab_limit = k, model.config.max_seq_len, vocab_limit
        self.device = device_of(model)
        self.extra_columns = k + 1
        self.lookup = draft if isinstance(draft, PromptLookup) else None
        self.draft: nn.Module | None = None
        if self.lookup is None:
            if isinstance(draft, Drafter):
                raise ConfigError(f"the server drafts with prompt lookup or a draft model, not a "
                                  f"{type(draft).__name__}")
            self._bind_model(draft, model, max_batch)

    def _bind_model(self, draft: nn.Module, model: nn.Module, max_batch: int) -> None:
        mine, theirs = draft.config, model.config
        if mine.vocab_size != theirs.vocab_size:
            raise ConfigError(f"the draft model's vocabulary has {mine.vocab_size} ids and the model's "
                              f"{theirs.vocab_size}: a drafter must share the model's vocabulary")
        if mine.max_seq_len < self.max_len:
            raise ConfigError(f"the draft model's context of {mine.max_seq_len} is shorter than the model's "
                              f"{self.max_len}: it must draft wherever the model decodes")
        if getattr(mine, "memory_len", 0):
            raise ConfigError("a Transformer-XL draft model cannot draft for the server's independent rows")
        if device_of(draft) != device_of(model):
            raise ConfigError(f"the draft model is on {device_of(draft)} and the model on {device_of(model)}")
        self.draft = draft.eval()
        self.cache = draft.create_cache(max_batch, self.max_len + self.extra_columns, rolling=False)
        if not isinstance(self.cache, KVCache):
            raise ConfigError(f"a {type(draft).__name__} draft model decodes over a {type(self.cache).__name__}; "
                              "the server's draft rows need a key/value cache")
        self.lengths = torch.zeros(max_batch, dtype=torch.long, device=self.device)  # cached per draft row
        self.views: dict[int, object] = {}

    # --- rows joining and moving ------------------------------------------------------------------------------------

    def start(self, row: int, request, drafts: bool = True) -> object | None:  # noqa: ANN001 - an engine Request
        """A request joins in ``row`` (after the model's prefill): when it gets drafts (``drafts``: it opted in and
        nothing forbids them, e.g. a constraint), its prompt-lookup table (returned, kept with its slot) or its prompt
        prefilled into the draft cache's row."""
        if not (drafts and request.speculative):
            if self.draft is not None:
                self.lengths[row] = 0
            return None
        if self.lookup is not None:
            return self.lookup.row(request.prompt_ids)
        ids = torch.tensor([request.prompt_ids], device=self.device)
        cache = self.draft.create_cache(1, self.max_len, rolling=False)
        self.draft(ids, cache=cache)
        self.cache.copy_rows(row, cache, 0, ids.shape[1])
        self.lengths[row] = ids.shape[1]
        return None

    def move(self, row: int, last: int) -> None:
        """The request of row ``last`` moves into the freed ``row``."""
        if self.draft is not None:
            self.cache.copy_rows(row, self.cache, last, int(self.lengths[last]))
            self.lengths[row] = self.lengths[last]

    # --- a round ------------------------------------------------------------------------------------------------

    def propose(self, slots: list, budgets: list[int]) -> Proposal | None:
        """Drafts for the running ``slots``; ``budgets`` the tokens each may still produce (its ``max_tokens`` and
        the context). A row drafts ``min(k, budget - 1)`` when its request opted in, else none. None: no row has a
        draft (a plain step)."""
        limits = [min(self.k, budget - 1) if slot.speculative else 0 for slot, budget in zip(slots, budgets,
                                                                                              strict=True)]
        if max(limits, default=0) <= 0:
            return None
        if self.lookup is not None:
            return self._look_up(slots, limits)
        return self._draft(slots, limits)

    def _look_up(self, slots: list, limits: list[int]) -> Proposal | None:
        proposals = []
        for slot, limit in zip(slots, limits, strict=True):
            table = slot.draft_state
            if not limit or table is None:
                proposals.append([])
                continue
            tokens = history(slot)
            if len(table.tokens) < len(tokens):
                table.extend(tokens[len(table.tokens):])
            proposals.append(table.propose(limit))
        k = max(len(p) for p in proposals)
        if not k:
            return None
        device = self.device
        tokens = torch.tensor([p + [0] * (k - len(p)) for p in proposals], dtype=torch.long, device=device)
        counts = torch.tensor([len(p) for p in proposals], dtype=torch.long, device=device)
        return Proposal(tokens, counts, None)

    def _draft(self, slots: list, limits: list[int]) -> Proposal:
        """k = max(limits) tokens from the draft model for every row: the first call feeds each row what its draft
        cache lacks up to its newest token (right-padded to the longest), the next k - 1 one draft each."""
        A, k = len(slots), max(limits)
        if A not in self.views:
            self.views[A] = self.cache.ragged(A, self.lengths[:A])
        view, lengths = self.views[A], self.lengths[:A]
        device = lengths.device
        feeds = []
        for b, (slot, start) in enumerate(zip(slots, lengths.tolist(), strict=True)):
            if slot.speculative:
                feeds.append(history(slot)[start:])
            else:  # a row that opted out: garbage from column 0, never read
                lengths[b] = 0
                feeds.append([slot.last])
        n = torch.tensor([len(f) for f in feeds], device=device)  # (A,)
        width = int(n.max())
        ids = torch.tensor([f + f[-1:] * (width - len(f)) for f in feeds], device=device)  # (A, width)
        offsets = torch.minimum(torch.arange(width, device=device)[None], n[:, None] - 1)
        logits = self.draft(ids, positions=(lengths[:, None] + offsets).clamp_(max=self.max_len - 1), cache=view)
        logits = logits[torch.arange(A, device=device), n - 1]  # (A, V) after each row's newest token
        lengths += n
        tokens: list[Tensor] = []
        dists: list[Tensor | None] = []
        for i in range(k):
            if i:
                logits = self.draft(tokens[-1][:, None], positions=lengths[:, None].clamp(max=self.max_len - 1),
                                    cache=view)[:, 0]
                lengths += 1
            token, dist = self._choose(slots, limit_vocabulary(logits, self.vocab_limit), tokens, limits, i)
            tokens.append(token)
            dists.append(dist)
        for b, slot in enumerate(slots):
            if not slot.speculative:
                lengths[b] = 0
        q = None
        if any(d is not None for d in dists):
            q = torch.stack([d if d is not None else torch.zeros_like(logits, dtype=torch.float32) for d in dists], 1)
        counts = torch.tensor(limits, dtype=torch.long, device=device)
        return Proposal(torch.stack(tokens, 1), counts, q)

    def _choose(self, slots: list, scores: Tensor, tokens: list[Tensor], limits: list[int],
                i: int) -> tuple[Tensor, Tensor | None]:
        """Draft ``i`` of every row from the draft model's (A, V) float32 ``scores``: the argmax, or for a request
        that samples (and drafts this far) a sample of its processed distribution with its generator, whose (A, V)
        distributions are returned (zeros for the other rows)."""
        out = scores.argmax(-1)
        q = None
        for b, slot in enumerate(slots):
            greedy = slot.request.config.greedy
            if i >= limits[b] or (greedy and not slot.processors):
                continue
            s = scores[b:b + 1]
            if slot.processors:
                drafted = [int(t[b]) for t in tokens]
                s = slot.processors(torch.tensor([history(slot) + drafted], device=scores.device), s)
            if greedy:
                out[b] = s.argmax(-1)[0]
                continue
            p = s.softmax(-1)
            out[b] = torch.multinomial(p, 1, generator=slot.generator)[0, 0]
            if q is None:
                q = torch.zeros_like(scores)
            q[b] = p[0]
        return out, q

    def settle(self, lengths: Tensor) -> None:
        """After the verification: (A,) the rows' new lengths in the model's cache; a draft row's cache is right up
        to there at most (its drafts past the kept ones were wrong)."""
        if self.draft is not None:
            A = lengths.shape[0]
            torch.minimum(self.lengths[:A], lengths, out=self.lengths[:A])

"""Continuous batching for a causal language model over a paged KV cache: one engine thread, requests joining and
leaving the running batch between steps, prompts prefilled in chunks beside the running rows' decode tokens.

* **Paged cache** (:mod:`tokenloom.nn.paged`): keys and values live in a pool of ``kv_blocks`` blocks of
  ``block_size`` positions; each running request holds a table of block ids, taken as it grows
  (:class:`~tokenloom.serving.blocks.BlockManager`). A request is admitted when the free blocks cover its prompt
  (not when a context-long slot is free), so short requests pack densely; ``block_size`` equal to the context
  and no prefix caching is the slot-based cache of one context-long row per request.
* **Prefix caching**: a full block is registered under the hash of every token up to its end; a new request reuses
  the longest run of cached blocks of its prompt and prefills only the rest (``Request.cached_tokens``).
  Unreferenced cached blocks stay until the allocator needs them (least recently used first).
* **Chunked, batched prefill**: each step runs, in one forward over the paged strategy, every decoding row's newest
  token and chunks of the prompts being prefilled, up to ``prefill_tokens`` tokens per step in all, several
  prompts at once; a prompt's first token comes from the step that prefills its last chunk.
* **n samples** (``Request.siblings``): the prompt is prefilled once; the siblings fork its blocks (shared, a
  shared partial block copied on its first write).
* **Preemption by recompute**: when a step needs a block and none is free, the most recently admitted other
  request gives its blocks back and waits at the head of the queue; it is prefilled again (its prompt and the tokens
  it had produced) and continues where it was, its output unchanged.
* Each request samples with its own settings and seeded generator (greedy = argmax), exactly as
  :func:`tokenloom.generation.generate` does for one prompt, so greedy output equals offline generation.
  ``logprobs`` / ``echo`` fill :attr:`Request.token_logprobs` / :attr:`Request.prompt_logprobs` from the model's
  float32 log-softmax.
* Stop conditions per request: EOS, a stop string (the text is cut before it, as OpenAI does), ``max_tokens``,
  the context full, a deadline (``timeout``), or cancellation (a client that went away): its blocks are released
  before the next step.
* The queue of waiting requests is bounded: :meth:`Engine.submit` raises :class:`QueueFull` when it is full.
* Speculative decoding (``draft=``: a :class:`~tokenloom.generation.drafting.PromptLookup` or a draft model): in a
  step with no prompt to prefill, the requests that opted in (``Request.speculative``, the default) get drafts and
  one pass of T positions per row verifies them, each row advancing by the tokens it kept
  (:mod:`tokenloom.serving.speculation`). Greedy output stays the plain output.

The engine talks to the model through the decoding protocol only (``create_cache(1, 1, rolling=False)`` for the
layout of its keys and values, ``forward_features(ids, positions=, cache=)``, ``forward_head``, ``config.max_seq_len``
/ ``vocab_size``), so it serves every causal family with a key/value cache.

Events reach the caller through ``request.emit(event)``, called on the engine thread, or, with a ``dispatch``
function, handed over once per step as a list of ``(emit, event)`` pairs (a server's event loop calls them):
``("delta", text)`` as text becomes final, then ``("done", finish_reason)`` with finish_reason ``stop`` | ``length``, or
``("error", message)`` (``timeout``, or a failure of the model).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..devices import device_of
from ..errors import ConfigError
from ..generation.choose import choose_next, limit_vocabulary, vocabulary_limit
from ..generation.config import GenerationConfig
from ..generation.processors import create_processors
from ..models.sizes import check_kv_cache
from ..nn.kv_cache import KVCache
from ..nn.paged import PagedKVCache
from .blocks import BlockManager, NoFreeBlocks
from .request import QueueFull, Request, TokenLogprob, token_entries
from .speculation import Speculator, accept

__all__ = ["Engine", "QueueFull", "Request", "TokenLogprob"]  # (the request types live in .request)

@dataclass(eq=False)
class _Slot:
    request: Request
    processors: object
    generator: torch.Generator | None
    feed: list[int]  # the tokens to prefill: the prompt (after a preemption, also the tokens produced but the newest)
    order: int = 0  # admission order: a preemption takes the newest
    last: int = -1  # the newest token, fed at the next step (-1 while prefilling)
    table: list[int] = field(default_factory=list)  # its blocks, in column order
    length: int = 0  # columns cached
    registered: int = 0  # leading full blocks registered in (or taken from) the prefix cache
    resumed: bool = False  # prefilling again after a preemption: its next token is known already
    speculative: bool = False  # it gets drafts
    draft_state: object = None  # its drafter's own state (a prompt-lookup table)

    @property
    def prefilling(self) -> bool:
        return self.length < len(self.feed)


class Engine:
    """Continuous batching over ``model`` (a causal LM in eval mode) and ``tokenizer``; see the module docstring.

    ``max_batch``: running requests at most; ``block_size``, ``kv_blocks``: the paged cache (default: as many
    positions as ``max_batch`` full contexts); ``prefix_caching``: reuse cached prompt blocks; ``prefill_tokens``:
    tokens a step runs at most (decode tokens and prompt chunks together; a prompt chunk gets at least a block)."""

    def __init__(self, model, tokenizer, max_batch: int = 16, max_queue: int = 64,
                 on_step: Callable[[int, int], None] | None = None,
                 dispatch: Callable[[list[tuple[Callable, tuple]]], None] | None = None,
                 draft=None, num_draft_tokens: int = 4,  # noqa: ANN001 - a draft model or a PromptLookup
                 on_draft: Callable[[int, int], None] | None = None, *, block_size: int = 16,
                 kv_blocks: int | None = None, prefix_caching: bool = True, prefill_tokens: int = 512) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_len = max_batch, model.config.max_seq_len
        c = model.config
        if getattr(c, "memory_len", 0):
            raise ConfigError(f"a Transformer-XL model (memory_len={c.memory_len}) cannot be served: its memory "
                              "follows one stream of segments, not a batch of independent requests")
        for name, value in (("block_size", block_size), ("prefill_tokens", prefill_tokens),
                            ("kv_blocks", 1 if kv_blocks is None else kv_blocks)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        probe = model.create_cache(1, 1, rolling=False)  # the layout of the model's keys and values
        if not isinstance(probe, KVCache):  # continuous batching pages the keys and values of a dense cache
            raise ConfigError(f"{type(model).__name__} models cannot be served: continuous batching needs a key/value "
                              f"cache, and they decode over a {type(probe).__name__} (use tokenloom generate)")
        self.vocab_limit = vocabulary_limit(tokenizer, c.vocab_size)
        self.speculator = None if draft is None else \
            Speculator(draft, num_draft_tokens, model, max_batch, self.vocab_limit)
        extra = 0 if self.speculator is None else self.speculator.extra_columns  # a verification's padded positions
        self.block_size = block_size
        per_request = -(-(self.max_len + extra) // block_size)
        self.kv_blocks = kv_blocks or max_batch * per_request
        L, _, _, Hkv, _, D = probe.kv.shape
        if kv_blocks is None:  # refused in one line when it cannot fit in memory (tokenloom.budget)
            check_kv_cache(c, max_batch, per_request * block_size, probe.kv.element_size(), f"max_batch={max_batch}",
                           error=ConfigError)
        else:
            check_kv_cache(c, 1, kv_blocks * block_size, probe.kv.element_size(),
                           f"kv_blocks={kv_blocks} x block_size={block_size}", error=ConfigError)
        self.pool = PagedKVCache(L, self.kv_blocks, Hkv, block_size, D, dtype=probe.kv.dtype, device=probe.kv.device)
        self.blocks = BlockManager(self.kv_blocks, block_size, prefix_caching)
        self.prefix_caching, self.prefill_tokens = prefix_caching, prefill_tokens
        self.device = device_of(model)  # the batch's tokens and positions live beside the weights
        self.slots: list[_Slot] = []
        self.pending: deque[Request | _Slot] = deque()  # taken from the queue, not yet admitted (preempted first)
        self.waiting: queue.Queue[Request] = queue.Queue(maxsize=max_queue)
        self.eos = getattr(tokenizer, "eos_id", None)
        self.on_step = on_step  # (active rows, tokens produced) after every step, for metrics
        self.on_draft = on_draft  # (tokens drafted, drafts kept) after every speculative step, for metrics
        # dispatch: hands one step's events, [(request.emit, event), ...], to the consumer at once (a server's event
        # loop: one wake-up per step instead of one per request); None: each emit is called directly
        self.dispatch = dispatch
        self._events: list[tuple[Callable, tuple]] = []
        self._admitted = 0
        self.preemptions = 0  # requests that gave their blocks back and were prefilled again
        self.peak_active = 0  # the most requests running at once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenloom-engine", daemon=True)

    # --- lifecycle ----------------------------------------------------------------------------------------------

    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def submit(self, request: Request) -> None:
        """Queue ``request``; :class:`QueueFull` when ``max_queue`` requests already wait."""
        try:
            self.waiting.put_nowait(request)
        except queue.Full:
            raise QueueFull(f"the server's queue is full ({self.waiting.maxsize} waiting requests); retry "
                            "later") from None

    @property
    def active(self) -> int:
        return len(self.slots)

    @property
    def queued(self) -> int:
        return self.waiting.qsize() + len(self.pending)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt the KV cache can hold with one new token."""
        return self.kv_blocks * self.block_size - 1

    def cache_stats(self) -> dict:
        """The paged cache's state: blocks used and free, prefix-cache queries and hits (tokens), evictions,
        preemptions."""
        return {**self.blocks.stats(), "blocks": self.kv_blocks, "block_size": self.block_size,
                "preemptions": self.preemptions}

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (``/health`` answers 503 once it has stopped)."""
        return self._thread.is_alive()

    # --- the loop -----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        with torch.inference_mode():
            while not self._stop.is_set():
                try:
                    self._pull()
                    self._admit()
                    if not self.slots:
                        if not self.pending:
                            try:
                                self.pending.append(self.waiting.get(timeout=0.05))
                            except queue.Empty:
                                pass
                        continue
                    self._step()
                except Exception as error:  # noqa: BLE001 — fail the running requests, keep serving
                    for slot in self.slots:
                        self._emit(slot.request, ("error", f"generation failed: {error}"))
                        self.blocks.release_all(slot.table)
                        slot.table = []
                    self._events, events = [], self._events
                    if self.dispatch is not None and events:
                        try:
                            self.dispatch(events)
                        except Exception:  # noqa: BLE001, S110 — the event loop is gone: nothing to tell
                            pass
                    self.slots.clear()

    def _pull(self) -> None:
        while True:
            try:
                self.pending.append(self.waiting.get_nowait())
            except queue.Empty:
                return

    def _admit(self) -> None:
        """Admit waiting requests (the preempted first) while the batch has room and the free blocks cover their
        prompts (less the blocks the prefix cache already holds)."""
        reserved, bs = 0, self.block_size
        while self.pending and len(self.slots) < self.max_batch:
            item = self.pending[0]
            slot = item if isinstance(item, _Slot) else None
            request = item.request if slot is not None else item
            if request.cancelled or self._late(request):
                self.pending.popleft()
                heir = self._heir(request)
                if heir is not None:  # its siblings go on without it
                    self.pending.appendleft(heir if slot is None else self._hand_over(slot, heir))
                self._flush()
                continue
            feed = slot.feed if slot is not None else request.prompt_ids
            blocks = -(-(len(feed) + 1) // bs)
            if blocks > self.kv_blocks:
                self.pending.popleft()
                self._fail(request, f"the prompt of {len(request.prompt_ids)} tokens does not fit in the KV cache "
                                    f"({self.kv_blocks} blocks of {bs} positions: {self.max_prompt_tokens} at most)")
                continue
            matched = [] if request.echo else self.blocks.match(feed[:-1])
            if not self.blocks.can_allocate(reserved + blocks - len(matched)):
                self.blocks.release_all(matched)
                return
            reserved += blocks - len(matched)
            self.pending.popleft()
            if slot is None:
                try:  # one request's settings must not stop every other request
                    slot = _Slot(request, self._processors(request), self._generator(request.config),
                                 feed=list(feed))
                except Exception as error:  # noqa: BLE001
                    self.blocks.release_all(matched)
                    self._fail(request, f"generation failed: {error}")
                    continue
                request.cached_tokens = len(matched) * bs
                if request.echo:
                    request.prompt_logprobs = [None]
            slot.table, slot.length = matched, len(matched) * bs
            slot.registered = len(matched)
            self._admitted += 1
            slot.order = self._admitted
            self.slots.append(slot)
        self.peak_active = max(self.peak_active, len(self.slots))

    @staticmethod
    def _processors(request: Request):  # noqa: ANN205 - a LogitsProcessorList
        """The request's logits processors: its settings', then its constraint's."""
        processors = create_processors(request.config)
        if request.constraint is not None:
            processors.append(request.constraint)
        return processors

    def _generator(self, config: GenerationConfig) -> torch.Generator | None:
        """A sampling request's own seeded generator (None: greedy, or the global one without a seed)."""
        if config.greedy or config.seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(config.seed)

    def _late(self, request: Request) -> bool:
        """Ends ``request`` (and its siblings not started yet) with a timeout error when its deadline has passed."""
        if request.deadline is None or time.monotonic() <= request.deadline or request.finish_reason is not None:
            return False
        for late in (request, *request.siblings):
            if late.finish_reason is None:
                late.finish_reason = "timeout"
                self._emit(late, ("error", "the request waited longer than the server's request timeout"))
        return True

    @staticmethod
    def _heir(request: Request) -> Request | None:
        """The first sibling of a cancelled ``request`` still wanted (it takes the others over), or None."""
        live = [s for s in request.siblings if not s.cancelled and s.finish_reason is None]
        if not live:
            return None
        live[0].siblings, request.siblings = live[1:], []
        return live[0]

    def _hand_over(self, slot: _Slot, heir: Request) -> _Slot:
        """``slot`` (a prompt not fully prefilled, its blocks kept) continues as ``heir``'s."""
        gone = slot.request
        slot.request, slot.processors, slot.generator = heir, self._processors(heir), self._generator(heir.config)
        heir.cached_tokens, heir.prompt_logprobs = gone.cached_tokens, list(gone.prompt_logprobs)
        return slot

    def _fail(self, request: Request, message: str) -> None:
        request.finish_reason = "error"
        self._emit(request, ("error", message))
        self._flush()

    # --- a step -------------------------------------------------------------------------------------------------

    def _step(self) -> None:
        for slot in self.slots:
            if slot.prefilling and not slot.request.cancelled:
                self._late(slot.request)
        self._release()
        if not self.slots:
            return
        decoding = [s for s in self.slots if not s.prefilling]
        produced = None
        if self.speculator is not None and len(decoding) == len(self.slots) <= self.max_batch:
            produced = self._speculate()
        if produced is None:
            produced = self._forward(decoding)
        if self.on_step is not None:
            self.on_step(len(self.slots), produced)
        self._release()

    def _forward(self, decoding: list[_Slot]) -> int:
        """One forward over the decoding rows' newest tokens and chunks of the prompts being prefilled (up to
        ``prefill_tokens`` tokens in all). -> the tokens produced."""
        budget = max(self.prefill_tokens - len(decoding), self.block_size)
        segments = [(s, 1) for s in decoding]
        for slot in sorted((s for s in self.slots if s.prefilling), key=lambda s: s.order):
            if budget <= 0:
                break
            n = min(len(slot.feed) - slot.length, budget)
            segments.append((slot, n))
            budget -= n
        segments = self._reserve(segments)
        if not segments:
            return 0
        device = self.device
        ids, positions = [], []
        for slot, n in segments:
            ids.append(slot.feed[slot.length:slot.length + n] if slot.prefilling else [slot.last])
            positions.append(list(range(slot.length, slot.length + n)))
        counts = [n for _, n in segments]
        view = self._view([s for s, _ in segments], None if max(counts) == 1 else counts)
        shape = (len(segments), 1) if max(counts) == 1 else (1, sum(counts))
        ids_t = torch.tensor(sum(ids, []), device=device).view(shape)
        positions_t = torch.tensor(sum(positions, []), device=device).view(shape)
        hidden, _ = self.model.forward_features(ids_t, positions=positions_t, cache=view)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        # the positions whose logits are needed: a decoding row's token, a prompt's last one (its first new token),
        # every prompt position of an echo request (its prompt log-probabilities)
        picks, spans, start = [], [], 0
        for slot, n in segments:
            first = len(picks)
            finishing = slot.prefilling and slot.length + n == len(slot.feed)
            if not slot.prefilling or (finishing and not slot.resumed):
                if slot.request.echo and slot.prefilling:
                    picks.extend(range(start, start + n))
                else:
                    picks.append(start + n - 1)
            elif slot.request.echo and not slot.resumed:
                picks.extend(range(start, start + n))
            spans.append((first, len(picks)))
            start += n
        scores = self._limited(self.model.forward_head(hidden[picks])) if picks else None
        return self._advance(segments, spans, scores)

    def _advance(self, segments: list[tuple[_Slot, int]], spans: list[tuple[int, int]], scores: Tensor | None) -> int:
        """After a forward: lengths, prompt log-probabilities, the prefix cache, and each row's next token."""
        chosen: list[_Slot] = []
        rows: list[int] = []
        for (slot, n), (a, b) in zip(segments, spans, strict=True):
            was_prefilling, start = slot.prefilling, slot.length
            slot.length += n
            self._register(slot)
            request = slot.request
            if was_prefilling and request.echo and not slot.resumed:
                self._prompt_logprobs(request, scores[a:b], start)
            if was_prefilling and slot.prefilling:
                continue  # more of its prompt to come
            if was_prefilling and slot.resumed:
                slot.resumed = False
                self._join_speculation(slot)
                continue
            if was_prefilling and request.score_only:  # (its siblings, if any, end with it: nothing to sample)
                for scored in (request, *request.siblings):
                    scored.prompt_logprobs = list(request.prompt_logprobs)
                    scored.cached_tokens, scored.finish_reason = request.cached_tokens, "length"
                    scored.first_token_at = time.monotonic()
                    self._emit(scored, ("done", "length"))
                continue
            chosen.append(slot)
            rows.append(b - 1)
        if not chosen:
            return 0
        scores = scores[rows]  # (C, V) in the order of ``chosen``
        tokens = self._choose_rows(chosen, scores)
        source = list(range(len(chosen)))  # each chosen slot's row of ``scores``
        for i, slot in enumerate(list(chosen)):
            if slot.last >= 0:
                continue
            self._join_speculation(slot)  # its prompt just ended: this is its first token
            for sibling in slot.request.siblings:  # n samples: the others fork its blocks and choose from its logits
                fork = self._fork(slot, sibling)
                chosen.append(fork)
                tokens.append(self._choose(fork, scores[i:i + 1])[0])
                source.append(i)
        for slot, token, row in zip(chosen, tokens, source, strict=True):
            if slot.request.logprobs is not None:
                slot.request.token_logprobs.extend(token_entries(scores[row:row + 1], [token], slot.request.logprobs))
        return self._deliver(chosen, [[t] for t in tokens])

    # --- blocks -------------------------------------------------------------------------------------------------

    def _reserve(self, segments: list[tuple[_Slot, int]]) -> list[tuple[_Slot, int]]:
        """Give every segment's slot the blocks for its new columns (a shared partial block copied first); when
        none is free, preempt the newest other request (or, the newest itself, this one). -> the segments left."""
        out = []
        for slot, n in segments:
            while slot in self.slots:
                try:
                    self._grow(slot, slot.length + n)
                    out.append((slot, n))
                    break
                except NoFreeBlocks:
                    victim = max(self.slots, key=lambda s: s.order)
                    self._preempt(victim)
        return [(s, n) for s, n in out if s in self.slots]

    def _grow(self, slot: _Slot, columns: int) -> None:
        """Blocks for ``columns`` columns; the partial block the next write lands in made the slot's own."""
        self.blocks.grow(slot.table, slot.length, columns, self.pool.copy_block)

    def _preempt(self, slot: _Slot) -> None:
        """``slot`` gives its blocks back and waits at the head of the queue, to be prefilled again (its prompt and
        the tokens it produced) and continue where it was."""
        self.blocks.release_all(slot.table)
        slot.table, slot.length, slot.registered = [], 0, 0
        request = slot.request
        if request.new_ids:
            slot.feed = request.prompt_ids + request.new_ids[:-1]
            slot.resumed = True
        else:  # (still prefilling its prompt: it starts over)
            slot.feed = list(request.prompt_ids)
            if request.echo:
                request.prompt_logprobs = [None]
        self._remove(self.slots.index(slot))
        self.pending.appendleft(slot)
        self.preemptions += 1

    def _register(self, slot: _Slot) -> None:
        """Register the slot's newly filled blocks in the prefix cache (:meth:`BlockManager.register_run`)."""
        request = slot.request
        n = min(slot.length, len(request.prompt_ids) + len(request.new_ids))  # (a request cut by a stop: its
        #   columns past its tokens)
        if n // self.block_size <= slot.registered or not self.prefix_caching:  # (most steps: no list built)
            slot.registered = max(slot.registered, n // self.block_size)
            return
        slot.registered = self.blocks.register_run(slot.table, (request.prompt_ids + request.new_ids)[:n],
                                                   slot.registered)

    def _fork(self, slot: _Slot, request: Request) -> _Slot:
        """A sibling sample of ``slot``'s request: its blocks shared (the partial last one copied on its first
        write), its own processors and generator; it joins the batch (even past ``max_batch``)."""
        fork = _Slot(request, self._processors(request), self._generator(request.config), feed=slot.feed,
                     table=[self.blocks.fork(b) for b in slot.table], length=slot.length, registered=slot.registered)
        request.cached_tokens = slot.request.cached_tokens
        request.prompt_logprobs = list(slot.request.prompt_logprobs)
        self._admitted += 1
        fork.order = self._admitted
        self.slots.append(fork)
        self._join_speculation(fork)
        return fork

    def _view(self, slots: list[_Slot], counts: list[int] | None):
        width = max(len(s.table) for s in slots)
        device = self.device
        tables = torch.tensor([s.table + [0] * (width - len(s.table)) for s in slots], device=device)
        lengths = torch.tensor([s.length for s in slots], device=device)
        return self.pool.view(tables, lengths, None if counts is None else torch.tensor(counts, device=device))

    def _remove(self, row: int) -> None:
        """Drop the slot of ``row``: the last one moves into it."""
        last = len(self.slots) - 1
        if row != last:
            self.slots[row] = self.slots[last]
            if self.speculator is not None:
                self.speculator.move(row, last)
        self.slots.pop()

    # --- log-probabilities --------------------------------------------------------------------------------------

    def _prompt_logprobs(self, request: Request, scores: Tensor, start: int) -> None:
        """The prompt log-probabilities a chunk's (n, V) scores give: position j's scores score prompt token j + 1
        (the last prompt position's score the first new token instead)."""
        prompt = request.prompt_ids
        n = min(scores.shape[0], len(prompt) - 1 - start)
        if n > 0:
            request.prompt_logprobs.extend(token_entries(scores[:n], prompt[start + 1:start + 1 + n],
                                                         request.logprobs or 0))

    # --- speculative decoding -----------------------------------------------------------------------------------

    def _join_speculation(self, slot: _Slot) -> None:
        """A slot whose prompt is cached joins the drafter (its prompt-lookup table, its draft-model row)."""
        row = self.slots.index(slot)
        if self.speculator is None or row >= self.max_batch:
            slot.speculative = False
            return
        slot.speculative = slot.request.speculative and slot.request.constraint is None
        slot.draft_state = self.speculator.start(row, slot.request, slot.speculative)

    def _speculate(self) -> int | None:
        """A speculative step when a row has drafts and the blocks for them are free: one pass of T positions per
        row verifies every row's drafts. None: a plain step instead."""
        proposal = self.speculator.propose(self.slots, [self._budget(s.request) for s in self.slots])
        if proposal is None:
            return None
        A, T = len(self.slots), proposal.tokens.shape[1] + 1
        try:
            for slot in self.slots:
                self._grow(slot, slot.length + T)
        except NoFreeBlocks:
            return None
        device = self.device
        lengths = torch.tensor([s.length for s in self.slots], device=device)
        counts = proposal.counts
        offsets = torch.minimum(torch.arange(T, device=device)[None], counts[:, None])  # (A, T)
        tokens = torch.tensor([[s.last] for s in self.slots], device=device)
        view = self._view(self.slots, None)
        hidden, _ = self.model.forward_features(torch.cat((tokens, proposal.tokens), 1),
                                                positions=lengths[:, None] + offsets, cache=view)
        scores = self._limited(self.model.forward_head(hidden).reshape(A * T, -1)).view(A, T, -1)
        kept, nxt = accept(self.slots, scores, proposal)
        drafts = proposal.tokens.tolist()
        for b, (slot, c, k) in enumerate(zip(self.slots, counts.tolist(), kept, strict=True)):
            slot.length += k + 1
            slot.request.drafted += c
            slot.request.accepted += k
            if slot.request.logprobs is not None:
                slot.request.token_logprobs.extend(token_entries(scores[b, :k + 1], drafts[b][:k] + [nxt[b]],
                                                                 slot.request.logprobs))
        self.speculator.settle(torch.tensor([s.length for s in self.slots], device=device))
        if self.on_draft is not None:
            self.on_draft(int(counts.sum()), sum(kept))
        produced = self._deliver(self.slots, [row[:k] + [n] for row, k, n in zip(drafts, kept, nxt, strict=True)])
        for slot in self.slots:  # (after the kept drafts joined the requests' tokens)
            self._register(slot)
        return produced

    def _budget(self, request: Request) -> int:
        """The tokens ``request`` may still produce: its ``max_tokens`` and the context."""
        n = len(request.new_ids)
        return min(request.config.max_new_tokens - n, self.max_len - len(request.prompt_ids) - n)

    def _limited(self, logits: Tensor) -> Tensor:
        """(A, V) logits as float32, ids past the tokenizer's vocabulary never chosen."""
        return limit_vocabulary(logits, self.vocab_limit)

    def _choose_rows(self, slots: list[_Slot], scores: Tensor) -> list[int]:
        """Each slot's next token from its row of the (C, V) float32 ``scores`` (the vocabulary limited): plain
        greedy rows by one argmax, the others as :meth:`_choose`."""
        plain = [i for i, s in enumerate(slots) if s.request.config.greedy and not s.processors]
        out = [0] * len(slots)
        if plain:
            for i, token in zip(plain, scores[plain].argmax(-1).tolist(), strict=True):
                out[i] = token
        for i, slot in enumerate(slots):
            if not (slot.request.config.greedy and not slot.processors):
                out[i] = self._choose(slot, scores[i:i + 1])[0]
        return out

    def _choose(self, slot: _Slot, scores: Tensor) -> list[int]:
        """(1, V) float32 scores (past the tokenizer's vocabulary already -inf) -> the next token, as generate()
        chooses it for one row."""
        request = slot.request
        history = torch.tensor([request.prompt_ids + request.new_ids], device=self.device) if slot.processors else None
        return choose_next(scores, history, slot.processors, request.config.greedy, slot.generator)[:, 0].tolist()

    def _deliver(self, slots: list[_Slot], tokens: list[list[int]]) -> int:
        """Hand each slot's new tokens to its request, one by one as plain decoding would, up to the first that
        ends it (EOS, a stop string, ``max_tokens``, the context full), and emit the text that became final.
        -> the tokens taken."""
        now, taken = time.monotonic(), 0
        for slot, new in zip(slots, tokens, strict=True):
            request = slot.request
            if request.finish_reason is not None:
                continue
            if request.first_token_at is None:
                request.first_token_at = now
            slot.last = new[-1]
            reason, used = self._take(request, new)
            taken += used
            if request.logprobs is not None:  # (an EOS, or tokens past a stop, have no entry)
                del request.token_logprobs[len(request.new_ids):]
            text = self.tokenizer.decode(request.new_ids)
            cut = _stop_at(text, request.stop_strings)
            if cut >= 0:
                text, reason = text[:cut], "stop"
            if reason is None:  # hold back what could still become a stop string, and a partial character
                hold = max((len(s) - 1 for s in request.stop_strings), default=0)
                text = text[:max(0, len(text) - hold)]
                if text.endswith("\ufffd"):
                    text = text[:-1]
            if len(text) > request.sent_chars:
                self._emit(request, ("delta", text[request.sent_chars:]))
                request.sent_chars = len(text)
            if reason is not None:
                request.finish_reason = reason
                self._emit(request, ("done", reason))
            elif request.deadline is not None and now > request.deadline:
                request.finish_reason = "timeout"
                self._emit(request, ("error", "the request took longer than the server's request timeout"))
        return taken

    def _take(self, request: Request, tokens: list[int]) -> tuple[str | None, int]:
        """Append ``tokens`` to the request's new ones up to the first that ends it: -> (``stop`` (EOS, not
        appended, or a stop string), ``length`` (``max_tokens``, the context full) or None; the tokens used)."""
        for used, token in enumerate(tokens, 1):
            if self.eos is not None and token == self.eos:
                return "stop", used
            request.new_ids.append(token)
            if request.constraint is not None:  # complete, and nothing may follow (no EOS to end it otherwise)
                request.constraint.update(torch.tensor([request.prompt_ids + request.new_ids]))
                if request.constraint.done:
                    return "stop", used
            if len(tokens) > 1 and request.stop_strings and \
                    _stop_at(self.tokenizer.decode(request.new_ids), request.stop_strings) >= 0:
                return "stop", used  # (one token: the caller's own check finds it)
            if len(request.new_ids) >= request.config.max_new_tokens or \
                    len(request.prompt_ids) + len(request.new_ids) >= self.max_len:
                return "length", used  # max_tokens, or the context is full
        return None, len(tokens)

    def _emit(self, request: Request, event: tuple) -> None:
        if self.dispatch is None:
            request.emit(event)
        else:
            self._events.append((request.emit, event))

    def _flush(self) -> None:
        if self._events:
            events, self._events = self._events, []
            self.dispatch(events)

    def _release(self) -> None:
        """Hand over the step's events; release the blocks of finished and cancelled requests (a cancelled request
        still prefilling hands its slot to its first live sibling)."""
        self._flush()
        row = 0
        while row < len(self.slots):
            slot = self.slots[row]
            request = slot.request
            if request.finish_reason is None and not request.cancelled:
                row += 1
                continue
            heir = self._heir(request) if slot.last < 0 else None  # (siblings fork after the prompt's prefill)
            if heir is not None:
                self._hand_over(slot, heir)
                continue
            self.blocks.release_all(self.slots[row].table)
            self.slots[row].table = []
            self._remove(row)


def _stop_at(text: str, stop_strings: list[str]) -> int:
    """Where the first stop string found in ``text`` starts, or -1."""
    return min((text.find(s) for s in stop_strings if s in text), default=-1)


"""Continuous batching for a causal language model: one engine thread, requests joining and leaving the running
batch between decode steps, over a slot-based preallocated KV cache.

* The cache holds ``max_batch`` rows of the model's full context, per layer (B, Hkv, M, D) keys and values. The
  running requests occupy rows ``0 .. A-1`` (kept contiguous: a finished request's row takes the last row's
  contents), so a decode step runs on views of the first A rows, at each row's own length: the model's own
  forward over the ragged cache strategy (:meth:`tokenloom.nn.KVCache.ragged`). The engine talks to the model
  through the decoding protocol only (``create_cache(..., rolling=False)``: the dense strategy, whose ragged
  view it needs, also for a sliding-window model, whose mask then hides the keys outside the window;
  ``__call__(ids, positions=, cache=)``,
  ``config.max_seq_len`` / ``vocab_size``), so it serves every causal family.
* A new request is prefilled alone (its prompt through the model with its own small cache, copied into a free
  row) between two decode steps; its first token comes from the prefill.
* Each request samples with its own settings and seeded generator (greedy = argmax), exactly as
  :func:`tokenloom.generation.generate` does for one prompt, so greedy output equals offline generation.
* Stop conditions per request: EOS, a stop string (the text is cut before it, as OpenAI does), ``max_tokens``,
  the context full, a deadline (``timeout``), or cancellation (a client that went away): its row is freed
  before the next step.
* The queue of waiting requests is bounded: :meth:`Engine.submit` raises :class:`QueueFull` when it is full.
* Speculative decoding (``draft=``: a :class:`~tokenloom.generation.drafting.PromptLookup` or a draft model): the
  requests that opted in (``Request.speculative``, the default) get drafts, and one pass of T positions per row
  verifies them, each row advancing by the tokens it kept (:mod:`tokenloom.serving.speculation`); a step without
  drafts is a plain one. Greedy output stays the plain output; the stop conditions cut a multi-token advance where
  one-by-one decoding would have stopped.

Events reach the caller through ``request.emit(event)``, called on the engine thread, or, with a ``dispatch``
function, handed over once per step as a list of ``(emit, event)`` pairs (a server's event loop calls them):
``("delta", text)`` as text becomes final, then ``("done", finish_reason)`` with finish_reason ``stop`` | ``length``, or
``("error", message)`` (``timeout``, or a failure of the model).
"""

from __future__ import annotations

import queue
import threading
import time
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
from .speculation import Speculator, accept


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
    echo: bool = False  # also the prompt tokens' log-probabilities (prompt_logprobs): its prefill reads no cached prefix
    score_only: bool = False  # prefill only (echo with max_tokens 0): ends "length" with no new token
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


@dataclass
class _Slot:
    request: Request
    processors: object
    generator: torch.Generator | None
    last: int  # the last token, fed at the next step
    speculative: bool = False  # it gets drafts
    draft_state: object = None  # its drafter's own state (a prompt-lookup table)


class Engine:
    """Continuous batching over ``model`` (a GPT in eval mode) and ``tokenizer``; see the module docstring."""

    def __init__(self, model, tokenizer, max_batch: int = 16, max_queue: int = 64,
                 on_step: Callable[[int, int], None] | None = None,
                 dispatch: Callable[[list[tuple[Callable, tuple]]], None] | None = None,
                 draft=None, num_draft_tokens: int = 4,  # noqa: ANN001 - a draft model or a PromptLookup
                 on_draft: Callable[[int, int], None] | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_len = max_batch, model.config.max_seq_len
        c = model.config
        if getattr(c, "memory_len", 0):
            raise ConfigError(f"a Transformer-XL model (memory_len={c.memory_len}) cannot be served: its memory "
                              "follows one stream of segments, not a batch of independent requests")
        # every layer's keys and values for max_batch rows of the full context, refused in one line when it cannot
        # fit in memory (tokenloom.budget)
        element = next(model.parameters()).element_size()
        check_kv_cache(c, max_batch, self.max_len, element, f"max_batch={max_batch}", error=ConfigError)
        self.vocab_limit = vocabulary_limit(tokenizer, c.vocab_size)
        self.speculator = None if draft is None else \
            Speculator(draft, num_draft_tokens, model, max_batch, self.vocab_limit)
        extra = 0 if self.speculator is None else self.speculator.extra_columns  # a verification's padded positions
        self.cache = model.create_cache(max_batch, self.max_len + extra, rolling=False)
        if not isinstance(self.cache, KVCache):  # continuous batching moves rows of a dense key/value cache
            raise ConfigError(f"{type(model).__name__} models cannot be served: continuous batching needs a key/value "
                              f"cache, and they decode over a {type(self.cache).__name__} (use tokenloom generate)")
        self.device = device_of(model)  # the batch's tokens, positions and caches live beside the weights
        self.lengths = torch.zeros(max_batch, dtype=torch.long, device=self.device)  # cached positions per row
        self.views: dict[int, object] = {}  # running rows -> the cache's first rows as a ragged view
        self.slots: list[_Slot] = []
        self.waiting: queue.Queue[Request] = queue.Queue(maxsize=max_queue)
        self.eos = getattr(tokenizer, "eos_id", None)
        self.on_step = on_step  # (active rows, tokens produced) after every step, for metrics
        self.on_draft = on_draft  # (tokens drafted, drafts kept) after every speculative step, for metrics
        # dispatch: hands one step's events, [(request.emit, event), ...], to the consumer at once (a server's event
        # loop: one wake-up per step instead of one per request); None: each emit is called directly
        self.dispatch = dispatch
        self._events: list[tuple[Callable, tuple]] = []
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
        return self.waiting.qsize()

    # --- the loop -----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        with torch.inference_mode():
            while not self._stop.is_set():
                try:
                    self._admit()
                    if not self.slots:
                        try:
                            request = self.waiting.get(timeout=0.05)
                        except queue.Empty:
                            continue
                        self._start(request)
                        continue
                    self._step()
                except Exception as error:  # noqa: BLE001 — fail the running requests, keep serving
                    for slot in self.slots:
                        self._emit(slot.request, ("error", f"generation failed: {error}"))
                    self._events, events = [], self._events
                    if self.dispatch is not None and events:
                        try:
                            self.dispatch(events)
                        except Exception:  # noqa: BLE001, S110 — the event loop is gone: nothing to tell
                            pass
                    self.slots.clear()

    def _admit(self) -> None:
        while len(self.slots) < self.max_batch:
            try:
                request = self.waiting.get_nowait()
            except queue.Empty:
                return
            self._start(request)

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (``/health`` answers 503 once it has stopped)."""
        return self._thread.is_alive()

    def _start(self, request: Request) -> None:
        """Prefill ``request`` and emit its first token; whatever fails fails this request (an error event to its
        client), never the engine."""
        slots = len(self.slots)
        try:
            self._prefill(request)
        except Exception as error:  # noqa: BLE001 — one request's settings must not stop every other request
            del self.slots[slots:]  # its row, if it got one
            request.finish_reason = "error"
            self._emit(request, ("error", f"generation failed: {error}"))
            self._flush()

    def _prefill(self, request: Request) -> None:
        """Prefill ``request`` into the next free row and emit its first token."""
        if request.cancelled:
            return
        if request.deadline is not None and time.monotonic() > request.deadline:
            request.finish_reason = "timeout"
            self._emit(request, ("error", "the request waited longer than the server's request timeout"))
            self._flush()
            return
        if len(self.slots) >= self.max_batch:  # (only from _run's blocking get) the batch filled meanwhile
            self.waiting.put(request)
            return
        try:
            ids = torch.tensor([request.prompt_ids], device=self.device)
            cache = self.model.create_cache(1, self.max_len, rolling=False)
            logits = self.model(ids, cache=cache)[0, -1]  # (V,)
            row, T = len(self.slots), ids.shape[1]
            speculative = self.speculator is not None and request.speculative
            state = self.speculator.start(row, request) if self.speculator is not None else None
        except Exception as error:  # noqa: BLE001
            self._emit(request, ("error", f"generation failed: {error}"))
            self._flush()
            return
        self.cache.copy_rows(row, cache, 0, T)
        self.lengths[row] = T
        config = request.config
        generator = None
        if not config.greedy and config.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(config.seed)
        slot = _Slot(request, create_processors(config), generator, last=-1, speculative=speculative,
                     draft_state=state)
        self.slots.append(slot)
        token = self._choose(slot, self._limited(logits[None]))[0]
        self._deliver([slot], [[token]])
        if self.on_step is not None:
            self.on_step(len(self.slots), 1)
        self._release()

    def _step(self) -> None:
        A = len(self.slots)
        tokens = torch.tensor([[s.last] for s in self.slots], device=self.device)  # (A, 1)
        if A not in self.views:
            self.views[A] = self.cache.ragged(A, self.lengths[:A])
        lengths = self.lengths[:A]
        proposal = None
        if self.speculator is not None:
            proposal = self.speculator.propose(self.slots, [self._budget(s.request) for s in self.slots])
        if proposal is None:
            logits = self.model(tokens, positions=lengths[:, None], cache=self.views[A])[:, 0]  # (A, V)
            self.lengths[:A] += 1
            produced = self._deliver(self.slots, [[token] for token in self._choose_all(logits)])
        else:
            produced = self._verify(tokens, proposal)
        if self.on_step is not None:
            self.on_step(A, produced)
        self._release()

    def _budget(self, request: Request) -> int:
        """The tokens ``request`` may still produce: its ``max_tokens`` and the context."""
        n = len(request.new_ids)
        return min(request.config.max_new_tokens - n, self.max_len - len(request.prompt_ids) - n)

    def _verify(self, tokens: Tensor, proposal) -> int:  # noqa: ANN001 - a speculation.Proposal
        """One pass over each row's newest token (A, 1) and its drafts (T positions per row, written from its own
        length; a row's positions past its drafts are padding, at its last real position); each row advances by
        the drafts it keeps and the model's next token. -> the tokens produced."""
        A, T = len(self.slots), proposal.tokens.shape[1] + 1
        lengths, counts = self.lengths[:A], proposal.counts
        offsets = torch.minimum(torch.arange(T, device=self.device)[None], counts[:, None])  # (A, T)
        logits = self.model(torch.cat((tokens, proposal.tokens), 1), positions=lengths[:, None] + offsets,
                            cache=self.views[A])  # (A, T, V)
        scores = self._limited(logits.reshape(A * T, -1)).view(A, T, -1)
        kept, nxt = accept(self.slots, scores, proposal)
        self.lengths[:A] += torch.tensor(kept, device=self.device) + 1
        self.speculator.settle(self.lengths[:A])
        drafts = proposal.tokens.tolist()
        for slot, c, k in zip(self.slots, counts.tolist(), kept, strict=True):
            slot.request.drafted += c
            slot.request.accepted += k
        if self.on_draft is not None:
            self.on_draft(int(counts.sum()), sum(kept))
        return self._deliver(self.slots, [row[:k] + [n] for row, k, n in zip(drafts, kept, nxt, strict=True)])

    def _limited(self, logits: Tensor) -> Tensor:
        """(A, V) logits as float32, ids past the tokenizer's vocabulary never chosen."""
        return limit_vocabulary(logits, self.vocab_limit)

    def _choose_all(self, logits: Tensor) -> list[int]:
        logits = self._limited(logits)
        plain = [i for i, s in enumerate(self.slots) if s.request.config.greedy and not s.processors]
        out = [0] * len(self.slots)
        if plain:
            best = logits[plain].argmax(-1).tolist()
            for i, token in zip(plain, best, strict=True):
                out[i] = token
        for i, slot in enumerate(self.slots):
            if not (slot.request.config.greedy and not slot.processors):
                out[i] = self._choose(slot, logits[i:i + 1])[0]
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
        """Hand over the step's events; free the rows of finished and cancelled requests, moving the last rows
        into them."""
        self._flush()
        row = 0
        while row < len(self.slots):
            request = self.slots[row].request
            if request.finish_reason is None and not request.cancelled:
                row += 1
                continue
            last = len(self.slots) - 1
            if row != last:
                n = int(self.lengths[last])
                self.cache.copy_rows(row, self.cache, last, n)
                self.lengths[row] = self.lengths[last]
                self.slots[row] = self.slots[last]
                if self.speculator is not None:
                    self.speculator.move(row, last)
            self.slots.pop()


def _stop_at(text: str, stop_strings: list[str]) -> int:
    """Where the first stop string found in ``text`` starts, or -1."""
    return min((text.find(s) for s in stop_strings if s in text), default=-1)

"""Constrained decoding: OpenAI's ``response_format`` (JSON object, JSON schema) and regex / choice constraints.

:func:`build_constraint` compiles a constraint once per (tokenizer, kind, spec) -- kept in an LRU of the last
``CACHE_SIZE`` -- into an index over the tokenizer's vocabulary (`outlines-core <https://github.com/dottxt-ai/
outlines-core>`_: a JSON schema becomes a regex, the regex a DFA, the DFA a token-level index) and returns a fresh
:class:`Constraint` for one request. A constraint is a logits processor
``(input_ids (1, S), scores (1, V)) -> scores`` that sets every token the constraint does not allow next to
``-inf``::

    constraint = build_constraint(tok, model.config.vocab_size, json_schema=schema, eos_id=tok.eos_id)
    scores = constraint(input_ids, scores)   # each step, before choosing the next token

It is stateful, one per request (batch of 1): the first call takes ``input_ids`` as the prompt (it constrains only
what follows), each later call advances the automaton over the tokens appended since the previous call (one or
more). Once the text so far is a complete match, ``eos_id`` is allowed too, and it is the only token allowed when
nothing may follow; :attr:`Constraint.done` says so (with no ``eos_id``, stop decoding there).

Limits:

* Speculative decoding (several candidate rows per call) and beam search do not fit a per-request automaton that
  only moves forward: constrained requests decode one token at a time (set ``speculative`` off for them).
* A character-level tokenizer constrains only text made of its characters: Tiny Shakespeare's 65 characters have no
  ``{``, ``"``, ``[`` nor most digits, so JSON needs a byte-level BPE tokenizer (:class:`ConstraintError` says which
  character is missing).
* JSON follows outlines-core's subset of JSON Schema (``type``, ``properties`` in the schema's order, ``required``,
  ``enum``, ``const``, ``anyOf``/``oneOf``/``allOf``, local ``$ref``, string ``minLength``/``maxLength``/``pattern``/
  ``format``, array ``items``/``minItems``/``maxItems``); numeric ``minimum``/``maximum`` are not enforced (validate
  the result where they matter). The JSON text has at most one space between its tokens, strings no ``\\uXXXX``
  escapes, and objects the schema leaves open (``json_object``) nest at most 3 deep. ``json_object`` takes about
  3 s to compile (once per tokenizer: build it at startup to have it cached).
* Regexes use Rust ``regex`` syntax and must match the whole generated text (a leading ``^`` and a trailing ``$`` are
  dropped); look-around and back-references do not compile.
* Tokenizers: character-level, byte-level BPE (GPT-2 style) and SentencePiece-style (``▁`` for spaces, byte
  fallback ``<0xNN>``) ones; special tokens, ``eos_id`` and tokens holding private-use characters U+100000..U+10FFFF
  are never allowed inside the constrained text. WordPiece is not supported.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..grammar.compile import (
    MARKER,
    MARKER_LEAD,
    Compiled,
    ConstraintError,
    Vocabulary,
    compile_grammar,
    library,
    one_line,
)

CACHE_SIZE = 32  # compiled constraints kept (LRU)
_VOCAB_CACHE_SIZE = 8  # tokenizer vocabularies kept (LRU)


# ---- vocabulary: token id -> the bytes it stands for ----------------------------------------------------------------

def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_types(spec: dict | None) -> list[dict]:
    """The decoders of a tokenizer.json ``decoder`` entry (a ``Sequence`` flattened)."""
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [d for inner in spec.get("decoders", []) for d in _decoder_types(inner)]
    return [spec]


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer) -> dict[int, bytes]:
    """Token id -> the bytes the token adds to the decoded text, for every ordinary token of ``tokenizer`` (a tokenloom
    :class:`~tokenloom.data.tokenizers.Tokenizer` or a Hugging Face ``tokenizers.Tokenizer``); special tokens, the
    unknown token and tokens that decode to nothing are left out."""
    backend = getattr(tokenizer, "backend", tokenizer)
    try:  # the decoder's and the model's settings (not the whole tokenizer.json: its merges are slow to serialize)
        decoder = backend.decoder
        decoders = _decoder_types(json.loads(decoder.__getstate__()) if decoder is not None else None)
        model_type = type(backend.model).__name__
        vocab = backend.get_vocab(with_added_tokens=False)
        added = backend.get_added_tokens_decoder()
    except AttributeError:
        raise ConstraintError(f"constrained decoding needs a tokenizer over a tokenizer.json, got "
                              f"{type(tokenizer).__name__}") from None
    kinds = {d.get("type") for d in decoders}
    if model_type == "WordPiece" or "WordPiece" in kinds:
        raise ConstraintError("constrained decoding does not support WordPiece tokenizers (their '##' pieces join "
                              "words only when decoded together)")
    if "ByteLevel" in kinds:
        alphabet = _byte_level_decoder()

        def to_bytes(token: str) -> bytes | None:
            try:
                return bytes(alphabet[ch] for ch in token)
            except KeyError:  # not a byte-level token
                return token.encode("utf-8")
    else:
        replace: list[tuple[str, str]] = []
        for d in decoders:
            if d.get("type") == "Metaspace":
                replace.append((d.get("replacement", "▁"), " "))
            elif d.get("type") == "Replace" and "String" in (d.get("pattern") or {}):
                replace.append((d["pattern"]["String"], d.get("content", "")))
        byte_fallback = bool(getattr(backend.model, "byte_fallback", False)) or "ByteFallback" in kinds

        def to_bytes(token: str) -> bytes | None:
            if byte_fallback and (m := _BYTE_TOKEN.fullmatch(token)):
                return bytes([int(m.group(1), 16)])
            for old, new in replace:
                token = token.replace(old, new)
            return token.encode("utf-8")

    unknown = {vocab.get(getattr(backend.model, "unk_token", None) or "")}  # the unknown token is no text
    if model_type == "Unigram":
        unknown.add(json.loads(backend.model.__getstate__()).get("unk_id"))
    out = {}
    for token, idx in vocab.items():
        if idx not in unknown and (data := to_bytes(token)):
            out[idx] = data
    for idx, token in added.items():  # added tokens: a special one is never text; an ordinary one is its content
        out.pop(idx, None)
        if not token.special and token.content:
            out[idx] = token.content.encode("utf-8")
    return out


@dataclass
class _Vocabulary:
    """outlines-core's vocabulary of a tokenizer within ``vocab_size`` ids, with two stand-in ids past them: the
    library's EOS (never emitted: :class:`Constraint` handles the real one) and the end marker's token (its only
    spelling)."""

    backend: object  # kept so that the cache key (its id) cannot be reused while this entry lives
    vocabulary: Vocabulary


_vocab_cache: OrderedDict[Hashable, _Vocabulary] = OrderedDict()
_index_cache: OrderedDict[Hashable, Compiled] = OrderedDict()
_cache_lock = threading.Lock()


def _cached(cache: OrderedDict, key: Hashable):
    with _cache_lock:
        value = cache.get(key)
        if value is not None:
            cache.move_to_end(key)
        return value


def _store(cache: OrderedDict, key: Hashable, value, size: int):
    with _cache_lock:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > size:
            cache.popitem(last=False)
    return value


def _vocabulary(tokenizer, vocab_size: int, eos_id: int | None) -> tuple[Hashable, _Vocabulary]:
    backend = getattr(tokenizer, "backend", tokenizer)
    key = (id(backend), vocab_size, eos_id)
    if (found := _cached(_vocab_cache, key)) is not None:
        return key, found
    oc = library()
    pieces = {i: b for i, b in token_bytes(tokenizer).items()
              if 0 <= i < vocab_size and i != eos_id and MARKER_LEAD not in b}
    if not pieces:
        raise ConstraintError(f"the tokenizer has no text tokens below the model's vocab_size={vocab_size}")
    grouped: dict[bytes, list[int]] = {}
    for idx, data in pieces.items():
        grouped.setdefault(data, []).append(idx)
    first_free = max(vocab_size, max(pieces) + 1)
    marker_id = first_free + 1  # first_free: the library's EOS
    grouped[MARKER.encode()] = [marker_id]
    entry = _Vocabulary(backend, Vocabulary(oc.Vocabulary(first_free, grouped), marker_id))
    return key, _store(_vocab_cache, key, entry, _VOCAB_CACHE_SIZE)


# ---- compiling ------------------------------------------------------------------------------------------------------

def _spec(json_schema, json_object, regex, choice) -> tuple[str, str, str]:
    """(kind, canonical spec, what) of the one constraint asked for."""
    given = [name for name, value in (("json_schema", json_schema), ("json_object", json_object or None),
                                      ("regex", regex), ("choice", choice)) if value is not None]
    if len(given) != 1:
        raise ConstraintError(f"give exactly one of json_schema, json_object, regex, choice; got "
                              f"{', '.join(given) if given else 'none'}")
    if json_schema is not None:
        if not isinstance(json_schema, dict):
            raise ConstraintError(f"json_schema must be a JSON object (a dict), got {type(json_schema).__name__}")
        try:
            text = json.dumps(json_schema, ensure_ascii=False)  # key order kept: it is the properties' order
        except (TypeError, ValueError) as err:
            raise ConstraintError(f"json_schema is not JSON: {one_line(err)}") from None
        return "json_schema", text, "json_schema"
    if json_object:
        return "json_object", '{"type": "object"}', "json_object"
    if regex is not None:
        if not isinstance(regex, str):
            raise ConstraintError(f"regex must be a string, got {type(regex).__name__}")
        return "regex", regex, f"regex {one_line(repr(regex))}"
    if isinstance(choice, str) or not isinstance(choice, Sequence):
        raise ConstraintError(f"choice must be a list of strings, got {type(choice).__name__}")
    if not choice:
        raise ConstraintError("choice must list at least one string, got an empty list")
    bad = [c for c in choice if not isinstance(c, str)]
    if bad:
        raise ConstraintError(f"choice must list strings, got {one_line(repr(bad[0]))}")
    return "choice", json.dumps(sorted(set(choice)), ensure_ascii=False), f"choice of {len(set(choice))}"


@dataclass(frozen=True)
class GrammarJob:
    """One constraint asked for, checked and ready to compile (:func:`grammar_job`): what a compiler needs (the
    vocabulary, the canonical spec) and the cache key. ``compiled = job.cached() or job.store(compiler(job))``, then
    ``job.constraint(compiled)`` per request; the compiler is :func:`compile_grammar` in-process
    (:func:`build_constraint`) or a killable worker (:class:`~tokenloom.grammar.worker.GrammarWorkers`, the
    server)."""

    key: Hashable
    vocabulary: Vocabulary
    kind: str  # json_schema, json_object, regex or choice
    spec: str  # canonical: the cache key's part
    what: str  # e.g. "regex '[a-z]+'", for messages
    vocab_size: int
    eos_id: int | None

    def cached(self) -> Compiled | None:
        return _cached(_index_cache, self.key)

    def store(self, compiled: Compiled) -> Compiled:
        return _store(_index_cache, self.key, compiled, CACHE_SIZE)

    def constraint(self, compiled: Compiled) -> Constraint:
        """A new :class:`Constraint` over ``compiled`` (this job's), for one request."""
        return Constraint(compiled, self.vocab_size, self.eos_id)


def grammar_job(tokenizer, vocab_size: int, *, json_schema: dict | None = None, json_object: bool = False,
                regex: str | None = None, choice: list[str] | None = None, eos_id: int | None) -> GrammarJob:
    """The :class:`GrammarJob` of :func:`build_constraint`'s arguments (checked: :class:`ConstraintError`); compiles
    nothing (the tokenizer's vocabulary is read once and cached)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ConstraintError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int)
                               or not 0 <= eos_id < vocab_size):
        raise ConstraintError(f"eos_id must be an id in [0, {vocab_size}) or None, got {eos_id!r}")
    kind, spec, what = _spec(json_schema, json_object, regex, choice)
    vocab_key, vocab = _vocabulary(tokenizer, vocab_size, eos_id)
    return GrammarJob((vocab_key, kind, spec), vocab.vocabulary, kind, spec, what, vocab_size, eos_id)


def build_constraint(tokenizer, vocab_size: int, *, json_schema: dict | None = None, json_object: bool = False,
                     regex: str | None = None, choice: list[str] | None = None, eos_id: int | None) -> Constraint:
    """A new :class:`Constraint` for one request: exactly one of ``json_schema`` (a JSON Schema, e.g. OpenAI's
    ``response_format.json_schema.schema``), ``json_object`` (any JSON object: ``{"type": "json_object"}``),
    ``regex`` (the whole generated text matches it) or ``choice`` (the text is exactly one of the strings).

    ``tokenizer`` is a tokenloom ``Tokenizer`` (or a Hugging Face ``tokenizers.Tokenizer``), ``vocab_size`` the
    model's logits width (ids the tokenizer does not have are never allowed), ``eos_id`` the token that ends the
    text once it matches (None: no such token; watch :attr:`Constraint.done`). The compiled index is cached per
    tokenizer and spec (LRU of ``CACHE_SIZE``), so only a new spec pays the compile time. Raises
    :class:`ConstraintError` (one line) for a spec that does not compile or that the vocabulary cannot express.
    The compile runs here, unbounded in time and memory; a server compiles a :func:`grammar_job` in a killable
    worker instead (:class:`~tokenloom.grammar.worker.GrammarWorkers`)."""
    job = grammar_job(tokenizer, vocab_size, json_schema=json_schema, json_object=json_object, regex=regex,
                      choice=choice, eos_id=eos_id)
    compiled = job.cached() or job.store(compile_grammar(job.vocabulary, job.kind, job.spec, job.what))
    return job.constraint(compiled)


def clear_cache() -> None:
    """Forget every compiled constraint and vocabulary (e.g. after loading another tokenizer)."""
    with _cache_lock:
        _index_cache.clear()
        _vocab_cache.clear()


# ---- following ------------------------------------------------------------------------------------------------------

_SHIFTS: dict[torch.device, Tensor] = {}


class Constraint:
    """A logits processor that keeps one request's text inside a compiled constraint (see the module docstring).
    Stateful: make one per request with :func:`build_constraint`; it accepts batches of one row only."""

    def __init__(self, compiled: Compiled, vocab_size: int, eos_id: int | None) -> None:
        self._compiled, self.vocab_size, self.eos_id = compiled, vocab_size, eos_id
        self._guide = library().Guide(compiled.index, max_rollback=0)
        self._bits = torch.empty(compiled.words, dtype=torch.int32)
        self._prompt_len: int | None = None
        self._seen = 0  # tokens of input_ids already followed
        self._ended = False  # EOS was appended

    @property
    def prompt_len(self) -> int | None:
        """The length of ``input_ids`` at the first call (the prompt), None before it."""
        return self._prompt_len

    @property
    def is_complete(self) -> bool:
        """The text so far matches the whole constraint (EOS may follow)."""
        return self._ended or self._compiled.is_final(self._guide.get_state())

    @property
    def done(self) -> bool:
        """Nothing may follow but EOS: the text is complete and cannot grow (or EOS was appended)."""
        if self._ended:
            return True
        return self.is_complete and set(self._guide.get_tokens()) <= {self._compiled.marker_id}

    def __repr__(self) -> str:
        return f"Constraint({self._compiled.what}, prompt_len={self._prompt_len}, generated={self.generated})"

    @property
    def generated(self) -> int:
        """Tokens followed since the prompt."""
        return 0 if self._prompt_len is None else self._seen - self._prompt_len

    def _advance(self, token: int) -> None:
        if self._ended:  # padding after EOS
            return
        if token == self.eos_id and self.is_complete:
            self._ended = True
            return
        try:
            self._guide.advance(token, return_tokens=False)
        except (ValueError, OverflowError, TypeError):
            raise ConstraintError(f"token {token} does not follow the {self._compiled.what} here (after "
                                  f"{self.generated} constrained tokens)") from None

    def allowed(self, device: torch.device | str = "cpu") -> Tensor:
        """(vocab_size,) bool: the tokens allowed next."""
        if self._ended:
            allowed = torch.zeros(self.vocab_size, dtype=torch.bool, device=device)
            if self.eos_id is not None:
                allowed[self.eos_id] = True
            return allowed
        bits = self._bits
        self._guide.write_mask_into(bits.data_ptr(), bits.numel(), 4)
        device = torch.device(device)
        shifts = _SHIFTS.get(device)
        if shifts is None:
            shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
        words = bits.to(device, non_blocking=False)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(-1)[:self.vocab_size].bool()
        if self.eos_id is not None and self.is_complete:
            allowed[self.eos_id] = True
        return allowed

    def update(self, input_ids: Tensor) -> None:
        """Follow the tokens appended to ``input_ids`` (1, S) since the last call (the first call records the prompt).
        ``__call__`` does this first; call it directly to read :attr:`done` right after appending a token."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ConstraintError(f"a constraint follows one request (a batch of 1), got input_ids of shape "
                                  f"{tuple(input_ids.shape)}; constrained requests cannot use speculative decoding "
                                  "or beam search")
        n = input_ids.shape[1]
        if self._prompt_len is None:
            self._prompt_len = self._seen = n
        elif n < self._seen:
            raise ConstraintError(f"input_ids got shorter ({n} tokens after {self._seen}): a constraint only moves "
                                  "forward; build a new one for a new request")
        elif n > self._seen:
            for token in input_ids[0, self._seen:].tolist():
                self._advance(token)
            self._seen = n

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if scores.dim() != 2 or scores.shape[0] != 1:
            raise ConstraintError(f"a constraint follows one request (a batch of 1), got scores of shape "
                                  f"{tuple(scores.shape)}; constrained requests cannot use speculative decoding "
                                  "or beam search")
        self.update(input_ids)
        allowed = self.allowed(scores.device)
        if not bool(allowed.any()):
            if self.is_complete:
                raise ConstraintError(f"the {self._compiled.what} is complete and there is no EOS token to end it: "
                                      "stop decoding once constraint.done")
            raise ConstraintError(f"no token of the vocabulary can continue the {self._compiled.what} here")
        width = scores.shape[-1]
        if width != self.vocab_size:  # logits narrower / wider than the vocabulary the constraint was built for
            fitted = torch.zeros(width, dtype=torch.bool, device=scores.device)
            fitted[:min(width, self.vocab_size)] = allowed[:width]
            allowed = fitted
        return scores.masked_fill(~allowed, float("-inf"))

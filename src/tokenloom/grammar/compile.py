"""Compiling one grammar (a regex, a JSON schema, a choice list) into outlines-core's token-level index over a
vocabulary: :func:`compile_grammar`, the one body that runs in-process (offline ``build_constraint``) or in a killable
worker process (:mod:`tokenloom.grammar.worker`, the server). Imports neither torch nor the rest of tokenloom, so a
worker starts in a fraction of a second."""

from __future__ import annotations

import itertools
import json
import pickle
import re
from dataclasses import dataclass, field

from ..errors import TokenloomError

MAX_DETAIL = 160  # characters of a library message quoted in an error
# The end marker appended to every regex: outlines-core 0.2's index drops a token that takes a complete match on to a
# longer, not yet complete text (regex-automata reports a match one byte late), e.g. "a" after "ab" for (ab)+. With
# the marker no prefix of the text is a complete match, so every continuation stays, and a state is final when the
# marker may follow it. The marker is U+10FFFF, spelled only by a stand-in token: tokens holding its lead byte 0xF4
# (in UTF-8 text: the private-use characters U+100000..U+10FFFF alone) are left out, so none can start it.
MARKER = "\U0010ffff"
MARKER_LEAD = 0xF4


class ConstraintError(TokenloomError, ValueError):
    """A constraint cannot be built (a schema or regex that does not compile, an empty choice list, a tokenizer
    whose vocabulary cannot express it) or followed; ``str(err)`` is one line."""


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= MAX_DETAIL else text[:MAX_DETAIL - 3] + "..."


def library():  # noqa: ANN201 - the outlines_core module
    try:
        import outlines_core
    except ImportError:
        raise ConstraintError("constrained decoding needs outlines-core, which is not installed "
                              "(pip install 'tokenloom[serve]' or pip install outlines-core)") from None
    return outlines_core


_serials = itertools.count()


@dataclass(eq=False)
class Vocabulary:
    """outlines-core's vocabulary of a tokenizer (``index_vocabulary``: the ids of the bytes each token spells) with
    the id of the one token spelling :data:`MARKER`; ``serial`` names it in a worker (unique in this process)."""

    index_vocabulary: object  # an outlines_core.Vocabulary
    marker_id: int
    serial: int = field(default_factory=lambda: next(_serials))
    _pickled: bytes | None = field(default=None, repr=False)

    def pickled(self) -> bytes:
        """The outlines-core vocabulary pickled (once), as a worker receives it."""
        if self._pickled is None:
            self._pickled = pickle.dumps(self.index_vocabulary)
        return self._pickled


@dataclass
class Compiled:
    """A compiled constraint, shared by every request with the same tokenizer and spec (picklable: a worker process
    sends it back whole; outlines-core's ``Index`` pickles as its binary form)."""

    index: object
    what: str  # e.g. "regex '[a-z]+'", for messages
    marker_id: int
    words: int  # int32 words of a token bitmask (the library's ids included)
    _finals: set = field(default_factory=set)
    _final: dict = field(default_factory=dict)  # state -> whether the text there is a complete match

    def is_final(self, state: int) -> bool:
        final = self._final.get(state)
        if final is None:
            after = self.index.get_next_state(state, self.marker_id)
            final = self._final[state] = after is not None and after in self._finals
        return final


def escape(text: str) -> str:
    """``text`` as a literal Rust regex."""
    return "".join(ch if ch.isascii() and ch.isalnum() else f"\\x{{{ord(ch):X}}}" for ch in text)


def strip_anchors(regex: str) -> str:
    if regex.startswith("^"):
        regex = regex[1:]
    body = regex[:-1]
    if regex.endswith("$") and (len(body) - len(body.rstrip("\\"))) % 2 == 0:  # not an escaped \$
        regex = body
    return regex


_UNICODE_DIGIT = re.compile(r"(?<!\\)((?:\\\\)*)\\d")  # an unescaped \d


def regex_of(kind: str, spec: str) -> str:
    """The regex of a canonical spec (``kind``: json_schema, json_object, regex or choice)."""
    if kind in ("json_schema", "json_object"):
        try:
            regex = library().json_schema.build_regex_from_schema(spec)
        except (ValueError, TypeError, OverflowError) as err:
            raise ConstraintError(f"json_schema does not compile: {one_line(err)}") from None
        # the formats' \d (date, time, date-time) is any Unicode digit in Rust's regex: JSON wants 0-9
        return _UNICODE_DIGIT.sub(r"\1[0-9]", regex)
    if kind == "regex":
        return strip_anchors(spec)
    return "|".join(escape(c) for c in json.loads(spec))


def compile_grammar(vocabulary: Vocabulary, kind: str, spec: str, what: str) -> Compiled:
    """The index of the spec (``kind``, canonical ``spec``, ``what`` for messages) over ``vocabulary``. Raises
    :class:`ConstraintError` (one line) for a spec that does not compile or that the vocabulary cannot express.
    Time and memory are unbounded here: bound them with a worker."""
    oc = library()
    regex = regex_of(kind, spec)
    try:
        index = oc.Index(f"(?:{regex}){escape(MARKER)}", vocabulary.index_vocabulary)
    except (ValueError, TypeError, OverflowError) as err:
        detail = str(err)
        if "incompatible" in detail:
            missing = re.search(r"following characters: \[(.*?)\]", detail)
            lacks = f" (it lacks {missing.group(1)})" if missing else ""
            raise ConstraintError(f"the tokenizer's vocabulary cannot express this {what}{lacks}") from None
        if kind in ("json_schema", "json_object"):
            raise ConstraintError(f"json_schema does not compile: {one_line(err)}") from None
        if kind == "regex":  # Python's message points at the error; Rust's DFA builder only says that it failed
            try:
                re.compile(spec)
            except re.error as py_err:
                raise ConstraintError(f"{what} does not compile: {one_line(py_err)}") from None
            raise ConstraintError(f"{what} does not compile (Rust regex syntax: no look-around, no "
                                  f"back-references): {one_line(err)}") from None
        raise ConstraintError(f"{what} does not compile: {one_line(err)}") from None
    compiled = Compiled(index, what, vocabulary.marker_id, (vocabulary.marker_id + 1 + 31) // 32)
    compiled._finals = set(index.get_final_states())
    return compiled

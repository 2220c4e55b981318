"""Log-probabilities in OpenAI's reply shapes, from the engine's :data:`~tokenloom.serving.engine.TokenLogprob`
entries (``(token id, log-probability, [(alternative id, log-probability), ...])``).

* completions (legacy): ``{"tokens": [str], "token_logprobs": [float | null], "top_logprobs": [{token: logprob} |
  null], "text_offset": [int]}`` (:func:`completion_logprobs`); a ``top_logprobs`` dict holds the k alternatives
  and the chosen token (OpenAI: "up to logprobs + 1 elements"); a prompt's first token (echo) has nulls.
* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``
  (:func:`chat_logprobs`).

A token's string is the token decoded alone; its ``bytes`` the bytes it adds to the text (a byte-level token that is
part of a character has bytes but decodes alone to U+FFFD). A text offset is where the token's text starts in the
returned text, measured by decoding each token after up to :data:`WINDOW` tokens before it (so that SentencePiece's
spaces and characters split over tokens count where they land).

:class:`Choice` follows one choice as its events arrive: which of its tokens the text received so far covers, so a
stream chunk carries the entries of the tokens it completes and a reply those of every token whose text is in it (a
stop string cuts the text: the tokens past the cut have none).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

MAX_LOGPROBS = 20  # completions' logprobs and chat's top_logprobs: alternatives per token at most (OpenAI's limit)
UNLIKELY = -9999.0  # stands for a log-probability of -inf (JSON has no infinity; OpenAI's own stand-in)
WINDOW = 4  # tokens decoded before each token to measure the text it adds

Entry = tuple[int, float, list[tuple[int, float]]]  # the engine's TokenLogprob


def _finite(value: float) -> float:
    return float(value) if math.isfinite(value) else UNLIKELY


def token_text(tokenizer, token_id: int) -> str:  # noqa: ANN001 - a Tokenizer
    """The token decoded alone ("" for an id the tokenizer cannot decode)."""
    try:
        return tokenizer.decode([token_id])
    except Exception:  # noqa: BLE001 — an id past the tokenizer's vocabulary (a padded model): no text
        return ""


@lru_cache(maxsize=4)
def _byte_table(tokenizer) -> dict[int, bytes]:  # noqa: ANN001 - a Tokenizer
    try:
        from ..generation.constraints import token_bytes
        return token_bytes(tokenizer)
    except Exception:  # noqa: BLE001 — a tokenizer it does not read (WordPiece, no tokenizer.json): text bytes
        return {}


def token_bytes(tokenizer, token_id: int) -> list[int]:  # noqa: ANN001 - a Tokenizer
    """The bytes the token adds to the text (special tokens and others the table lacks: their text as UTF-8)."""
    data = _byte_table(tokenizer).get(token_id)
    return list(data if data is not None else token_text(tokenizer, token_id).encode("utf-8"))


def token_widths(tokenizer, ids: list[int], start: int = 0) -> list[int]:  # noqa: ANN001 - a Tokenizer
    """The characters each of ``ids[start:]`` adds to ``tokenizer.decode(ids)``, measured after up to
    :data:`WINDOW` tokens before it (never negative; a token completing a character split over several counts 0
    after the first)."""
    out = []
    for i in range(start, len(ids)):
        a = max(0, i - WINDOW)
        before = len(tokenizer.decode(ids[a:i])) if i > a else 0
        out.append(max(0, len(tokenizer.decode(ids[a:i + 1])) - before))
    return out


Item = tuple[int, "Entry | None", int]  # (token id, its entry or None, its text offset)


def completion_logprobs(tokenizer, items: list[Item]) -> dict[str, list]:  # noqa: ANN001 - a Tokenizer
    """The legacy completions ``logprobs`` object of ``items`` (an entry None: nulls, as a prompt's first token)."""
    tokens, values, tops, offsets = [], [], [], []
    for token, entry, offset in items:
        tokens.append(token_text(tokenizer, token))
        offsets.append(offset)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        _, value, alternatives = entry
        top: dict[str, float] = {}
        for alt, alt_value in alternatives:
            if math.isfinite(alt_value):  # (-inf: an id past the tokenizer's vocabulary, never chosen)
                top.setdefault(token_text(tokenizer, alt), float(alt_value))
        top.setdefault(tokens[-1], _finite(value))
        values.append(_finite(value))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, items: list[Item]) -> dict[str, list]:  # noqa: ANN001 - a Tokenizer
    """The chat ``logprobs`` object of ``items`` (an item without an entry is left out)."""
    def one(token: int, value: float) -> dict[str, Any]:
        return {"token": token_text(tokenizer, token), "logprob": _finite(value),
                "bytes": token_bytes(tokenizer, token)}

    content = []
    for token, entry, _ in items:
        if entry is None:
            continue
        _, value, alternatives = entry
        content.append({**one(token, value), "top_logprobs": [one(alt, alt_value) for alt, alt_value in alternatives
                                                              if math.isfinite(alt_value)]})
    return {"content": content}


FORMATS = {"completions": completion_logprobs, "chat": chat_logprobs}


class Choice:
    """One choice as its engine events arrive: its text (with ``echo``, the prompt text first) and, with ``style``
    (``"completions"`` or ``"chat"``; None: no log-probabilities), the log-probabilities of the tokens its text
    covers. ``request`` is the engine request (its ``new_ids``, ``token_logprobs``, ``prompt_logprobs`` filled by the
    engine thread before the text holding them is emitted)."""

    def __init__(self, index: int, request, tokenizer, style: str | None = None,  # noqa: ANN001
                 echo: str | None = None) -> None:
        self.index, self.request, self.tokenizer, self.style, self.echo = index, request, tokenizer, style, echo
        self.completion = ""  # the completion text received so far
        self.finish_reason: str | None = None
        self.items: list[Item] = []  # every token entry given so far, in order
        self.widths: list[int] = []  # characters each new token adds (measured so far)
        self.given = 0  # new tokens whose entries were given
        self.covered_chars = 0  # characters of the completion the given tokens span
        self.opened = False

    @property
    def base(self) -> int:
        return len(self.echo) if self.echo is not None else 0

    @property
    def text(self) -> str:
        return (self.echo or "") + self.completion

    def open(self) -> tuple[str, dict | None] | None:
        """At the first event (the prompt is prefilled): with ``echo``, the prompt text and its tokens'
        log-probabilities (the first token's entry null); None without echo, or when called again."""
        if self.opened:
            return None
        self.opened = True
        if self.echo is None:
            return None
        if self.style is None:
            return self.echo, None
        ids = list(self.request.prompt_ids)
        entries = list(self.request.prompt_logprobs)
        items, offset = [], 0
        for j, width in enumerate(token_widths(self.tokenizer, ids)):
            items.append((ids[j], entries[j] if j < len(entries) else None, min(offset, len(self.echo))))
            offset += width
        return self.echo, self._give(items)

    def delta(self, text: str) -> dict | None:
        """A text delta: the log-probabilities of the new tokens it completes (None without ``style``)."""
        self.completion += text
        if self.style is None:
            return None
        return self._give(self._covered(final=False))

    def finish(self, reason: str) -> dict | None:
        """The end (``done``): the entries of the tokens not given yet whose text is in the reply (every one when
        no stop string cut the text)."""
        self.finish_reason = reason
        if self.style is None:
            return None
        return self._give(self._covered(final=True))

    def logprobs(self) -> dict | None:
        """Every entry given, as one object (None without ``style``)."""
        return None if self.style is None else FORMATS[self.style](self.tokenizer, self.items)

    def _give(self, items: list[Item]) -> dict:
        self.items.extend(items)
        return FORMATS[self.style](self.tokenizer, items)

    def _covered(self, final: bool) -> list[Item]:
        """The new tokens from ``given`` on that the completion received so far covers whole."""
        request = self.request
        ids = list(request.new_ids)  # (a snapshot: the engine thread may append while this runs)
        entries = request.token_logprobs
        self.widths.extend(token_widths(self.tokenizer, ids, len(self.widths)))
        length = len(self.completion)
        everything = final and length >= len(self.tokenizer.decode(ids))  # no stop string cut the text
        items = []
        while self.given < len(ids):
            end = self.covered_chars + self.widths[self.given]
            if end > length and not everything:
                break
            i = self.given
            items.append((ids[i], entries[i] if i < len(entries) else None, self.base + min(self.covered_chars,
                                                                                            length)))
            self.given, self.covered_chars = i + 1, end
        return items

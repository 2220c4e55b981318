"""Preference data (JSONL): pairs ``{"prompt", "chosen", "rejected"}`` and unpaired ``{"prompt", "completion",
"label"}`` examples, and their encoding into token ids with the response tokens marked.

``prompt`` is a string (one user turn) or a list of messages (``{"role", "content"}``: system / user / assistant
turns before the response); ``chosen``, ``rejected`` and ``completion`` are the assistant's reply (a string);
``label`` is true (desirable) or false (undesirable). A bad line -- not JSON, a key missing, a pair whose chosen
and rejected replies are the same text -- is a one-line :class:`~tokenloom.errors.DataError` naming ``path:line``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DataError
from .chat import ChatTemplate, Message, check_messages
from .jsonl import read_jsonl, record_errors
from .tokenizers import Tokenizer


@dataclass
class Preference:
    """One line of a preference file: a pair (``rejected`` set) or an unpaired example (``desirable`` set)."""

    prompt: list[Message]  # the turns before the reply (at least one)
    chosen: str  # a pair's preferred reply, or an unpaired example's reply
    rejected: str | None = None  # a pair's dispreferred reply; None for an unpaired example
    desirable: bool | None = None  # an unpaired example's label; None for a pair
    where: str = ""  # "path:line", for error messages

    @property
    def paired(self) -> bool:
        return self.rejected is not None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _prompt_messages(prompt: Any, where: str) -> list[Message]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: \"prompt\" must be a string or a non-empty list of {{\"role\", \"content\"}} "
                        f"messages, got {_short(prompt)}")
    return check_messages([*prompt, {"role": "assistant", "content": ""}], where)[:-1]


def parse_preference(obj: Any, where: str, *, unpaired: bool = False) -> Preference:
    """A :class:`Preference` from one decoded JSONL object; ``unpaired`` allows ``completion`` + ``label`` lines."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with \"prompt\", \"chosen\" and \"rejected\", "
                        f"got {_short(obj)}")
    if "prompt" not in obj:
        raise DataError(f"{where}: the line has no \"prompt\"; keys: {', '.join(map(str, obj)) or 'none'}")
    prompt = _prompt_messages(obj["prompt"], where)
    if "completion" in obj or "label" in obj:
        if not unpaired:
            raise DataError(f"{where}: an unpaired \"completion\"/\"label\" line needs data.loss: kto; "
                            "dpo and ipo train on pairs (\"chosen\" and \"rejected\")")
        completion, label = obj.get("completion"), obj.get("label")
        if not isinstance(completion, str):
            raise DataError(f"{where}: \"completion\" must be a string, got {_short(completion)}")
        if not isinstance(label, bool):
            raise DataError(f"{where}: \"label\" must be true (desirable) or false (undesirable), got {_short(label)}")
        return Preference(prompt, completion, desirable=label, where=where)
    for key in ("chosen", "rejected"):
        if key not in obj:
            raise DataError(f"{where}: the line has no \"{key}\"; a pair needs \"prompt\", \"chosen\" and "
                            f"\"rejected\"" + (" (or \"completion\" and \"label\")" if unpaired else ""))
        if not isinstance(obj[key], str):
            raise DataError(f"{where}: \"{key}\" must be a string, got {_short(obj[key])}")
    if obj["chosen"] == obj["rejected"]:
        raise DataError(f"{where}: \"chosen\" and \"rejected\" are the same text ({_short(obj['chosen'])}); "
                        "a preference pair must differ")
    return Preference(prompt, obj["chosen"], obj["rejected"], where=where)


def read_preferences(path: str | Path, *, unpaired: bool = False) -> list[Preference]:
    """Every line of a preference file (blank lines skipped); a one-line :class:`DataError` naming ``path:line``
    for a bad line and ``path`` for a missing or empty file."""
    out = [parse_preference(obj, where, unpaired=unpaired) for where, obj in read_jsonl(path, "preference")]
    if not out:
        raise DataError(f"{path}: no preference lines (the file is empty)")
    return out


def response_span(trained: Sequence[bool]) -> tuple[int, int]:
    """(start, end) of the last run of trained tokens: the final assistant turn (earlier assistant turns of the
    prompt are runs of their own, separated by untrained headers and turns)."""
    end = len(trained)
    while end > 0 and not trained[end - 1]:
        end -= 1
    start = end
    while start > 0 and trained[start - 1]:
        start -= 1
    return start, end


def encode_reply(template: ChatTemplate, tokenizer: Tokenizer, prompt: Sequence[Message], reply: str,
                 max_length: int, where: str = "") -> tuple[list[int], list[bool]]:
    """(ids, trained) of ``prompt`` followed by the assistant's ``reply``, only the reply's tokens (and its end
    marker) trained. Longer than ``max_length``: the prompt loses tokens from its start; a reply that cannot fit
    with one token before it keeps that token and its own first ``max_length - 1`` tokens."""
    with record_errors(where):  # (characters outside the vocabulary: "path:line: ...")
        ids, trained = template.encode(tokenizer, [*prompt, {"role": "assistant", "content": reply}])
    start, end = response_span(trained)
    if start == end or start == 0:
        raise DataError(f"{where}: the chat template gives the reply no tokens after the prompt")
    trained = [start <= i < end for i in range(len(ids))]
    if len(ids) > max_length:
        cut = len(ids) - max_length
        cut = cut if cut <= start - 1 else start - 1  # keep the token that predicts the reply's first one
        ids, trained = ids[cut:cut + max_length], trained[cut:cut + max_length]
    return ids, trained

"""The request fields of ``/v1/completions`` and ``/v1/chat/completions`` as one table, :data:`FIELDS`: for each
field and route, one rule.

* ``IMPLEMENTED``: the route reads and checks it (:mod:`.checks`, :mod:`.routes.completions`).
* ``HARMLESS``: accepted and ignored, because it changes nothing in the result (an end-user id, metadata, storage
  on OpenAI's side, a service tier, a latency hint).
* :class:`Unsupported`: it would change the result and this server does not do it, so a value other than the ones
  that mean "not used" (``best_of`` 1, ``suffix`` null or "", ``tools`` [], ...) is a 400 naming the field
  (``param``, code ``unsupported_parameter``) instead of an answer that silently ignores it.
* ``None``: not a field of that route; like any field the table does not know, accepted.

:func:`check_fields` applies the table to a body; :func:`schema_properties` publishes it (:mod:`.schema`): an
unsupported field's schema is the enum of its accepted values, a harmless one's accepts anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .checks import APIError

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
IMPLEMENTED, HARMLESS = "implemented", "harmless"


@dataclass(frozen=True)
class Unsupported:
    """A field this server does not implement: ``accepted`` are the values that mean "not used" (null is always
    one); ``does`` says what the field would do."""

    does: str
    accepted: tuple[Any, ...] = ()

    def allows(self, value: Any) -> bool:
        return value is None or any(same_json(value, ok) for ok in self.accepted)

    def hint(self) -> str:
        return "leave it out" + ("" if not self.accepted else
                                 " or set it to " + " or ".join(json.dumps(v) for v in self.accepted))


Rule = str | Unsupported | None


def _no(does: str, *accepted: Any) -> Unsupported:
    return Unsupported(does, accepted)


_BOTH_IMPLEMENTED = (IMPLEMENTED, IMPLEMENTED)
_BOTH_HARMLESS = (HARMLESS, HARMLESS)

FIELDS: dict[str, tuple[Rule, Rule]] = {
    # field                   (/v1/completions, /v1/chat/completions)
    # --- OpenAI's fields
    "model": _BOTH_IMPLEMENTED,
    "prompt": (IMPLEMENTED, None),
    "messages": (None, IMPLEMENTED),
    "max_tokens": _BOTH_IMPLEMENTED,
    "max_completion_tokens": _BOTH_IMPLEMENTED,
    "temperature": _BOTH_IMPLEMENTED,
    "top_p": _BOTH_IMPLEMENTED,
    "n": _BOTH_IMPLEMENTED,
    "seed": _BOTH_IMPLEMENTED,
    "stop": _BOTH_IMPLEMENTED,
    "stream": _BOTH_IMPLEMENTED,
    "stream_options": _BOTH_IMPLEMENTED,
    "presence_penalty": _BOTH_IMPLEMENTED,
    "frequency_penalty": _BOTH_IMPLEMENTED,
    "logit_bias": _BOTH_IMPLEMENTED,
    "logprobs": _BOTH_IMPLEMENTED,  # completions: alternatives per token; chat: a boolean
    "top_logprobs": (None, IMPLEMENTED),
    "response_format": _BOTH_IMPLEMENTED,  # (OpenAI's on chat; tokenloom's regex and choice besides)
    "echo": (IMPLEMENTED, _no("the prompt echoed before the reply", False)),
    "best_of": (_no("server-side best-of-n sampling", 1), None),
    "suffix": (_no("text after the insertion point (fill in the middle)", ""), None),
    "tools": (None, _no("function calling", [])),
    "tool_choice": (None, _no("function calling", "none")),
    "functions": (None, _no("function calling (the deprecated form)", [])),
    "function_call": (None, _no("function calling (the deprecated form)", "none")),
    "parallel_tool_calls": (None, HARMLESS),  # no tools: nothing to call in parallel
    "audio": (None, _no("audio output")),
    "modalities": (None, _no("output kinds besides text", ["text"])),
    "reasoning_effort": (None, _no("a reasoning model's effort")),
    "verbosity": (None, _no("the length and detail of the reply", "medium")),
    "web_search_options": (None, _no("web search")),
    "prediction": (None, HARMLESS),  # predicted output: a latency hint, the reply does not depend on it
    "user": _BOTH_HARMLESS,
    "safety_identifier": (None, HARMLESS),
    "prompt_cache_key": (None, HARMLESS),
    "metadata": (None, HARMLESS),
    "store": (None, HARMLESS),
    "service_tier": (None, HARMLESS),
    # --- tokenloom's own
    "top_k": _BOTH_IMPLEMENTED,
    "speculative": _BOTH_IMPLEMENTED,
    # --- other OpenAI-compatible servers' (vLLM's) sampling fields, which clients send to any of them
    "min_p": (_no("min-p sampling", 0),) * 2,
    "repetition_penalty": (_no("a repetition penalty (see presence_penalty, frequency_penalty)", 1),) * 2,
    "length_penalty": (_no("beam search's length penalty", 1),) * 2,
    "use_beam_search": (_no("beam search", False),) * 2,
    "min_tokens": (_no("a minimum number of new tokens", 0),) * 2,
    "ignore_eos": (_no("generation past the end-of-text token", False),) * 2,
    "stop_token_ids": (_no("stop tokens by id", []),) * 2,
    "include_stop_str_in_output": (_no("the stop string kept in the text", False),) * 2,
    "guided_json": (_no("structured output (see response_format)"),) * 2,
    "guided_regex": (_no("structured output (see response_format)"),) * 2,
    "guided_choice": (_no("structured output (see response_format)"),) * 2,
    "guided_grammar": (_no("structured output (see response_format)"),) * 2,
}
ROUTES = (COMPLETIONS, CHAT)


def rules(route: str) -> dict[str, Rule]:
    """The table's column for ``route`` (fields that are not the route's left out); nothing for a route the table
    does not cover (``/v1/rag`` checks its own fields)."""
    if route not in ROUTES:
        return {}
    column = ROUTES.index(route)
    return {name: row[column] for name, row in FIELDS.items() if row[column] is not None}


def check_fields(body: dict, route: str) -> None:
    """A 400 for the first field of ``body`` that ``route`` does not implement and whose value would change the
    result."""
    for name, rule in rules(route).items():
        if isinstance(rule, Unsupported) and name in body and not rule.allows(body[name]):
            raise APIError(400, f"'{name}' is not supported by this server; {rule.hint()}", param=name,
                           code="unsupported_parameter")


def schema_properties(route: str) -> dict[str, Any]:
    """JSON Schemas of ``route``'s harmless and unsupported fields (the implemented ones: :mod:`.schema`)."""
    out: dict[str, Any] = {}
    for name, rule in rules(route).items():
        if rule == HARMLESS:
            out[name] = {"description": "accepted and ignored: it does not change the result"}
        elif isinstance(rule, Unsupported):
            out[name] = {"enum": [*rule.accepted, None],
                         "description": f"{rule.does}: not supported by this server; {rule.hint()}"}
    return out


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: numbers by value (1 == 1.0), booleans apart from numbers, lists and objects item by
    item."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b

"""Request checking: the error reply (:class:`APIError`, OpenAI's JSON shape ``{"error": {"message", "type",
"param", "code"}}``), the body read with a size limit and parsed strictly (:func:`read_json`, :func:`parse_json`), and
every field checked for its type and range (:func:`field`, :func:`number`, :func:`generation_settings`,
:func:`logit_bias`, :func:`logprob_settings`, :func:`check_model`)."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request as HTTPRequest
from starlette.requests import ClientDisconnect

from ..generation.config import INT64_LIMIT, LOGIT_BIAS_LIMIT, MIN_TEMPERATURE, PENALTY_LIMIT, SEED_LIMIT
from .config import ServeConfig
from .logprobs import MAX_LOGPROBS

MAX_LOGIT_BIAS = 300  # logit_bias entries at most (OpenAI's limit)
TOKEN_KEY = re.compile(r"0|[1-9][0-9]*")  # a logit_bias key: a token id in decimal, no sign, no leading zero


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientGone(Exception):
    """The client closed its connection before its reply: nothing is sent, nothing is logged."""


# --- request checking ---------------------------------------------------------------------------------------------

def field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None, required: bool = False) -> Any:
    """``body[name]`` checked to be one of ``kinds`` (absent or null: ``default``, or a 400 when ``required``)."""
    if name not in body or body[name] is None:
        if required:
            raise APIError(400, f"'{name}' is required", param=name, code="missing_field")
        return default
    value = body[name]
    if isinstance(value, float) and int in kinds and float not in kinds and value.is_integer():
        value = int(value)  # 5.0 is an integer to JSON Schema (the published schema says "integer")
    if isinstance(value, bool) and bool not in kinds:
        raise APIError(400, f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got a boolean", param=name,
                       code="invalid_type")
    if not isinstance(value, kinds):
        raise APIError(400, f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got "
                            f"{type(value).__name__}", param=name, code="invalid_type")
    return value


def number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    """A number field checked to lie in [low, high] ((low, high] with ``low_open``)."""
    value = field(body, name, (int, float), default)
    if not (low < value <= high if low_open else low <= value <= high):
        raise APIError(400, f"'{name}' must be in {'(' if low_open else '['}{low}, {high}], got {value}", param=name,
                       code="invalid_value")
    return float(value)


def generation_settings(body: dict, config: ServeConfig, default_max_tokens: int = 16, vocab: int | None = None,
                        echo: bool | None = None) -> dict[str, Any]:
    """max_tokens, temperature, top_p, top_k, stop, n, seed, presence_penalty, frequency_penalty, logit_bias (ids
    below ``vocab``) of an OpenAI request, and tokenloom's ``speculative`` (false: plain decoding on a server with a
    drafter), checked. ``echo`` (completions; None: a route without it): max_tokens 0 is allowed with echo true."""
    max_tokens = min(default_max_tokens, config.max_tokens)
    for name in ("max_completion_tokens", "max_tokens"):  # both checked; max_tokens wins when both are given
        value = field(body, name, (int,), None)
        if value is not None and not (1 if not echo else 0) <= value <= config.max_tokens:
            hint = "" if echo is None or value != 0 else " (0, scoring the prompt only, needs 'echo': true)"
            raise APIError(400, f"'{name}' must be in [{0 if echo else 1}, {config.max_tokens}]{hint}, got {value}",
                           param=name, code="invalid_value")
        max_tokens = max_tokens if value is None else value
    stop = field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "'stop' must be a non-empty string or a list of at most 4 of them", param="stop",
                       code="invalid_value")
    top_k = field(body, "top_k", (int,), None)
    if top_k is not None and top_k < 1:
        raise APIError(400, f"'top_k' must be >= 1, got {top_k}", param="top_k", code="invalid_value")
    n = field(body, "n", (int,), 1)
    if not 1 <= n <= config.max_prompts:
        raise APIError(400, f"'n' must be in [1, {config.max_prompts}], got {n}", param="n", code="invalid_value")
    seed = field(body, "seed", (int,), None)
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise APIError(400, f"'seed' must be in [0, 2^64), got {seed}", param="seed", code="invalid_value")
    temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    if 0 < temperature < MIN_TEMPERATURE:
        raise APIError(400, f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE:.3g}, got {temperature}",
                       param="temperature", code="invalid_value")
    options = field(body, "stream_options", (dict,), None) or {}
    return dict(max_tokens=max_tokens, temperature=temperature,
                top_p=number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), top_k=top_k, stop=stop, n=n, seed=seed,
                presence_penalty=number(body, "presence_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT),
                frequency_penalty=number(body, "frequency_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT),
                logit_bias=logit_bias(body, vocab),
                stream=bool(field(body, "stream", (bool,), False)),
                include_usage=bool(field(options, "include_usage", (bool,), False)),
                speculative=field(body, "speculative", (bool,), True))  # tokenloom's own: false opts out


def logit_bias(body: dict, vocab: int | None) -> dict[int, float] | None:
    """``logit_bias``: at most :data:`MAX_LOGIT_BIAS` token ids (decimal strings, below ``vocab``) -> numbers in
    [-100, 100]; None when absent or empty."""
    bias = field(body, "logit_bias", (dict,), None)
    if not bias:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise APIError(400, f"'logit_bias' holds {len(bias)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias",
                       code="invalid_value")
    out = {}
    for key, value in bias.items():
        if not TOKEN_KEY.fullmatch(key):
            raise APIError(400, f"'logit_bias' keys must be token ids (decimal integers), got {key[:40]!r}",
                           param="logit_bias", code="invalid_value")
        limit = vocab if vocab is not None else INT64_LIMIT
        if len(key) > len(str(limit)) or int(key) >= limit:  # (a key of thousands of digits: no int() of it)
            raise APIError(400, f"'logit_bias' names token id {short_number(key)}, outside the vocabulary [0, "
                                f"{limit})", param="logit_bias", code="invalid_value")
        token = int(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise APIError(400, f"'logit_bias' values must be numbers in [-{LOGIT_BIAS_LIMIT:g}, "
                                f"{LOGIT_BIAS_LIMIT:g}], got {json.dumps(value)[:40]} for token {token}",
                           param="logit_bias", code="invalid_value")
        out[token] = float(value)
    return out


def encode_text(tokenizer, text: str, param: str, allow_empty: bool = False) -> list[int]:  # noqa: ANN001
    """``text`` as token ids; text the tokenizer cannot encode (characters outside a character vocabulary), or
    that encodes to nothing (unless ``allow_empty``), is a 400 naming ``param``."""
    try:
        ids = tokenizer.encode(text)
    except Exception as err:  # noqa: BLE001 — a tokenizer error
        raise APIError(400, f"'{param}' cannot be encoded: {str(err).splitlines()[0]}", param=param,
                       code="invalid_value") from None
    if not ids and not allow_empty:
        raise APIError(400, f"'{param}' is empty after tokenization", param=param, code="invalid_value")
    return ids


def token_id(value: Any) -> int | None:
    """A JSON token id: an integer (5.0 included, as JSON Schema counts it), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) else None


def token_ids(values: list, vocab: int, param: str, what: str) -> list[int]:
    """``values`` checked to be token ids in [0, ``vocab``): a 400 naming ``param`` otherwise (``what``: the
    accepted shapes, for the message when one is not an integer)."""
    ids = [token_id(t) for t in values]
    if None in ids:
        raise APIError(400, f"'{param}' must be {what}", param=param, code="invalid_type")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"'{param}' holds token id {short_number(bad)}, outside the vocabulary [0, {vocab})",
                       param=param, code="invalid_value")
    return ids


def short_number(value: object) -> str:
    """A number for a one-line message: its first 20 digits and '...' past them."""
    text = str(value)
    return text if len(text) <= 20 else text[:20] + "..."


def logprob_settings(body: dict, chat: bool) -> int | None:
    """The alternatives per token a request asks for, or None for no log-probabilities: completions' ``logprobs``
    (an integer in [0, 20] or null), chat's ``logprobs`` (boolean) with ``top_logprobs`` (an integer in [0, 20] or
    null, only with logprobs true)."""
    name = "top_logprobs" if chat else "logprobs"
    k = field(body, name, (int,), None)
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise APIError(400, f"'{name}' must be in [0, {MAX_LOGPROBS}], got {k}", param=name, code="invalid_value")
    if not chat:
        return k
    if not field(body, "logprobs", (bool,), False):
        if k is not None:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
        return None
    return k or 0


def check_model(body: dict, config: ServeConfig) -> None:
    name = field(body, "model", (str,), None)
    if name is not None and name != config.model_name:
        raise APIError(404, f"the model '{name}' does not exist; this server serves '{config.model_name}'",
                       param="model", code="model_not_found")


def parse_json(body: bytes) -> dict:
    """The request body as a JSON object; anything else (not JSON, nested past the parser's depth, a number past
    Python's 4300-digit limit, NaN/Infinity, a lone surrogate in a string) is a 400 \"invalid_json\"."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except json.JSONDecodeError as err:
        raise APIError(400, f"the body is not valid JSON ({err.msg} at position {err.pos})",
                       code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the body is not valid JSON for this server (nested too deeply)",
                       code="invalid_json") from None
    except UnicodeDecodeError as err:
        raise APIError(400, f"the body is not valid JSON (not UTF-8: {err.reason} at byte {err.start})",
                       code="invalid_json") from None
    except ValueError as err:  # int('1' * 5000): the limit on integer string conversion
        detail = "a number with more than 4300 digits" if "integer string conversion" in str(err) else \
            str(err).splitlines()[0][:200]
        raise APIError(400, f"the body is not valid JSON for this server ({detail})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    _check_strings(data)
    return data


def _no_constant(name: str):  # noqa: ANN202 - json's parse_constant hook
    raise APIError(400, f"the body is not valid JSON ({name} is not a JSON value)", code="invalid_json")


def _check_strings(data: Any) -> None:
    """Refuse a lone UTF-16 surrogate (JSON's \\ud800) anywhere in ``data``: it is not text, no tokenizer encodes
    it, and no reply that quotes it can be written as UTF-8."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise APIError(400, "the body holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not "
                                        "text", code="invalid_json") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


async def read_json(request: HTTPRequest, max_body_bytes: int) -> dict:
    """The request's body as a JSON object (:func:`parse_json`), read with the server's size limit; a client that
    leaves mid-body is :class:`ClientGone`."""
    body = b""
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise APIError(413, f"request body over the server's limit of {max_body_bytes} bytes",
                               code="body_too_large")
    except ClientDisconnect:  # the client left mid-body
        raise ClientGone() from None
    return parse_json(body)

"""The OpenAPI description of the server's routes (published at ``/openapi.json``): JSON Schemas of the request
bodies with the ranges the handlers check, and of the replies. The handlers read and check their bodies
themselves (:mod:`tokenloom.serving.routes` with :mod:`tokenloom.serving.checks`), so FastAPI knows nothing of
them; the schemas here are written to match those checks, and ``tests/serving/test_fuzz_server.py`` runs
schemathesis against a live server to hold them to it: a body the schema allows gets 200 unless a check the schema
cannot state refuses it (prompts x n over the limit, a prompt longer than the context once tokenized, a temperature
below the smallest float32, a ``response_format`` that does not compile or that the tokenizer cannot spell), and a
body the schema refuses gets a 4xx.
The cross-field rules are stated with ``if``/``then``: ``max_tokens`` 0 needs ``echo`` true (completions),
``top_logprobs`` needs ``logprobs`` true (chat). The OpenAI fields the server accepts and ignores, or refuses
unless they hold the value that means "not used", come from the table in :mod:`tokenloom.serving.fields`.

For a character tokenizer the text fields name the vocabulary as a ``pattern`` and the context as
``maxLength`` (one token per character); other tokenizers accept any text.
"""

from __future__ import annotations

import re
from typing import Any

from ..generation.config import LOGIT_BIAS_LIMIT, PENALTY_LIMIT, SEED_LIMIT
from .checks import MAX_LOGIT_BIAS
from .fields import CHAT, COMPLETIONS, schema_properties
from .logprobs import MAX_LOGPROBS

FINISH_REASONS = ["stop", "length"]

ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
USAGE = {
    "type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {**{k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens",
                                                                     "total_tokens")},
                   "prompt_tokens_details": {
                       "type": "object", "required": ["cached_tokens"],
                       "properties": {"cached_tokens": {"type": "integer", "minimum": 0,
                                                        "description": "prompt tokens served from the prefix "
                                                                       "cache"}}}},
}
# log-probabilities in the replies (tokenloom.serving.logprobs); -9999.0 stands for -inf
_LOGPROB = {"type": "number"}
COMPLETION_LOGPROBS = {"anyOf": [{"type": "null"}, {
    "type": "object", "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"], "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": {"anyOf": [_LOGPROB, {"type": "null"}]}},
        "top_logprobs": {"type": "array", "items": {"anyOf": [{"type": "object", "additionalProperties": _LOGPROB},
                                                              {"type": "null"}]}},
        "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}]}
_CHAT_TOKEN = {"token": {"type": "string"}, "logprob": _LOGPROB,
               "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}}
CHAT_LOGPROBS = {"anyOf": [{"type": "null"}, {
    "type": "object", "required": ["content"], "properties": {"content": {"type": "array", "items": {
        "type": "object", "required": [*_CHAT_TOKEN, "top_logprobs"], "properties": {
            **_CHAT_TOKEN, "top_logprobs": {"type": "array", "maxItems": MAX_LOGPROBS, "items": {
                "type": "object", "required": list(_CHAT_TOKEN), "properties": _CHAT_TOKEN}}}}}}}]}
_ERRORS = {
    "400": "a field of the wrong type or out of range, a body that is not a JSON object, a prompt the tokenizer "
           "cannot encode or longer than the context",
    "401": "a missing or wrong API key (with --api-key)",
    "404": "a model other than the one served",
    "413": "a body over --max-body-bytes",
    "415": "a body not sent as application/json",
    "429": "the queue is full (--max-queue)",
    "500": "an unexpected failure (one line, no traceback)",
    "503": "the engine has stopped, or over --limit-concurrency (running requests) or --limit-connections (open "
           "connections, none idle)",
    "504": "the request ran past --request-timeout",
}


def _errors(*statuses: str) -> dict[str, Any]:
    return {s: {"description": _ERRORS[s], "content": {"application/json": {"schema": ERROR}}} for s in statuses}


def text_schema(tokenizer, context: int | None = None) -> dict[str, Any]:
    """A string the tokenizer encodes: for a character tokenizer, its characters and (``context``) at most that
    many; otherwise any string."""
    if getattr(tokenizer, "kind", None) != "char":
        return {"type": "string"}
    vocab = sorted(tokenizer.backend.get_vocab(with_added_tokens=False))
    schema: dict[str, Any] = {"type": "string", "pattern": "^[" + "".join(_class_char(c) for c in vocab) + "]*$"}
    if context is not None:
        schema["maxLength"] = context
    return schema


def _class_char(ch: str) -> str:
    """``ch`` inside a regex character class, as ECMA 262 (JSON Schema) and Python both read it."""
    if ch.isalnum() and ch.isascii():
        return ch
    return f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else re.escape(ch)


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "type": [schema["type"], "null"]}


def integers_below(n: int) -> str:
    """A regex of the decimal integers in [0, ``n``) (no sign, no leading zero), ``n`` >= 1: the token ids."""
    top = str(n - 1)
    digits = len(top)

    def span(lo: int, hi: int) -> str:
        return str(lo) if lo == hi else f"[{lo}-{hi}]"

    alternatives = [] if digits == 1 else ["[0-9]", *(f"[1-9][0-9]{{{d - 1}}}" for d in range(2, digits))]
    if digits == 1:
        alternatives.append(span(0, n - 1))
    else:  # the numbers of as many digits as n - 1, up to it: below it at digit i, equal before
        for i, ch in enumerate(top):
            lo, rest = (1 if i == 0 else 0), digits - i - 1
            if int(ch) > lo:
                alternatives.append(top[:i] + span(lo, int(ch) - 1) + (f"[0-9]{{{rest}}}" if rest else ""))
        alternatives.append(top)
    return "^(?:" + "|".join(alternatives) + ")$"


def _requires(name: str, value: Any, other: str, other_value: Any) -> dict[str, Any]:
    """JSON Schema: when ``name`` is ``value``, ``other`` must be present and ``other_value``."""
    return {"if": {"required": [name], "properties": {name: value}},
            "then": {"required": [other], "properties": {other: {"const": other_value}}}}


def generation_properties(config, vocab: int) -> dict[str, Any]:  # noqa: ANN001 - a ServeConfig
    """The sampling settings shared by completions and chat completions (``vocab``: token ids a request may
    name)."""
    tokens = {"type": "integer", "minimum": 1, "maximum": config.max_tokens}
    penalty = {"type": "number", "minimum": -PENALTY_LIMIT, "maximum": PENALTY_LIMIT}
    stop = {"type": "string", "minLength": 1}
    return {
        "model": {"enum": [config.model_name, None], "description": "the served model's id (optional)"},
        "max_tokens": _nullable({**tokens, "description": "new tokens at most (default 16 for completions, "
                                                          "--max-tokens for chat)"}),
        "max_completion_tokens": _nullable({**tokens, "description": "the same as max_tokens, when that is absent"}),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2,
                                  "description": "0: greedy; otherwise at least 1.18e-38 (the smallest normal "
                                                 "float32)"}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": 1}),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": config.max_prompts,
                        "description": f"choices per prompt; prompts x n at most {config.max_prompts}"}),
        # exclusiveMaximum 2^64 (a float exactly): validators that compare as floats round 2^64 - 1 up to 2^64
        "seed": _nullable({"type": "integer", "minimum": 0, "exclusiveMaximum": SEED_LIMIT,
                           "description": "choice j samples with seed + j"}),
        "stop": {"anyOf": [stop, {"type": "array", "items": stop, "maxItems": 4}, {"type": "null"}]},
        "stream": _nullable({"type": "boolean"}),
        "speculative": _nullable({"type": "boolean", "description": "tokenloom: speculative decoding for this "
                                  "request when the server has a drafter (--draft, --prompt-lookup; default true); "
                                  "false: plain decoding"}),
        "stream_options": _nullable({"type": "object",
                                     "properties": {"include_usage": _nullable({"type": "boolean"})}}),
        "presence_penalty": _nullable({**penalty, "description": "subtracted from the logit of each token already "
                                                                 "generated (the prompt does not count)"}),
        "frequency_penalty": _nullable({**penalty, "description": "times the count of each token already generated, "
                                                                  "subtracted from its logit"}),
        "logit_bias": _nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                 "propertyNames": {"pattern": integers_below(vocab)},
                                 "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_LIMIT,
                                                          "maximum": LOGIT_BIAS_LIMIT},
                                 "description": f"token id (in [0, {vocab})) -> a number added to its logit "
                                                "(greedy decoding too)"}),
        "response_format": _nullable({"type": "object", "required": ["type"],
                                      "properties": {"type": {"enum": ["text", "json_object", "json_schema", "regex",
                                                                       "choice"]}},
                                      "description": "structured output (outlines-core): text; json_object; "
                                                     "json_schema with {json_schema: {schema}}; tokenloom's regex "
                                                     "with {regex} and choice with {choice: [strings]}. A spec that "
                                                     "does not compile, or that the tokenizer cannot spell (a "
                                                     "character vocabulary without braces or quotes cannot write "
                                                     "JSON), answers 400"}),
    }


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _reply(schema: dict[str, Any], chunk: dict[str, Any] | None = None) -> dict[str, Any]:
    """The 200 reply: ``schema`` as JSON, and with a streaming ``chunk`` schema also server-sent events (before
    OpenAPI 3.2 the ``schema`` of an event stream describes one event: its ``data`` is a chunk as JSON text)."""
    content: dict[str, Any] = {"application/json": {"schema": schema}}
    if chunk is not None:
        content["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"], "properties": {
                # no contentMediaType: the last event, [DONE], is not JSON (OpenAI's convention)
                "data": {"type": "string", "description": "one chunk as JSON text (x-chunk-schema; an error "
                                                          "object if the request fails midway); the last is [DONE]"},
                "event": {"type": "string"}}, "x-chunk-schema": chunk}}
    return {"200": {"description": "the result (server-sent events with stream: true)", "content": content}}


def _choice_list(choice: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "object", "required": list(choice), "properties": choice}}


def completions_operation(config, tokenizer, context: int, vocab: int) -> dict[str, Any]:  # noqa: ANN001
    text = {**text_schema(tokenizer, context - 1), "minLength": 1}
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}, "minItems": 1,
           "maxItems": context - 1}
    properties = generation_properties(config, vocab)
    for name in ("max_tokens", "max_completion_tokens"):
        properties[name] = {**properties[name], "minimum": 0,
                            "description": properties[name]["description"] + "; 0 (score the prompt) needs echo"}
    body = {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": config.max_prompts},
                             ids, {"type": "array", "items": ids, "minItems": 1, "maxItems": config.max_prompts}],
                   "description": "a prompt or a list of them, as text or as token ids"},
        **schema_properties(COMPLETIONS),  # OpenAI's fields accepted and ignored, or refused (tokenloom.serving.fields)
        **properties,
        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                               "description": "the log-probability of each token and of its k likeliest "
                                             "alternatives (of the model's logits, before the sampling settings)"}),
        "echo": _nullable({"type": "boolean", "description": "the reply's text (and logprobs) start with the "
                                                             "prompt"})},
        "allOf": [_requires(name, {"const": 0}, "echo", True) for name in ("max_tokens", "max_completion_tokens")]}
    choice = {"index": {"type": "integer", "minimum": 0}, "text": {"type": "string"}, "logprobs": COMPLETION_LOGPROBS}
    reply = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
        "model": {"type": "string"}, "usage": USAGE,
        "choices": _choice_list({**choice, "finish_reason": {"enum": FINISH_REASONS}})}}
    chunk = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
        **reply["properties"], "usage": USAGE,
        "choices": _choice_list({**choice, "finish_reason": {"enum": [*FINISH_REASONS, None]}})}}
    return {**_body(body), "responses": {**_reply(reply, chunk),
                                         **_errors("400", "401", "404", "413", "415", "429", "500", "504")}}


def chat_operation(config, tokenizer, vocab: int) -> dict[str, Any]:  # noqa: ANN001 - a ServeConfig
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string"}, "content": text_schema(tokenizer)}}
    body = {"type": "object", "required": ["messages"], "properties": {
        "messages": {"type": "array", "items": message, "minItems": 1,
                     "description": "the contents are joined, each followed by a newline (no chat template); "
                                    "together they must fit the context"},
        **schema_properties(CHAT),  # OpenAI's fields accepted and ignored, or refused (tokenloom.serving.fields)
        **generation_properties(config, vocab),
        "logprobs": _nullable({"type": "boolean", "description": "the log-probability of each token (of the "
                                                                 "model's logits, before the sampling settings)"}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                                   "description": "the k likeliest alternatives of each token; needs logprobs "
                                                  "true"})},
        "allOf": [_requires("top_logprobs", {"type": "integer"}, "logprobs", True)]}
    reply = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
        "model": {"type": "string"}, "usage": USAGE,
        "choices": _choice_list({"index": {"type": "integer", "minimum": 0},
                                 "message": {"type": "object", "required": ["role", "content"], "properties": {
                                     "role": {"const": "assistant"}, "content": {"type": "string"}}},
                                 "logprobs": CHAT_LOGPROBS, "finish_reason": {"enum": FINISH_REASONS}})}}
    chunk = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
        **reply["properties"], "object": {"const": "chat.completion.chunk"}, "usage": USAGE,
        "choices": _choice_list({"index": {"type": "integer", "minimum": 0},
                                 "delta": {"type": "object", "properties": {"role": {"const": "assistant"},
                                                                            "content": {"type": "string"}}},
                                 "logprobs": CHAT_LOGPROBS, "finish_reason": {"enum": [*FINISH_REASONS, None]}})}}
    return {**_body(body), "responses": {**_reply(reply, chunk),
                                         **_errors("400", "401", "404", "413", "415", "429", "500", "504")}}


def translations_operation(config, tokenizer, max_inputs: int, max_beam: int,  # noqa: ANN001
                           max_source_len: int) -> dict[str, Any]:
    text = text_schema(tokenizer)
    body = {"type": "object", "required": ["input"], "properties": {
        "model": {"enum": [config.model_name, None]},
        "input": {"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": max_inputs}],
                  "description": f"a sentence or a list of them, each at most the model's source limit of "
                                 f"{max_source_len} tokens (its end-of-sentence token included): a longer one is a "
                                 "400 (context_length_exceeded) naming its index, unless truncate"},
        "beam": _nullable({"type": "integer", "minimum": 1, "maximum": max_beam,
                           "description": "beam width (ignored by NAT models)"}),
        "truncate": _nullable({"type": "boolean", "description": "translate an input over the source limit cut to "
                                                                 "it (its translation says truncated) instead of "
                                                                 "refusing it (default false)"})}}
    reply = {"type": "object", "required": ["object", "model", "data"], "properties": {
        "object": {"const": "list"}, "model": {"type": "string"},
        "data": _choice_list({"index": {"type": "integer", "minimum": 0}, "translation": {"type": "string"},
                              "truncated": {"type": "boolean", "description": "the input was cut to the source "
                                                                              "limit (truncate: true)"}})}}
    return {**_body(body), "responses": {**_reply(reply),
                                         **_errors("400", "401", "404", "413", "415", "500")}}


def tokenizer_info_responses() -> dict[str, Any]:
    info = {"type": "object", "required": ["model", "vocab_size", "max_model_len", "eos_token", "bos_token",
                                           "pad_token"], "properties": {
        "model": {"type": "string"}, "tokenizer_class": {"type": "string"},
        "vocab_size": {"type": "integer", "minimum": 1}, "max_model_len": {"type": "integer", "minimum": 1},
        "eos_token": {"type": ["string", "null"]}, "eos_token_id": {"type": ["integer", "null"]},
        "bos_token": {"type": "null"}, "pad_token": {"type": "null"}}}
    return {"200": {"description": "the tokenizer (vLLM's /tokenizer_info)",
                    "content": {"application/json": {"schema": info}}}, **_errors("401")}


def tokenize_operation(tokenizer) -> dict[str, Any]:  # noqa: ANN001 - a tokenloom Tokenizer
    body = {"type": "object", "required": ["prompt"], "properties": {
        "prompt": text_schema(tokenizer), "add_special_tokens": _nullable({"type": "boolean"})}}
    reply = {"type": "object", "required": ["tokens", "count", "max_model_len"], "properties": {
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "count": {"type": "integer", "minimum": 0}, "max_model_len": {"type": "integer", "minimum": 1}}}
    return {**_body(body), "responses": {**_reply(reply), **_errors("400", "401", "413", "415", "500")}}


def detokenize_operation(vocab: int, max_ids: int) -> dict[str, Any]:
    body = {"type": "object", "required": ["tokens"], "properties": {
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1},
                   "maxItems": max_ids}}}
    reply = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
    return {**_body(body), "responses": {**_reply(reply), **_errors("400", "401", "413", "415", "500")}}


RAG_GENERATION_FIELDS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                         "presence_penalty", "frequency_penalty")  # the completions settings /v1/rag reads


def rag_operation(config, tokenizer, vocab: int, max_k: int, retrievers: list[str], top_k: int,  # noqa: ANN001
                  retriever: str) -> dict[str, Any]:
    """POST /v1/rag (``serve --rag``, :mod:`tokenloom.serving.routes.rag`): a question, the passages to retrieve and
    the sampling settings of the completions routes; the answer, its citations, the passages and the fact check."""
    own = text_schema(tokenizer).get("pattern")  # a character vocabulary's, and at least one non-space character
    question = {**text_schema(tokenizer), "minLength": 1,
                "pattern": r"\S" if own is None else "^(?=[\\s\\S]*\\S)" + own[1:],
                "description": "the question; the prompt holds it after the retrieved passages and must fit the "
                               "context"}
    properties = generation_properties(config, vocab)
    body = {"type": "object", "required": ["question"], "properties": {
        "model": properties["model"], "question": question,
        "k": _nullable({"type": "integer", "minimum": 1, "maximum": max_k,
                        "description": f"passages retrieved (default {top_k})"}),
        "retriever": {"enum": [*retrievers, None], "description": f"default {retriever}"},
        "alpha": _nullable({"type": "number", "minimum": 0, "maximum": 1,
                            "description": "hybrid: the dense score's weight (default 0.5)"}),
        "fact_check": _nullable({"type": "boolean", "description": "mark each span of the answer supported or not "
                                                                   "by the passages (default true)"}),
        **{name: properties[name] for name in RAG_GENERATION_FIELDS}}}
    passage = {"type": "object", "required": ["id", "score", "text"], "properties": {
        "id": {"type": "string"}, "score": {"type": "number"}, "text": {"type": "string"}}}
    span = {"type": "object", "required": ["text", "supported", "support", "passages"], "properties": {
        "text": {"type": "string"}, "start": {"type": "integer"}, "end": {"type": "integer"},
        "supported": {"type": "boolean"}, "support": {"type": "number"},
        "passages": {"type": "array", "items": {"type": "string"}}}}
    check = {"anyOf": [{"type": "null"}, {"type": "object", "required": ["method", "supported", "spans"],
                                          "properties": {"method": {"type": "string"}, "threshold": {"type": "number"},
                                                         "supported": {"type": "boolean"},
                                                         "spans": {"type": "array", "items": span}}}]}
    ids = {"type": "array", "items": {"type": "string"}}
    reply = {"type": "object", "required": ["object", "model", "answer", "citations", "passages", "fact_check"],
             "properties": {"object": {"const": "rag.answer"}, "model": {"type": "string"},
                            "answer": {"type": "string"}, "citations": ids, "passages": {"type": "array",
                                                                                        "items": passage},
                            "dropped": ids, "fact_check": check, "usage": USAGE}}
    return {**_body(body), "responses": {**_reply(reply),
                                         **_errors("400", "401", "404", "413", "415", "429", "500", "504")}}


def get_responses(kind: str) -> dict[str, Any]:
    """``responses`` of the GET routes: ``health``, ``models``, ``metrics``, ``playground``."""
    if kind == "health":
        ok = {"type": "object", "required": ["status", "model"], "properties": {
            "status": {"enum": ["ok", "error"]}, "model": {"type": "string"},
            "active": {"type": "integer", "minimum": 0}, "queued": {"type": "integer", "minimum": 0},
            "error": {"type": "string"}}}
        return {"200": {"description": "serving", "content": {"application/json": {"schema": ok}}},
                "503": {"description": "the engine has stopped (status: error), or over --limit-concurrency or "
                                       "--limit-connections (an error object)",
                        "content": {"application/json": {"schema": {"anyOf": [ok, ERROR]}}}}}
    if kind == "models":
        model = {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
            "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
            "owned_by": {"type": "string"}}}
        listing = {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": model}}}
        return {"200": {"description": "the served model", "content": {"application/json": {"schema": listing}}},
                **_errors("401")}
    if kind == "metrics":
        return {"200": {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}},
                **_errors("401")}
    return {"200": {"description": "the playground page", "content": {"text/html": {"schema": {"type": "string"}}}}}

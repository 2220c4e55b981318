"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` over the continuous-batching
:class:`~tokenloom.serving.engine.Engine`: the routes, and the helpers between them and the engine (prompts to engine
requests, their events to a reply or to server-sent events)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from ...generation.config import GenerationConfig, offset_seed
from .. import schema as api_schema
from ..checks import (
    APIError,
    ClientGone,
    check_model,
    encode_text,
    field,
    generation_settings,
    logprob_settings,
    read_json,
    token_ids,
)
from ..engine import QueueFull, Request
from ..fields import check_fields
from ..logprobs import Choice
from ..state import ServerState, server_state

RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "choice")  # the last two: tokenloom's own
MAX_REGEX, MAX_SCHEMA_BYTES, MAX_CHOICES = 512, 16384, 64  # a constraint's size (compiling is paid up front)


def add_routes(router: APIRouter, state: ServerState) -> None:
    """The two routes; the schema lists them only for a language model (for another they answer 400
    unsupported_model)."""
    config, tokenizer = state.config, state.tokenizer
    vocab = state.vocab
    router.add_api_route("/v1/completions", completions, methods=["POST"], include_in_schema=state.is_lm,
                         openapi_extra=api_schema.completions_operation(config, tokenizer,
                                                                        state.model.config.max_seq_len, vocab))
    router.add_api_route("/v1/chat/completions", chat, methods=["POST"], include_in_schema=state.is_lm,
                         openapi_extra=api_schema.chat_operation(config, tokenizer, vocab))


# --- the routes ---------------------------------------------------------------------------------------------------

async def lm_request(request: HTTPRequest, route: str) -> tuple[ServerState, dict]:
    """The server's state and the request's JSON body, for a route that needs a language model (400 otherwise),
    the body's ``model`` checked and its fields against the route's column of :data:`~..fields.FIELDS`."""
    state = server_state(request)
    require_lm(state, route)
    body = await read_json(request, state.config.max_body_bytes)
    check_model(body, state.config)
    check_fields(body, route)  # a field that would change the result and is not implemented: 400
    return state, body


async def completions(request: HTTPRequest):
    state, body = await lm_request(request, "/v1/completions")
    config = state.config
    prompts = prompt_list(body, state.vocab)
    echo = field(body, "echo", (bool,), False)
    k = logprob_settings(body, chat=False)
    settings = generation_settings(body, config, vocab=state.vocab, echo=echo)
    settings.update(logprobs=k, echo=echo, constraint=await constraint_of(body, state))
    if len(prompts) * settings["n"] > config.max_prompts:
        raise APIError(400, f"{len(prompts)} prompts x n={settings['n']} exceeds the server's limit of "
                            f"{config.max_prompts} completions per request", param="n", code="invalid_value")
    jobs = make_requests(state, prompts, settings, "prompt")
    return await reply(request, state, jobs, settings, "completions", "cmpl", "text_completion", completion_chunk,
                       lambda c: {"index": c.index, "text": c.text, "logprobs": c.logprobs(),
                                  "finish_reason": c.finish_reason})


async def chat(request: HTTPRequest):
    state, body = await lm_request(request, "/v1/chat/completions")
    config = state.config
    messages = field(body, "messages", (list,), required=True)
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                               and isinstance(m.get("role"), str) for m in messages):
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects with string "
                            "role and content", param="messages", code="invalid_type")
    prompt = chat_prompt(state, messages)
    k = logprob_settings(body, chat=True)
    settings = generation_settings(body, config, default_max_tokens=config.max_tokens, vocab=state.vocab)
    settings.update(logprobs=k, echo=False, constraint=await constraint_of(body, state))
    if state.chat_template is not None:  # a reply ends at the template's end marker
        settings["stop"] = list(dict.fromkeys([*settings["stop"], *state.chat_template.stop_strings]))
    prompt_len = len(prompt) if isinstance(prompt, list) else len(encode(state, prompt, "messages"))
    settings["max_tokens"] = min(settings["max_tokens"], max(1, state.model.config.max_seq_len - prompt_len - 1))
    jobs = make_requests(state, [prompt], settings, "messages")
    return await reply(request, state, jobs, settings, "chat", "chatcmpl", "chat.completion", chat_chunk,
                       lambda c: {"index": c.index, "message": {"role": "assistant", "content": c.text},
                                  "logprobs": c.logprobs(), "finish_reason": c.finish_reason})


def chat_prompt(state: ServerState, messages: list[dict]) -> str | list[int]:
    """The prompt of a chat request: with the checkpoint's chat template, the ids of the rendered messages ending in
    the assistant header (roles system, user, assistant); without one, the contents joined by newlines."""
    template = state.chat_template
    if template is None:
        return "".join(m["content"] + "\n" for m in messages)  # no chat template: plain concatenation
    from ...data.chat import ROLES

    bad = next((m["role"] for m in messages if m["role"] not in ROLES), None)
    if bad is not None:
        raise APIError(400, f"'messages' holds role {json.dumps(bad)[:40]}; the chat template knows "
                            f"{', '.join(ROLES)}", param="messages", code="invalid_value")
    try:
        ids = template.encode_prompt(state.tokenizer, [{"role": m["role"], "content": m["content"]} for m in messages])
    except Exception as err:  # noqa: BLE001 - a tokenizer / template error
        raise APIError(400, f"'messages' cannot be encoded: {str(err).splitlines()[0]}", param="messages",
                       code="invalid_value") from None
    if not ids:
        raise APIError(400, "'messages' is empty after tokenization", param="messages", code="invalid_value")
    return ids


async def constraint_of(body: dict, state: ServerState):  # noqa: ANN201 - a function making constraints, or None
    """What ``response_format`` asks of the output: None for free text (absent, or ``{"type": "text"}``), else a
    function making a fresh :class:`~tokenloom.generation.constraints.Constraint` (one per engine request: it is
    stateful). ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"schema": {...}}}`` (OpenAI's),
    and tokenloom's ``{"type": "regex", "regex": "..."}`` and ``{"type": "choice", "choice": ["...", ...]}``. The
    spec is compiled here, in a worker process (:class:`~tokenloom.grammar.worker.GrammarWorkers`: a JSON object
    grammar over a large vocabulary takes seconds the first time, then comes from a cache); one that does not
    compile, that the tokenizer cannot spell, or that takes over the server's ``grammar_seconds`` or
    ``grammar_memory_mb`` to compile (its worker is killed) is a 400."""
    response_format = field(body, "response_format", (dict,), None)
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMATS:
        raise APIError(400, f"'response_format' type must be one of {', '.join(RESPONSE_FORMATS)}, got "
                            f"{json.dumps(kind)[:40]}", param="response_format", code="invalid_value")
    if kind == "text":
        return None
    spec = _constraint_spec(kind, response_format)
    try:
        from ...generation.constraints import ConstraintError, grammar_job
        from ...grammar.worker import CompilerBusy, CompileRefused
    except ImportError:  # pragma: no cover - outlines-core is part of the serve extra
        raise APIError(400, "structured output needs outlines-core (pip install 'tokenloom[serve]')",
                       param="response_format", code="unsupported_value") from None
    tokenizer, vocab = state.tokenizer, state.model.config.vocab_size
    eos = getattr(tokenizer, "eos_id", None)
    try:  # checked, and the tokenizer's vocabulary read (once, then cached), off the event loop; nothing compiles
        job = await asyncio.get_running_loop().run_in_executor(
            None, partial(grammar_job, tokenizer, vocab, eos_id=eos, **spec))
        compiled = job.cached()
        if compiled is None:  # compiled (and cached) once, in a worker process killed past the server's limits
            compiled = job.store(await state.grammars.compile(job.vocabulary, job.kind, job.spec, job.what))
    except CompileRefused as err:  # over the time or memory limit: the worker is gone, nothing left running
        raise APIError(400, f"'response_format' {err}", param="response_format", code="invalid_value") from None
    except ConstraintError as err:
        raise APIError(400, f"'response_format': {err}", param="response_format", code="invalid_value") from None
    except CompilerBusy as err:
        raise APIError(429, f"'response_format': {err}", type_="rate_limit_error", code="compiler_busy") from None
    return partial(job.constraint, compiled)


def _constraint_spec(kind: str, response_format: dict) -> dict:
    """``build_constraint``'s keyword for a ``response_format`` of ``kind`` (not text), its size checked."""
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        inner = response_format.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "'response_format' json_schema needs {\"json_schema\": {\"schema\": {...}}}",
                           param="response_format", code="invalid_value")
        if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
            raise APIError(400, f"'response_format' schema is over {MAX_SCHEMA_BYTES} bytes",
                           param="response_format", code="invalid_value")
        return {"json_schema": schema}
    if kind == "regex":
        regex = response_format.get("regex")
        if not isinstance(regex, str) or not 0 < len(regex) <= MAX_REGEX:
            raise APIError(400, f"'response_format' regex must be a string of 1-{MAX_REGEX} characters",
                           param="response_format", code="invalid_value")
        return {"regex": regex}
    choice = response_format.get("choice")
    if not (isinstance(choice, list) and 0 < len(choice) <= MAX_CHOICES
            and all(isinstance(c, str) and 0 < len(c) <= 256 for c in choice)):
        raise APIError(400, f"'response_format' choice must be a list of 1-{MAX_CHOICES} non-empty strings of at "
                            "most 256 characters", param="response_format", code="invalid_value")
    return {"choice": choice}


async def reply(request: HTTPRequest, state: ServerState, jobs: list[PromptJob], settings: dict, route: str,
                id_prefix: str, object_name: str, chunk_builder, choice):
    """Run the jobs on the engine and answer: server-sent events (``chunk_builder(id, created, model, index, text,
    finish, logprobs)`` per piece) when the request streams, else one reply of ``choice(Choice)`` per choice."""
    config = state.config
    started = await submit(state, jobs, settings)
    state.metrics.count_request(route)
    style = None if settings["logprobs"] is None else route
    echoes = {index: job.text for job in jobs for index, _ in job.choices} if settings["echo"] else {}
    choices = {index: Choice(index, r, state.tokenizer, style, echoes.get(index)) for index, r, _ in started}
    rid, created = f"{id_prefix}-{uuid.uuid4().hex[:24]}", int(time.time())
    chunk = partial(chunk_builder, rid, created, config.model_name)
    if settings["stream"]:
        return StreamingResponse(state.metrics.timed(stream(started, choices, chunk, settings["include_usage"]),
                                                     started), media_type="text/event-stream")
    await state.metrics.timed_collect(while_connected(request, collect(started, choices), started), started)
    return {"id": rid, "object": object_name, "created": created, "model": config.model_name,
            "choices": [choice(choices[i]) for i in sorted(choices)], "usage": usage(started)}


def completion_chunk(rid: str, created: int, model_name: str, index: int, text: str, finish: str | None,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat_chunk(rid: str, created: int, model_name: str, index: int, text: str, finish: str | None,
               logprobs: dict | None = None) -> dict:
    delta = {"role": "assistant", "content": text} if text or finish is None else {}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


# --- prompts to engine requests -----------------------------------------------------------------------------------

def require_lm(state: ServerState, what: str) -> None:
    if state.engine is None:
        raise APIError(400, f"{what} needs a language model; this server serves a translation model: use "
                            "POST /v1/translations", code="unsupported_model")


def encode(state: ServerState, text: str, param: str) -> list[int]:
    return encode_text(state.tokenizer, text, param)


def prompt_list(body: dict, vocab: int) -> list[str | list[int]]:
    """The prompts of a completions body: a string, a list of strings, a list of token ids (one prompt) or a list
    of lists of them, each id in [0, ``vocab``)."""
    prompt = field(body, "prompt", (str, list), required=True)
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "'prompt' must not be an empty list", param="prompt", code="invalid_type")
    if all(isinstance(p, str) for p in prompt):
        return prompt
    rows = prompt if isinstance(prompt[0], list) else [prompt]
    shapes = "a string, a non-empty list of strings, a non-empty list of token ids or a non-empty list of such lists"
    return [token_ids(row if isinstance(row, list) and row else [None], vocab, "prompt", shapes) for row in rows]


@dataclass
class PromptJob:
    """One prompt of a request and its choices."""

    ids: list[int]  # the prompt's token ids
    text: str  # its text (what echo returns): the prompt as given, or its ids decoded
    choices: list[tuple[int, GenerationConfig]]  # (choice index, settings) of each of its n samples


def make_requests(state: ServerState, prompts: list[str | list[int]], settings: dict, param: str) -> list[PromptJob]:
    """Each prompt's ids and its ``n`` choices' settings (choice j seeded with seed + j)."""
    context = state.model.config.max_seq_len
    out = []
    for p, prompt in enumerate(prompts):
        ids = encode(state, prompt, param) if isinstance(prompt, str) else prompt
        if len(ids) >= context:
            raise APIError(400, f"the prompt is {len(ids)} tokens; the model's context is {context} (prompt "
                                "plus at least one new token must fit)", param=param,
                           code="context_length_exceeded")
        if len(ids) > state.engine.max_prompt_tokens:
            raise APIError(400, f"the prompt is {len(ids)} tokens; the server's KV cache holds "
                                f"{state.engine.max_prompt_tokens + 1} positions in all (--kv-blocks x --block-size)",
                           param=param, code="context_length_exceeded")
        text = prompt if isinstance(prompt, str) else \
            (state.tokenizer.decode(ids) if settings["echo"] else "")
        choices = []
        for j in range(settings["n"]):
            gen = GenerationConfig(max_new_tokens=max(1, settings["max_tokens"]), temperature=settings["temperature"],
                                   do_sample=settings["temperature"] > 0,
                                   top_p=settings["top_p"] if settings["top_p"] < 1 else None,
                                   top_k=settings["top_k"], seed=offset_seed(settings["seed"], j),
                                   presence_penalty=settings["presence_penalty"],
                                   frequency_penalty=settings["frequency_penalty"], logit_bias=settings["logit_bias"])
            choices.append((p * settings["n"] + j, gen))
        out.append(PromptJob(ids, text, choices))
    return out


async def submit(state: ServerState, jobs: list[PromptJob], settings) -> list[tuple[int, Request, asyncio.Queue]]:
    """Submit the jobs to the engine: (choice index, request, its event queue) each; the n choices of a prompt go
    as one request with n - 1 ``siblings`` (the prompt prefilled once). 429 when the queue is full (the ones already
    queued are cancelled)."""
    started = []
    deadline = time.monotonic() + state.config.request_timeout
    score_only = settings["max_tokens"] == 0
    k = settings["logprobs"]
    try:
        for job in jobs:
            group = []
            for index, gen in job.choices:
                events: asyncio.Queue = asyncio.Queue()
                # put_nowait runs on this loop: the engine hands its events over through dispatch()
                request = Request(job.ids, gen, events.put_nowait, deadline=deadline, stop_strings=settings["stop"],
                                  # the penalties count exact histories: no speculative verification for them
                                  speculative=settings["speculative"] and gen.speculative_conflict() is None,
                                  logprobs=k, echo=settings["echo"] and k is not None, score_only=score_only,
                                  constraint=None if settings["constraint"] is None else settings["constraint"]())
                group.append((index, request, events))
            if score_only:  # (no token is chosen: nothing to fork)
                for item in group:
                    state.engine.submit(item[1])
                    started.append(item)
                continue
            group[0][1].siblings = [request for _, request, _ in group[1:]]
            state.engine.submit(group[0][1])
            started.extend(group)
    except QueueFull as err:
        for _, request, _ in started:
            request.cancel()
        raise APIError(429, str(err), type_="rate_limit_error", code="queue_full") from None
    return started


# --- engine events to replies -------------------------------------------------------------------------------------

def usage(started) -> dict:
    prompt = sum(len(r.prompt_ids) for _, r, _ in started)
    completion = sum(len(r.new_ids) for _, r, _ in started)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for _, r, _ in started)}}


async def next_event(request: Request, events: asyncio.Queue) -> tuple[str, Any]:
    """The request's next event, or a timeout error once its deadline has passed by a second: the engine checks
    deadlines itself, this is the event loop's own check, for an engine that has stopped or hangs."""
    if request.deadline is None:
        return await events.get()
    try:
        return await asyncio.wait_for(events.get(), max(0.0, request.deadline - time.monotonic()) + 1.0)
    except asyncio.TimeoutError:
        request.finish_reason = "timeout"
        request.cancel()
        return "error", "the request took longer than the server's request timeout"


def pieces(choice: Choice, kind: str, value: str) -> list[tuple[str, str | None, dict | None]]:
    """A choice's event as (text, finish_reason, logprobs) pieces: with echo, the prompt first (at the first event,
    once the prompt's log-probabilities are known), then the delta, or at ``done`` the end."""
    out = []
    opened = choice.open()
    if opened is not None:
        out.append((opened[0], None, opened[1]))
    if kind == "delta":
        out.append((value, None, choice.delta(value)))
    elif kind == "done":
        out.append(("", value, choice.finish(value)))
    return out


def failure(request: Request, message: str) -> APIError:
    timeout = request.finish_reason == "timeout"
    return APIError(504 if timeout else 500, message, type_="server_error",
                    code="timeout" if timeout else "generation_failed")


async def collect(started, choices: dict[int, Choice]) -> None:
    """Wait for every request, its text and log-probabilities gathered in its :class:`Choice`."""
    try:
        for index, request, events in started:
            while True:
                kind, value = await next_event(request, events)
                if kind == "error":
                    raise failure(request, value)
                pieces(choices[index], kind, value)
                if kind == "done":
                    break
    finally:
        for _, request, _ in started:
            request.cancel()  # no-op for finished ones; frees the rest (an error, a cancelled handler)


async def while_connected(http_request: HTTPRequest, work, started):
    """Await ``work`` (collecting ``started``); a client that leaves first has its requests cancelled, so their
    rows are freed before the engine's next step (StreamingResponse watches a streaming one the same way)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected(http_request))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            for _, request, _ in started:
                request.cancel()
    if task not in done:
        raise ClientGone()
    return task.result()


async def disconnected(request: HTTPRequest) -> None:
    """Return once the client has gone (after the body has been read, the ASGI receive channel has nothing else to
    say but ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # (a server that repeats empty body messages: do not spin)


async def stream(started, choices: dict[int, Choice], chunk, final_usage: bool) -> AsyncIterator[bytes]:
    """Server-sent events: one chunk per piece (:func:`pieces`), in order of arrival across the choices."""
    pending = {index: (request, events) for index, request, events in started}
    if len(started) == 1:  # one choice (the common case): await its queue directly, no task per event
        index, request, events = started[0]
        try:
            while True:
                kind, value = await next_event(request, events)
                if kind == "error":
                    yield sse(failure(request, value).body())
                    break
                for text, finish, logprobs in pieces(choices[index], kind, value):
                    yield sse(chunk(index, text, finish, logprobs))
                if kind == "done":
                    break
            if final_usage:
                yield sse({**chunk(0, "", None), "choices": [], "usage": usage(started)})
            yield b"data: [DONE]\n\n"
        finally:
            request.cancel()  # a client that went away frees its row at once
        return
    waiters = {index: asyncio.ensure_future(next_event(request, events))
               for index, (request, events) in pending.items()}
    try:
        while waiters:
            done, _ = await asyncio.wait(waiters.values(), return_when=asyncio.FIRST_COMPLETED)
            for index in [i for i, w in waiters.items() if w in done]:
                kind, value = waiters.pop(index).result()
                request = pending[index][0]
                if kind == "error":
                    yield sse(failure(request, value).body())
                    continue
                for text, finish, logprobs in pieces(choices[index], kind, value):
                    yield sse(chunk(index, text, finish, logprobs))
                if kind == "delta":
                    waiters[index] = asyncio.ensure_future(next_event(request, pending[index][1]))
        if final_usage:
            yield sse({**chunk(0, "", None), "choices": [], "usage": usage(started)})
        yield b"data: [DONE]\n\n"
    finally:
        for w in waiters.values():
            w.cancel()
        for request, _ in pending.values():
            request.cancel()  # a client that went away frees its rows at once


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

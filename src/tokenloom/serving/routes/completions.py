"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` over the continuous-batching
:class:`~tokenloom.serving.engine.Engine`: the routes, and the helpers between them and the engine (prompts to engine
requests, their events to a reply or to server-sent events)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from ...generation.config import GenerationConfig, offset_seed
from .. import schema as api_schema
from ..checks import APIError, ClientGone, check_model, field, generation_settings, read_json
from ..engine import QueueFull, Request
from ..state import ServerState, server_state


def add_routes(router: APIRouter, state: ServerState) -> None:
    """The two routes; the schema lists them only for a language model (for another they answer 400
    unsupported_model)."""
    config, tokenizer = state.config, state.tokenizer
    router.add_api_route("/v1/completions", completions, methods=["POST"], include_in_schema=state.is_lm,
                         openapi_extra=api_schema.completions_operation(config, tokenizer,
                                                                        state.model.config.max_seq_len))
    router.add_api_route("/v1/chat/completions", chat, methods=["POST"], include_in_schema=state.is_lm,
                         openapi_extra=api_schema.chat_operation(config, tokenizer))


# --- the routes ---------------------------------------------------------------------------------------------------

async def lm_request(request: HTTPRequest, route: str) -> tuple[ServerState, dict]:
    """The server's state and the request's JSON body, for a route that needs a language model (400 otherwise),
    the body's ``model`` checked."""
    state = server_state(request)
    require_lm(state, route)
    body = await read_json(request, state.config.max_body_bytes)
    check_model(body, state.config)
    return state, body


async def completions(request: HTTPRequest):
    state, body = await lm_request(request, "/v1/completions")
    config = state.config
    prompt = field(body, "prompt", (str, list), required=True)
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise APIError(400, "'prompt' must be a string or a non-empty list of strings", param="prompt",
                       code="invalid_type")
    settings = generation_settings(body, config)
    if len(prompts) * settings["n"] > config.max_prompts:
        raise APIError(400, f"{len(prompts)} prompts x n={settings['n']} exceeds the server's limit of "
                            f"{config.max_prompts} completions per request", param="n", code="invalid_value")
    jobs = make_requests(state, prompts, settings, "prompt")
    return await reply(request, state, jobs, settings, "completions", "cmpl", "text_completion", completion_chunk,
                       lambda i, t, f: {"index": i, "text": t, "logprobs": None, "finish_reason": f})


async def chat(request: HTTPRequest):
    state, body = await lm_request(request, "/v1/chat/completions")
    config = state.config
    messages = field(body, "messages", (list,), required=True)
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                               and isinstance(m.get("role"), str) for m in messages):
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects with string "
                            "role and content", param="messages", code="invalid_type")
    prompt = "".join(m["content"] + "\n" for m in messages)  # no chat template: plain concatenation
    settings = generation_settings(body, config, default_max_tokens=config.max_tokens)
    settings["max_tokens"] = min(settings["max_tokens"], max(1, state.model.config.max_seq_len - len(
        encode(state, prompt, "messages")) - 1))
    jobs = make_requests(state, [prompt], settings, "messages")
    return await reply(request, state, jobs, settings, "chat", "chatcmpl", "chat.completion", chat_chunk,
                       lambda i, t, f: {"index": i, "message": {"role": "assistant", "content": t},
                                        "finish_reason": f})


async def reply(request: HTTPRequest, state: ServerState, jobs, settings: dict, route: str, id_prefix: str,
                object_name: str, chunk_builder, choice):
    """Run the jobs on the engine and answer: server-sent events (``chunk_builder(id, created, model, index, text,
    finish)`` per delta) when the request streams, else one reply of ``choice(index, text, finish)`` per choice."""
    config = state.config
    started = await submit(state, jobs, settings)
    state.metrics.count_request(route)
    rid, created = f"{id_prefix}-{uuid.uuid4().hex[:24]}", int(time.time())
    chunk = partial(chunk_builder, rid, created, config.model_name)
    if settings["stream"]:
        return StreamingResponse(state.metrics.timed(stream(started, chunk, settings["include_usage"]), started),
                                 media_type="text/event-stream")
    results = await state.metrics.timed_collect(while_connected(request, collect(started), started), started)
    return {"id": rid, "object": object_name, "created": created, "model": config.model_name,
            "choices": [choice(i, t, f) for i, t, f in sorted(results)], "usage": usage(started)}


def completion_chunk(rid: str, created: int, model_name: str, index: int, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_chunk(rid: str, created: int, model_name: str, index: int, text: str, finish: str | None) -> dict:
    delta = {"role": "assistant", "content": text} if text or finish is None else {}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


# --- prompts to engine requests -----------------------------------------------------------------------------------

def require_lm(state: ServerState, what: str) -> None:
    if state.engine is None:
        raise APIError(400, f"{what} needs a language model; this server serves a translation model: use "
                            "POST /v1/translations", code="unsupported_model")


def encode(state: ServerState, text: str, param: str) -> list[int]:
    try:
        ids = state.tokenizer.encode(text)
    except Exception as err:  # noqa: BLE001 — a tokenizer error (characters outside a char vocabulary)
        raise APIError(400, f"'{param}' cannot be encoded: {str(err).splitlines()[0]}", param=param,
                       code="invalid_value") from None
    if not ids:
        raise APIError(400, f"'{param}' is empty after tokenization", param=param, code="invalid_value")
    return ids


def make_requests(state: ServerState, prompts: list[str], settings: dict,
                  param: str) -> list[tuple[int, list[int], GenerationConfig]]:
    """(choice index, prompt ids, generation settings) of every choice: ``n`` per prompt."""
    context = state.model.config.max_seq_len
    out = []
    for p, text in enumerate(prompts):
        ids = encode(state, text, param)
        if len(ids) >= context:
            raise APIError(400, f"the prompt is {len(ids)} tokens; the model's context is {context} (prompt "
                                "plus at least one new token must fit)", param=param,
                           code="context_length_exceeded")
        for j in range(settings["n"]):
            seed = offset_seed(settings["seed"], j)
            gen = GenerationConfig(max_new_tokens=settings["max_tokens"], temperature=settings["temperature"],
                                   do_sample=settings["temperature"] > 0,
                                   top_p=settings["top_p"] if settings["top_p"] < 1 else None,
                                   top_k=settings["top_k"], seed=seed)
            out.append((p * settings["n"] + j, ids, gen))
    return out


async def submit(state: ServerState, jobs, settings) -> list[tuple[int, Request, asyncio.Queue]]:
    """Submit the jobs to the engine: (choice index, request, its event queue) each; 429 when the queue is
    full (the ones already queued are cancelled)."""
    started = []
    deadline = time.monotonic() + state.config.request_timeout
    try:
        for index, ids, gen in jobs:
            events: asyncio.Queue = asyncio.Queue()
            # put_nowait runs on this loop: the engine hands its events over through dispatch()
            request = Request(ids, gen, events.put_nowait, deadline=deadline, stop_strings=settings["stop"],
                              speculative=settings["speculative"])
            state.engine.submit(request)
            started.append((index, request, events))
    except QueueFull as err:
        for _, request, _ in started:
            request.cancel()
        raise APIError(429, str(err), type_="rate_limit_error", code="queue_full") from None
    return started


# --- engine events to replies -------------------------------------------------------------------------------------

def usage(started) -> dict:
    prompt = sum(len(r.prompt_ids) for _, r, _ in started)
    completion = sum(len(r.new_ids) for _, r, _ in started)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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


async def collect(started) -> list[tuple[int, str, str]]:
    """(index, text, finish_reason) of every request, waiting for all."""
    results = []
    try:
        for index, request, events in started:
            text = []
            while True:
                kind, value = await next_event(request, events)
                if kind == "delta":
                    text.append(value)
                elif kind == "done":
                    results.append((index, "".join(text), value))
                    break
                else:
                    raise APIError(504 if request.finish_reason == "timeout" else 500, value,
                                   type_="server_error", code="timeout" if request.finish_reason == "timeout"
                                   else "generation_failed")
    finally:
        for _, request, _ in started:
            request.cancel()  # no-op for finished ones; frees the rest (an error, a cancelled handler)
    return results


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


async def stream(started, chunk, final_usage: bool) -> AsyncIterator[bytes]:
    """Server-sent events: one chunk per text delta, in order of arrival across the choices."""
    pending = {index: (request, events) for index, request, events in started}
    if len(started) == 1:  # one choice (the common case): await its queue directly, no task per event
        index, request, events = started[0]
        try:
            while True:
                kind, value = await next_event(request, events)
                if kind == "delta":
                    yield sse(chunk(index, value, None))
                    continue
                if kind == "done":
                    yield sse(chunk(index, "", value))
                else:
                    yield sse(APIError(504 if request.finish_reason == "timeout" else 500, value,
                                       type_="server_error").body())
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
                if kind == "delta":
                    yield sse(chunk(index, value, None))
                    waiters[index] = asyncio.ensure_future(next_event(request, pending[index][1]))
                elif kind == "done":
                    yield sse(chunk(index, "", value))
                else:
                    yield sse(APIError(504 if request.finish_reason == "timeout" else 500, value,
                                       type_="server_error").body())
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

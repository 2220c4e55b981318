"""The HTTP API (FastAPI): OpenAI-compatible completions and chat completions over the continuous-batching
:class:`~tokenloom.serving.engine.Engine`, tokenloom's own ``/v1/translations`` for encoder-decoder and NAT
models, ``/v1/models``, ``/health``, ``/metrics`` (Prometheus text) and the playground page at ``/``.

Errors have OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``. Requests are read with a
size limit; every field is checked for its type and range; nothing in a request names a file. This module
needs the ``serve`` extra (fastapi, uvicorn).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from ..errors import ConfigError
from ..generation.config import MIN_TEMPERATURE, SEED_LIMIT, GenerationConfig, offset_seed
from . import schema as api_schema
from .engine import Engine, QueueFull, Request
from .metrics import Metrics
from .playground import PLAYGROUND_HTML
from .security import HostGuard, HostPolicy, bearer_token, check_api_key, check_cors_origins, is_json_media_type


@dataclass
class ServeConfig:
    """Server limits and settings (``tokenloom serve`` flags)."""

    model_name: str
    api_key: str | None = None
    max_batch: int = 16
    max_queue: int = 64
    max_tokens: int = 1024  # the largest max_tokens a request may ask for
    max_body_bytes: int = 1 << 20
    max_prompts: int = 32  # prompts x n per request
    request_timeout: float = 300.0  # seconds
    # browser safety (tokenloom.serving.security): the address bound, extra Host names (``*``: any), CORS origins
    host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()  # empty: CORS off

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_queue", "max_tokens", "max_body_bytes", "max_prompts"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(self, name)}")
        if not (isinstance(self.request_timeout, (int, float)) and 0 < self.request_timeout <= 86400 * 7):
            raise ConfigError(f"--request-timeout must be a number of seconds in (0, 604800], got "
                              f"{self.request_timeout}")  # NaN fails the comparison too
        self.host_policy = HostPolicy.create(self.host, self.allowed_hosts)  # a ConfigError for a bad entry
        self.cors_origins = check_cors_origins(self.cors_origins)
        if self.api_key is not None:
            check_api_key(self.api_key)


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

def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None, required: bool = False) -> Any:
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


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = _field(body, name, (int, float), default)
    if not (low < value <= high if low_open else low <= value <= high):
        raise APIError(400, f"'{name}' must be in {'(' if low_open else '['}{low}, {high}], got {value}", param=name,
                       code="invalid_value")
    return float(value)


def generation_settings(body: dict, config: ServeConfig, default_max_tokens: int = 16) -> dict[str, Any]:
    """max_tokens, temperature, top_p, top_k, stop, n, seed of an OpenAI request, checked."""
    max_tokens = min(default_max_tokens, config.max_tokens)
    for name in ("max_completion_tokens", "max_tokens"):  # both checked; max_tokens wins when both are given
        value = _field(body, name, (int,), None)
        if value is not None and not 1 <= value <= config.max_tokens:
            raise APIError(400, f"'{name}' must be in [1, {config.max_tokens}], got {value}", param=name,
                           code="invalid_value")
        max_tokens = max_tokens if value is None else value
    stop = _field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "'stop' must be a non-empty string or a list of at most 4 of them", param="stop",
                       code="invalid_value")
    top_k = _field(body, "top_k", (int,), None)
    if top_k is not None and top_k < 1:
        raise APIError(400, f"'top_k' must be >= 1, got {top_k}", param="top_k", code="invalid_value")
    n = _field(body, "n", (int,), 1)
    if not 1 <= n <= config.max_prompts:
        raise APIError(400, f"'n' must be in [1, {config.max_prompts}], got {n}", param="n", code="invalid_value")
    seed = _field(body, "seed", (int,), None)
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise APIError(400, f"'seed' must be in [0, 2^64), got {seed}", param="seed", code="invalid_value")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    if 0 < temperature < MIN_TEMPERATURE:
        raise APIError(400, f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE:.3g}, got {temperature}",
                       param="temperature", code="invalid_value")
    options = _field(body, "stream_options", (dict,), None) or {}
    return dict(max_tokens=max_tokens, temperature=temperature,
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), top_k=top_k, stop=stop, n=n, seed=seed,
                stream=bool(_field(body, "stream", (bool,), False)),
                include_usage=bool(_field(options, "include_usage", (bool,), False)))


def check_model(body: dict, config: ServeConfig) -> None:
    name = _field(body, "model", (str,), None)
    if name is not None and name != config.model_name:
        raise APIError(404, f"the model '{name}' does not exist; this server serves '{config.model_name}'",
                       param="model", code="model_not_found")


# --- the app ------------------------------------------------------------------------------------------------------

def create_app(model, tokenizer, config: ServeConfig):
    """The FastAPI app serving ``model`` (GPT: completions; encoder-decoder or NAT: translations)."""
    metrics = Metrics()
    is_lm = hasattr(model, "ragged_step")
    loop_box: list[asyncio.AbstractEventLoop] = []

    def dispatch(events: list) -> None:  # engine thread: one wake-up of the event loop per step
        loop_box[0].call_soon_threadsafe(_deliver_all, events)

    engine = Engine(model, tokenizer, config.max_batch, config.max_queue, on_step=metrics.on_step,
                    dispatch=dispatch) if is_lm else None
    translate_lock = asyncio.Lock()

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        loop_box.append(asyncio.get_running_loop())
        if engine is not None:
            engine.start()
        yield
        if engine is not None:
            engine.stop()

    # /openapi.json is public documentation (no API key, like /health): the request and reply schemas of every
    # route (tokenloom.serving.schema), for clients and for fuzzers; no docs pages
    from .. import __version__

    app = FastAPI(title="tokenloom", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", description=f"OpenAI-compatible API serving {config.model_name} "
                  f"({'a language' if is_lm else 'a translation'} model)")
    context = model.config.max_seq_len

    @app.exception_handler(APIError)
    async def api_error(_request, error: APIError):
        metrics.count_error(error.status)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(404)
    async def not_found(request, _error):
        return JSONResponse(APIError(404, f"no route {request.method} {request.url.path}", code="not_found").body(),
                            status_code=404)

    @app.exception_handler(405)
    async def not_allowed(request, error):
        return JSONResponse(APIError(405, f"{request.method} is not allowed on {request.url.path}",
                                     code="method_not_allowed").body(), status_code=405,
                            headers=getattr(error, "headers", None))  # Allow: the route's methods

    @app.exception_handler(ClientGone)
    async def client_gone(_request, _error):
        return Response(status_code=499)  # nobody reads it (499: nginx's "client closed request", in the log)

    key = check_api_key(config.api_key) if config.api_key is not None else None  # UTF-8 bytes
    post_paths: set[str] = set()  # the routes that take a POST body (filled at the first request)

    @app.middleware("http")
    async def guard(request: HTTPRequest, call_next):
        path = request.url.path
        if key is not None and (path.startswith("/v1/") or path == "/metrics"):
            token = bearer_token(request.scope["headers"])  # raw bytes: a non-ASCII key sent as UTF-8 matches
            if not token:
                return _error(401, "missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")
            if not hmac.compare_digest(token, key):
                return _error(401, "incorrect API key", code="invalid_api_key")
        if not post_paths:
            post_paths.update(r.path for r in app.routes if isinstance(r, APIRoute) and "POST" in r.methods)
        if request.method == "POST" and path in post_paths and \
                not is_json_media_type(request.headers.get("content-type")):
            # a web page may POST text/plain or a form to any address without asking; application/json needs
            # a CORS preflight, which only --cors-origin origins pass
            return _error(415, "send the body as JSON with 'Content-Type: application/json'",
                          code="unsupported_media_type")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > config.max_body_bytes):
            return _error(413, f"request body over the server's limit of {config.max_body_bytes} bytes",
                          code="body_too_large")
        return await call_next(request)

    def _error(status: int, message: str, code: str) -> JSONResponse:
        metrics.count_error(status)
        return JSONResponse(APIError(status, message, code=code).body(), status_code=status)

    def wrong_host(host: str) -> JSONResponse:
        shown = host if len(host) <= 80 else host[:80] + "..."
        return _error(400, f"the Host header {shown!r} is not one this server answers (a page on another site, "
                           "or DNS rebinding); start it with --allowed-hosts NAME to serve that name",
                      code="host_not_allowed")

    if config.cors_origins:  # CORS off unless asked for: no Access-Control-* headers, preflights not approved
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)  # outside guard:
        # preflights need no key, and a page of an allowed origin can read its 401 and 415 errors
    app.add_middleware(HostGuard, policy=config.host_policy, reject=wrong_host)  # outermost: every request

    async def read_json(request: HTTPRequest) -> dict:
        body = b""
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > config.max_body_bytes:
                    raise APIError(413, f"request body over the server's limit of {config.max_body_bytes} bytes",
                                   code="body_too_large")
        except ClientDisconnect:  # the client left mid-body
            raise ClientGone() from None
        return parse_json(body)

    @app.get("/", response_class=HTMLResponse, responses=api_schema.get_responses("playground"))
    async def playground():
        return HTMLResponse(PLAYGROUND_HTML.replace("{{MODEL}}", config.model_name)
                            .replace("{{KIND}}", "lm" if is_lm else "translation"))

    @app.get("/health", responses=api_schema.get_responses("health"))
    async def health():
        if engine is not None and not engine.alive:  # the watchdog: a stopped engine serves nothing
            return JSONResponse({"status": "error", "model": config.model_name,
                                 "error": "the generation engine has stopped; restart the server"}, status_code=503)
        return {"status": "ok", "model": config.model_name,
                "active": engine.active if engine else 0, "queued": engine.queued if engine else 0}

    @app.get("/v1/models", responses=api_schema.get_responses("models"))
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "tokenloom"}]}

    @app.get("/metrics", response_class=PlainTextResponse, responses=api_schema.get_responses("metrics"))
    async def prometheus():
        return PlainTextResponse(metrics.render(engine, config.max_batch),
                                 media_type="text/plain; version=0.0.4")

    def encode(text: str, param: str) -> list[int]:
        try:
            ids = tokenizer.encode(text)
        except Exception as err:  # noqa: BLE001 — a tokenizer error (characters outside a char vocabulary)
            raise APIError(400, f"'{param}' cannot be encoded: {str(err).splitlines()[0]}", param=param,
                           code="invalid_value") from None
        if not ids:
            raise APIError(400, f"'{param}' is empty after tokenization", param=param, code="invalid_value")
        return ids

    def make_requests(prompts: list[str], settings: dict, param: str) -> list[tuple[int, list[int], Request]]:
        context = model.config.max_seq_len
        out = []
        for p, text in enumerate(prompts):
            ids = encode(text, param)
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

    async def run(jobs, settings) -> list[tuple[int, Request, asyncio.Queue]]:
        """Submit the jobs to the engine: (choice index, request, its event queue) each; 429 when the queue is
        full (the ones already queued are cancelled)."""
        started = []
        deadline = time.monotonic() + config.request_timeout
        try:
            for index, ids, gen in jobs:
                events: asyncio.Queue = asyncio.Queue()
                # put_nowait runs on this loop: the engine hands its events over through dispatch()
                request = Request(ids, gen, events.put_nowait, deadline=deadline, stop_strings=settings["stop"])
                engine.submit(request)
                started.append((index, request, events))
        except QueueFull as err:
            for _, request, _ in started:
                request.cancel()
            raise APIError(429, str(err), type_="rate_limit_error", code="queue_full") from None
        return started

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
        watcher = asyncio.ensure_future(_disconnected(http_request))
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

    async def stream(started, chunk, final_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events: one chunk per text delta, in order of arrival across the choices."""
        pending = {index: (request, events) for index, request, events in started}
        if len(started) == 1:  # one choice (the common case): await its queue directly, no task per event
            index, request, events = started[0]
            try:
                while True:
                    kind, value = await next_event(request, events)
                    if kind == "delta":
                        yield _sse(chunk(index, value, None))
                        continue
                    if kind == "done":
                        yield _sse(chunk(index, "", value))
                    else:
                        yield _sse(APIError(504 if request.finish_reason == "timeout" else 500, value,
                                            type_="server_error").body())
                    break
                if final_usage:
                    yield _sse({**chunk(0, "", None), "choices": [], "usage": usage(started)})
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
                        yield _sse(chunk(index, value, None))
                        waiters[index] = asyncio.ensure_future(next_event(request, pending[index][1]))
                    elif kind == "done":
                        yield _sse(chunk(index, "", value))
                    else:
                        yield _sse(APIError(504 if request.finish_reason == "timeout" else 500, value,
                                            type_="server_error").body())
            if final_usage:
                yield _sse({**chunk(0, "", None), "choices": [], "usage": usage(started)})
            yield b"data: [DONE]\n\n"
        finally:
            for w in waiters.values():
                w.cancel()
            for request, _ in pending.values():
                request.cancel()  # a client that went away frees its rows at once

    def require_lm(what: str) -> None:
        if engine is None:
            raise APIError(400, f"{what} needs a language model; this server serves a translation model: use "
                                "POST /v1/translations", code="unsupported_model")

    # the schema lists the routes this model serves (the others answer 400 unsupported_model)
    @app.post("/v1/completions", include_in_schema=is_lm,
              openapi_extra=api_schema.completions_operation(config, tokenizer, context))
    async def completions(request: HTTPRequest):
        require_lm("/v1/completions")
        body = await read_json(request)
        check_model(body, config)
        prompt = _field(body, "prompt", (str, list), required=True)
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise APIError(400, "'prompt' must be a string or a non-empty list of strings", param="prompt",
                           code="invalid_type")
        settings = generation_settings(body, config)
        if len(prompts) * settings["n"] > config.max_prompts:
            raise APIError(400, f"{len(prompts)} prompts x n={settings['n']} exceeds the server's limit of "
                                f"{config.max_prompts} completions per request", param="n", code="invalid_value")
        jobs = make_requests(prompts, settings, "prompt")
        started = await run(jobs, settings)
        metrics.count_request("completions")
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(index, text, finish):
            return {"id": rid, "object": "text_completion", "created": created, "model": config.model_name,
                    "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}

        if settings["stream"]:
            return StreamingResponse(metrics.timed(stream(started, chunk, settings["include_usage"]), started),
                                     media_type="text/event-stream")
        results = await metrics.timed_collect(while_connected(request, collect(started), started), started)
        return {"id": rid, "object": "text_completion", "created": created, "model": config.model_name,
                "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": f}
                            for i, t, f in sorted(results)], "usage": usage(started)}

    @app.post("/v1/chat/completions", include_in_schema=is_lm,
              openapi_extra=api_schema.chat_operation(config, tokenizer))
    async def chat(request: HTTPRequest):
        require_lm("/v1/chat/completions")
        body = await read_json(request)
        check_model(body, config)
        messages = _field(body, "messages", (list,), required=True)
        if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                   and isinstance(m.get("role"), str) for m in messages):
            raise APIError(400, "'messages' must be a non-empty list of {role, content} objects with string "
                                "role and content", param="messages", code="invalid_type")
        prompt = "".join(m["content"] + "\n" for m in messages)  # no chat template: plain concatenation
        settings = generation_settings(body, config, default_max_tokens=config.max_tokens)
        settings["max_tokens"] = min(settings["max_tokens"], max(1, model.config.max_seq_len - len(
            encode(prompt, "messages")) - 1))
        jobs = make_requests([prompt], settings, "messages")
        started = await run(jobs, settings)
        metrics.count_request("chat")
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(index, text, finish):
            delta = {"role": "assistant", "content": text} if text or finish is None else {}
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": config.model_name,
                    "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}

        if settings["stream"]:
            return StreamingResponse(metrics.timed(stream(started, chunk, settings["include_usage"]), started),
                                     media_type="text/event-stream")
        results = await metrics.timed_collect(while_connected(request, collect(started), started), started)
        return {"id": rid, "object": "chat.completion", "created": created, "model": config.model_name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": f}
                            for i, t, f in sorted(results)], "usage": usage(started)}

    @app.post("/v1/translations", include_in_schema=not is_lm,
              openapi_extra=api_schema.translations_operation(config, tokenizer, MAX_INPUTS, MAX_BEAM))
    async def translations(request: HTTPRequest):
        if engine is not None:
            raise APIError(400, "/v1/translations needs an encoder-decoder or NAT model; this server serves a "
                                "language model: use /v1/completions", code="unsupported_model")
        body = await read_json(request)
        check_model(body, config)
        given = _field(body, "input", (str, list), required=True)
        sources = [given] if isinstance(given, str) else given
        if not sources or not all(isinstance(s, str) for s in sources) or len(sources) > MAX_INPUTS:
            raise APIError(400, f"'input' must be a string or a list of 1-{MAX_INPUTS} strings", param="input",
                           code="invalid_type")
        beam = _field(body, "beam", (int,), 1)
        if not 1 <= beam <= MAX_BEAM:
            raise APIError(400, f"'beam' must be in [1, {MAX_BEAM}], got {beam}", param="beam", code="invalid_value")
        options = {} if hasattr(model, "decode_parallel") else {"beam": beam}
        from ..errors import TokenloomError
        from ..tasks.translation import translate

        started = time.monotonic()
        async with translate_lock:  # one translation batch at a time on the model
            try:
                out = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: _translate(translate, model, tokenizer, sources, options))
            except TokenloomError as err:
                raise APIError(400, str(err), param="input", code="invalid_value") from None
        metrics.count_request("translations")
        metrics.observe_latency(time.monotonic() - started)
        return {"object": "list", "model": config.model_name,
                "data": [{"index": i, "translation": t} for i, t in enumerate(out)]}

    app.state.engine, app.state.metrics = engine, metrics
    app.add_middleware(CatchAll, metrics=metrics)  # added last: the outermost, around every other middleware
    return app


MAX_INPUTS, MAX_BEAM = 256, 8  # sentences per translation request, beam width


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


async def _disconnected(request: HTTPRequest) -> None:
    """Return once the client has gone (after the body has been read, the ASGI receive channel has nothing else to
    say but ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # (a server that repeats empty body messages: do not spin)


class CatchAll:
    """ASGI middleware: an exception that escapes a handler becomes a JSON 500 (``server_error`` /
    ``internal_error``, one line, no traceback in the body), logged once to stderr as one line; a reply already
    begun is ended where it is. The server goes on."""

    def __init__(self, app, metrics: Metrics | None = None) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        begun = False

        async def send_tracked(message) -> None:
            nonlocal begun
            begun = begun or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as err:  # noqa: BLE001 — one request's failure must not become a traceback
            detail = (str(err).splitlines() or [""])[0][:300]
            print(f"error: {scope.get('method')} {scope.get('path')} failed: {type(err).__name__}: {detail}",
                  file=sys.stderr, flush=True)
            if self.metrics is not None:
                self.metrics.count_error(500)
            try:
                if not begun:
                    await JSONResponse(APIError(500, f"the server failed on this request ({type(err).__name__}); "
                                                     "see its log", type_="server_error", code="internal_error")
                                       .body(), status_code=500)(scope, receive, send)
                else:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            except Exception:  # noqa: BLE001, S110 — the client is gone: nothing to tell it
                pass


def _translate(translate, model, tokenizer, sources, options):
    import torch

    with torch.inference_mode():
        return translate(model, tokenizer, sources, truncate=True, **options)


def _deliver_all(events: list) -> None:
    for emit, event in events:
        emit(event)


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

"""The routes every server has: the playground page (``/``), ``/health``, ``/v1/models`` and ``/metrics``
(Prometheus text)."""

from __future__ import annotations

import html

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from .. import schema as api_schema
from ..playground import PLAYGROUND_HTML
from ..state import server_state


def add_routes(router: APIRouter) -> None:
    router.add_api_route("/", playground, methods=["GET"], response_class=HTMLResponse,
                         responses=api_schema.get_responses("playground"))
    router.add_api_route("/health", health, methods=["GET"], responses=api_schema.get_responses("health"))
    router.add_api_route("/v1/models", models, methods=["GET"], responses=api_schema.get_responses("models"))
    router.add_api_route("/metrics", prometheus, methods=["GET"], response_class=PlainTextResponse,
                         responses=api_schema.get_responses("metrics"))


async def playground(request: HTTPRequest):
    state = server_state(request)
    return HTMLResponse(PLAYGROUND_HTML.replace("{{MODEL}}", html.escape(state.config.model_name))
                        .replace("{{KIND}}", "lm" if state.is_lm else "translation"))


async def health(request: HTTPRequest):
    state = server_state(request)
    engine, name = state.engine, state.config.model_name
    if engine is not None and not engine.alive:  # the watchdog: a stopped engine serves nothing
        return JSONResponse({"status": "error", "model": name,
                             "error": "the generation engine has stopped; restart the server"}, status_code=503)
    return {"status": "ok", "model": name, "active": engine.active if engine else 0,
            "queued": engine.queued if engine else 0}


async def models(request: HTTPRequest):
    return {"object": "list", "data": [{"id": server_state(request).config.model_name, "object": "model",
                                        "created": 0, "owned_by": "tokenloom"}]}


async def prometheus(request: HTTPRequest):
    state = server_state(request)
    return PlainTextResponse(state.metrics.render(state.engine, state.config.max_batch),
                             media_type="text/plain; version=0.0.4")

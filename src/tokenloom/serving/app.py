"""The HTTP API (FastAPI): OpenAI-compatible completions and chat completions over the continuous-batching
:class:`~tokenloom.serving.engine.Engine`, tokenloom's own ``/v1/translations`` for encoder-decoder and NAT
models, ``/v1/models``, ``/health``, ``/metrics`` (Prometheus text) and the playground page at ``/``.

Errors have OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``. Requests are read with a
size limit; every field is checked for its type and range; nothing in a request names a file. This module
needs the ``serve`` extra (fastapi, uvicorn).

:func:`create_app` assembles the parts: the shared :class:`~.state.ServerState`, the exception handlers and the
middleware (:mod:`.middleware`), the request checks (:mod:`.checks`) and the routers (:mod:`.routes`).
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from .checks import APIError, ClientGone, check_model, generation_settings, parse_json
from .config import ServeConfig
from .middleware import CatchAll, api_error, client_gone, guard, not_allowed, not_found
from .routes import completions, system, translations
from .routes import tokenizer as tokenizer_routes
from .routes.translations import MAX_BEAM, MAX_INPUTS
from .security import HostGuard
from .state import ServerState

__all__ = ["MAX_BEAM", "MAX_INPUTS", "APIError", "CatchAll", "ClientGone", "ServeConfig", "check_model",
           "create_app", "generation_settings", "parse_json"]


def create_app(model, tokenizer, config: ServeConfig, draft=None, rag=None):  # noqa: ANN001
    """The FastAPI app serving ``model`` (GPT: completions; encoder-decoder or NAT: translations); ``draft``: a
    draft model for speculative decoding (``config.prompt_lookup``: prompt lookup instead); ``rag``: a
    :class:`~.routes.rag.RagService` for POST /v1/rag."""
    state = ServerState.create(model, tokenizer, config, draft)
    state.rag = rag
    # /openapi.json is public documentation (no API key, like /health): the request and reply schemas of every
    # route (tokenloom.serving.schema), for clients and for fuzzers; no docs pages
    from .. import __version__

    app = FastAPI(title="tokenloom", version=__version__, lifespan=state.lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", description=f"OpenAI-compatible API serving {config.model_name} "
                  f"({'a language' if state.is_lm else 'a translation'} model)")
    app.state.server = state
    app.state.engine, app.state.metrics = state.engine, state.metrics

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(404, not_found)
    app.add_exception_handler(405, not_allowed)
    app.add_exception_handler(ClientGone, client_gone)

    # middleware, innermost first (each one added wraps the ones before it)
    app.middleware("http")(guard)  # API key, JSON content type, body size
    if config.cors_origins:  # CORS off unless asked for: no Access-Control-* headers, preflights not approved
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)  # outside guard:
        # preflights need no key, and a page of an allowed origin can read its 401 and 415 errors
    app.add_middleware(HostGuard, policy=config.host_policy, reject=state.wrong_host)  # every request

    # the routes go straight onto the app's own router: app.routes stays the flat list of APIRoutes that guard reads
    # (FastAPI's include_router would add one lazy _IncludedRouter entry per router instead)
    system.add_routes(app.router)
    # the schema lists the routes this model serves (the others answer 400 unsupported_model)
    completions.add_routes(app.router, state)
    translations.add_routes(app.router, state)
    tokenizer_routes.add_routes(app.router, state)  # vLLM's /tokenize, /detokenize, /tokenizer_info (a language model)
    if rag is not None:  # serve --rag: POST /v1/rag (needs the rag extra's bm25s)
        from .routes import rag as rag_routes

        rag_routes.add_routes(app.router, state)

    app.add_middleware(CatchAll, metrics=state.metrics)  # added last: the outermost, around every other middleware
    return app

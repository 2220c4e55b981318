"""The app's exception handlers (an :class:`~.checks.APIError` and Starlette's 404/405 in OpenAI's error shape, a
client that left as a silent 499), the ``guard`` middleware (API key, JSON content type, body size) and
:class:`CatchAll`, the outermost middleware: an exception that escapes becomes a one-line JSON 500."""

from __future__ import annotations

import hmac
import sys

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from .checks import APIError, ClientGone
from .metrics import Metrics
from .security import bearer_token, is_json_media_type
from .state import server_state

# --- exception handlers -------------------------------------------------------------------------------------------

async def api_error(request: HTTPRequest, error: APIError) -> JSONResponse:
    server_state(request).metrics.count_error(error.status)
    return JSONResponse(error.body(), status_code=error.status)


async def not_found(request: HTTPRequest, _error) -> JSONResponse:
    return JSONResponse(APIError(404, f"no route {request.method} {request.url.path}", code="not_found").body(),
                        status_code=404)


async def not_allowed(request: HTTPRequest, error) -> JSONResponse:
    return JSONResponse(APIError(405, f"{request.method} is not allowed on {request.url.path}",
                                 code="method_not_allowed").body(), status_code=405,
                        headers=getattr(error, "headers", None))  # Allow: the route's methods


async def client_gone(_request: HTTPRequest, _error: ClientGone) -> Response:
    return Response(status_code=499)  # nobody reads it (499: nginx's "client closed request", in the log)


# --- middleware ---------------------------------------------------------------------------------------------------

KEYED = {"/metrics", "/tokenize", "/detokenize", "/tokenizer_info"}  # behind the API key, besides /v1/


async def guard(request: HTTPRequest, call_next):
    """The API key (on /v1/, /metrics and the tokenizer routes), a JSON content type on every POST route, the
    body-size limit announced by Content-Length: checked before a route runs (the ``http`` middleware, innermost)."""
    state = server_state(request)
    path, key, config = request.url.path, state.api_key, state.config
    if key is not None and (path.startswith("/v1/") or path in KEYED):
        token = bearer_token(request.scope["headers"])  # raw bytes: a non-ASCII key sent as UTF-8 matches
        if not token:
            return state.error_response(401, "missing API key: send 'Authorization: Bearer KEY'",
                                        code="invalid_api_key")
        if not hmac.compare_digest(token, key):
            return state.error_response(401, "incorrect API key", code="invalid_api_key")
    if not state.post_paths:
        state.post_paths.update(r.path for r in request.app.routes if isinstance(r, APIRoute) and "POST" in r.methods)
    if request.method == "POST" and path in state.post_paths and \
            not is_json_media_type(request.headers.get("content-type")):
        # a web page may POST text/plain or a form to any address without asking; application/json needs
        # a CORS preflight, which only --cors-origin origins pass
        return state.error_response(415, "send the body as JSON with 'Content-Type: application/json'",
                                    code="unsupported_media_type")
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > config.max_body_bytes):
        return state.error_response(413, f"request body over the server's limit of {config.max_body_bytes} bytes",
                                    code="body_too_large")
    return await call_next(request)


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

"""The HTTP/1.1 transport of ``tokenloom serve``: uvicorn's h11 protocol with the limits a server that faces
untrusted clients needs (uvicorn's defaults have none of them for a connection that never completes a request).

* **Idle connections** are closed after ``timeout_keep_alive`` seconds without a byte: between two requests (uvicorn
  does this) and, here, also before the first one, so a socket that connects and says nothing holds its file
  descriptor for seconds, not forever.
* **Slow requests** (slowloris): once its first byte has arrived, a request must arrive whole (headers and body)
  within ``timeout_read`` seconds. Trickling bytes does not reset it; a partial request gets ``408`` and the
  connection closes. A handler still waiting for the body sees the client as gone.
* **Header size**: h11 refuses a request line plus headers over ``max_header_bytes`` with ``431`` (httptools, the
  parser uvicorn prefers, has no such limit: it buffered a 100 MB header line), which is why this transport is h11.
* **Connections**: over ``limit_concurrency`` open connections or running requests, a request gets ``503``
  (as uvicorn's own limit does, but in JSON); a connection beyond twice that is closed as soon as it is accepted,
  so silent sockets cannot fill the process's file descriptors.
* HTTP/1.0 clients get a close-delimited body instead of chunked encoding (h11 frames by the peer's version).

The error replies written here (400, 408, 431, 503) have the API's JSON shape.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from ..errors import ConfigError


@dataclass
class TransportLimits:
    """The transport flags of ``tokenloom serve``."""

    timeout_keep_alive: float = 5.0  # seconds an idle connection stays open (before and between requests)
    timeout_read: float = 30.0  # seconds a request has to arrive whole once its first byte has come
    limit_concurrency: int = 256  # open connections or running requests before 503
    max_header_bytes: int = 65536  # request line plus headers

    def __post_init__(self) -> None:
        for name in ("timeout_keep_alive", "timeout_read"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 < value <= 86400):
                raise ConfigError(f"--{name.replace('_', '-')} must be a number of seconds in (0, 86400], got "
                                  f"{value}")
        if not 1 <= self.limit_concurrency <= 1_000_000:
            raise ConfigError(f"--limit-concurrency must be in [1, 1000000], got {self.limit_concurrency}")
        if not 1024 <= self.max_header_bytes <= 16 << 20:
            raise ConfigError(f"--max-header-bytes must be in [1024, {16 << 20}], got {self.max_header_bytes}")

    @property
    def max_connections(self) -> int:
        """Open connections beyond which a new one is closed on arrival."""
        return 2 * self.limit_concurrency + 16

    def uvicorn_options(self) -> dict:
        """Keyword arguments for ``uvicorn.run`` / ``uvicorn.Config``."""
        protocol = type("TokenloomH11Protocol", (LimitedH11Protocol,),
                        {"timeout_read": self.timeout_read, "max_connections": self.max_connections,
                         "max_header_bytes": self.max_header_bytes, "limit": self.limit_concurrency})
        return dict(http=protocol, ws="none", timeout_keep_alive=self.timeout_keep_alive,
                    h11_max_incomplete_event_size=self.max_header_bytes)  # the concurrency limit: the protocol's


class _Connection(h11.Connection):
    """An h11 connection that refuses a request line plus headers over ``max_header_bytes`` even when they arrive
    in one piece (h11 itself only limits what it buffers while waiting for the rest), and remembers the status its
    last protocol error suggests (431 for the header limit)."""

    error_status = 400

    def __init__(self, max_header_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self.max_header_bytes = max_header_bytes

    def next_event(self):  # noqa: ANN201 - h11's signature
        try:
            event = super().next_event()
            if type(event) is h11.Request and _head_size(event) > self.max_header_bytes:
                self._process_error(self.their_role)  # as h11 does for its own errors: their state is ERROR
                raise h11.RemoteProtocolError("request headers too large", error_status_hint=431)
            return event
        except h11.RemoteProtocolError as err:
            self.error_status = err.error_status_hint
            raise


def _head_size(request: h11.Request) -> int:
    """Bytes of the request line and headers (as sent, give or take the spaces h11 strips)."""
    return len(request.method) + len(request.target) + 12 + sum(len(k) + len(v) + 4 for k, v in request.headers)


def _error_body(message: str, code: str, type_: str = "invalid_request_error") -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with an idle timeout from the start, a whole-request read timeout, a connection cap
    and JSON error replies (see the module docstring). :meth:`TransportLimits.uvicorn_options` makes a subclass
    with the class attributes set."""

    timeout_read: float = 30.0
    limit: int = 256
    max_connections: int = 528
    max_header_bytes: int = 65536

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(self.config.h11_max_incomplete_event_size or self.max_header_bytes)
        self._read_timer = None
        self.app = self._limited(self.app)

    def _limited(self, app):  # noqa: ANN001, ANN202 - ASGI apps
        """``app`` behind the concurrency limit: over ``limit`` connections or running requests (this one
        counted), a JSON 503."""

        async def limited(scope, receive, send) -> None:  # noqa: ANN001
            if len(self.connections) > self.limit or len(self.tasks) > self.limit:
                body = _error_body(f"the server is at its limit of {self.limit} connections or requests "
                                   "(--limit-concurrency); retry later", "overloaded", "server_error")
                await send({"type": "http.response.start", "status": 503, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
                return
            await app(scope, receive, send)

        return limited

    def connection_made(self, transport) -> None:  # noqa: ANN001 - asyncio's signature
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.transport.close()  # over the cap: closed on arrival, before it holds anything else
            return
        # uvicorn starts its keep-alive timer only after a response: a connection that never sends stays idle here
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None and self.conn.their_state is h11.IDLE:
            self._read_timer = self.loop.call_later(self.timeout_read, self._read_timed_out)
        super().data_received(data)
        if self._read_timer is not None and not self._partial_request():
            self._cancel_read_timer()  # the request has arrived whole (or the connection is done)

    def _partial_request(self) -> bool:
        """Whether part of a request has arrived and the rest has not: headers begun, or a body under way."""
        state = self.conn.their_state
        return state is h11.SEND_BODY or (state is h11.IDLE and bool(self.conn.trailing_data[0]))

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if not self._partial_request():
            return
        if (self.cycle is None or self.cycle.response_complete) and self.conn.our_state is h11.IDLE:
            self._send_error(408, f"the request did not arrive within {self.timeout_read:g} seconds",
                             "request_timeout")
        self.transport.close()  # a handler still reading the body sees the client as gone

    def send_400_response(self, msg: str) -> None:  # h11 refused the request: 431 for the header limit, else 400
        if self.conn.error_status == 431:
            self._send_error(431, f"request headers over the server's limit of {self.max_header_bytes} bytes",
                             "headers_too_large")
        else:
            self._send_error(400, "invalid HTTP request", "invalid_http")
        self.transport.close()

    def _send_error(self, status: int, message: str, code: str) -> None:
        body = _error_body(message, code)
        try:
            for event in (h11.Response(status_code=status, reason=STATUS_PHRASES[status], headers=[
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")]), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # a response has already begun on this connection: just close
            pass

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
* **Requests**: over ``limit_concurrency`` running requests, a request gets ``503`` (as uvicorn's own limit does,
  but in JSON).
* **Connections** (:class:`ConnectionPool`): past ``limit_connections`` open connections, a new one makes room by
  shedding the connections that are idle (no request begun: silent since they connected, or kept alive between
  requests), the longest idle first, so silent sockets can neither fill the process's file descriptors nor keep a
  new client out. When none is idle, the newcomer is kept and its request gets a JSON ``503`` (read, then
  answered: an HTTP client reports a 503, not a reset); only past twice the cap (or what the file-descriptor limit
  leaves) is a connection closed as soon as it is accepted. The cap is sized under the process's RLIMIT_NOFILE
  (:func:`raise_fd_limit` raises its soft limit to the hard one when ``serve`` starts).
* HTTP/1.0 clients get a close-delimited body instead of chunked encoding (h11 frames by the peer's version).

The error replies written here (400, 408, 431, 503) have the API's JSON shape.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from ..errors import ConfigError

FD_RESERVE = 128  # file descriptors left for everything but client connections (checkpoint, logs, the loop's own)
FD_TARGET = 1 << 20  # the soft RLIMIT_NOFILE that raise_fd_limit asks for at most (the hard limit may be unlimited)


def raise_fd_limit() -> int | None:
    """Raise the process's soft RLIMIT_NOFILE (``ulimit -n``) to its hard limit (at most :data:`FD_TARGET`), as
    servers do at start; the soft limit afterwards, or None where there is none to size under (no ``resource``
    module, or unlimited)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = FD_TARGET if hard == resource.RLIM_INFINITY else min(hard, FD_TARGET)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # (macOS refuses more than its OPEN_MAX): keep the soft limit
            pass
    return None if soft == resource.RLIM_INFINITY else soft


@dataclass
class TransportLimits:
    """The transport flags of ``tokenloom serve``, and the file-descriptor limit the connection cap is sized
    under."""

    timeout_keep_alive: float = 5.0  # seconds an idle connection stays open (before and between requests)
    timeout_read: float = 30.0  # seconds a request has to arrive whole once its first byte has come
    limit_concurrency: int = 256  # running requests before 503
    limit_connections: int | None = None  # open connections before idle ones are shed (None: 2 x
    #   limit_concurrency + 16, at most what fd_limit leaves)
    backlog: int = 2048  # connections the kernel queues before the server accepts them (listen's backlog)
    max_header_bytes: int = 65536  # request line plus headers
    fd_limit: int | None = None  # the process's soft RLIMIT_NOFILE (raise_fd_limit); None: not known

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
        if not 1 <= self.backlog <= 65535:
            raise ConfigError(f"--backlog must be in [1, 65535], got {self.backlog}")
        room = self.fd_room
        if room is not None and room < 16:
            raise ConfigError(f"the file-descriptor limit (ulimit -n {self.fd_limit}) leaves {max(room, 0)} for "
                              f"connections; raise it to at least {FD_RESERVE + 16}")
        if self.limit_connections is None:
            self.limit_connections = min(2 * self.limit_concurrency + 16, room or 1_000_000)
        elif not 1 <= self.limit_connections <= 1_000_000:
            raise ConfigError(f"--limit-connections must be in [1, 1000000], got {self.limit_connections}")
        elif room is not None and self.limit_connections > room:
            raise ConfigError(f"--limit-connections {self.limit_connections} is over what the file-descriptor limit "
                              f"allows (ulimit -n {self.fd_limit} leaves {room} for connections): raise ulimit -n "
                              "or lower --limit-connections")

    @property
    def fd_room(self) -> int | None:
        """File descriptors the limit leaves for connections (None: no limit known)."""
        return None if self.fd_limit is None else self.fd_limit - FD_RESERVE

    @property
    def max_connections(self) -> int:
        """Open connections beyond which a new one sheds idle ones (or, when none is idle, gets 503)."""
        return self.limit_connections

    @property
    def connection_ceiling(self) -> int:
        """Open connections beyond which a new one is closed on arrival: twice the cap, at most what the
        file-descriptor limit leaves."""
        room = self.fd_room
        return 2 * self.max_connections if room is None else max(self.max_connections, min(2 * self.max_connections,
                                                                                            room))

    def uvicorn_options(self) -> dict:
        """Keyword arguments for ``uvicorn.run`` / ``uvicorn.Config`` (one :class:`ConnectionPool` for the
        server they start)."""
        protocol = type("TokenloomH11Protocol", (LimitedH11Protocol,),
                        {"timeout_read": self.timeout_read, "max_header_bytes": self.max_header_bytes,
                         "limit": self.limit_concurrency,
                         "pool": ConnectionPool(self.max_connections, self.connection_ceiling)})
        return dict(http=protocol, ws="none", timeout_keep_alive=self.timeout_keep_alive, backlog=self.backlog,
                    h11_max_incomplete_event_size=self.max_header_bytes)  # the concurrency limit: the protocol's


class ConnectionPool:
    """A server's open connections counted against its cap, and the idle ones among them (no request begun), the
    longest idle first: the ones a newcomer past the cap sheds. O(1) per event."""

    def __init__(self, cap: int, ceiling: int) -> None:
        self.cap, self.ceiling = cap, ceiling  # shed idle ones past cap; close newcomers on arrival past ceiling
        self.open = 0  # connections counted (accepted, not yet shed or lost)
        self.idle: OrderedDict[LimitedH11Protocol, None] = OrderedDict()  # in the order they became idle
        self.counted: set[LimitedH11Protocol] = set()
        self.shed = 0  # connections shed so far

    def admit(self, conn: LimitedH11Protocol) -> bool | None:
        """Count a new connection, shedding idle ones (longest idle first) while the count is past the cap:
        True when it fits, False when it is past the cap with nothing idle left to shed (its request gets 503),
        None when it is past the ceiling (close it: not counted)."""
        while self.open >= self.cap and self.idle:
            victim, _ = self.idle.popitem(last=False)
            self.counted.discard(victim)
            self.open -= 1
            self.shed += 1
            victim.shed()
        if self.open >= self.ceiling:
            return None
        self.open += 1
        self.counted.add(conn)
        return self.open <= self.cap

    def over_cap(self) -> bool:
        return self.open > self.cap

    def rest(self, conn: LimitedH11Protocol) -> None:
        """``conn`` waits for a request (the newest idle)."""
        if conn in self.counted:
            self.idle[conn] = None
            self.idle.move_to_end(conn)

    def wake(self, conn: LimitedH11Protocol) -> None:
        """``conn`` has begun a request: not to be shed."""
        self.idle.pop(conn, None)

    def leave(self, conn: LimitedH11Protocol) -> None:
        self.idle.pop(conn, None)
        if conn in self.counted:
            self.counted.discard(conn)
            self.open -= 1


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
    that sheds idle connections, and JSON error replies (see the module docstring).
    :meth:`TransportLimits.uvicorn_options` makes a subclass with the class attributes set."""

    timeout_read: float = 30.0
    limit: int = 256
    max_header_bytes: int = 65536
    pool: ConnectionPool = ConnectionPool(528, 1056)  # (each server's subclass has its own)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(self.config.h11_max_incomplete_event_size or self.max_header_bytes)
        self._read_timer = None
        self.over_cap = False  # accepted past the cap with nothing idle to shed: its request gets 503
        self.app = self._limited(self.app)

    def _limited(self, app):  # noqa: ANN001, ANN202 - ASGI apps
        """``app`` behind the limits: over ``limit`` running requests (this one counted), or on a connection
        accepted past the connection cap while the server still is, a JSON 503."""

        async def limited(scope, receive, send) -> None:  # noqa: ANN001
            if self.over_cap and self.pool.over_cap():
                message = (f"the server is at its limit of {self.pool.cap} open connections (--limit-connections), "
                           "none of them idle; retry later")
            elif len(self.tasks) > self.limit:
                message = (f"the server is at its limit of {self.limit} running requests (--limit-concurrency); "
                           "retry later")
            else:
                self.over_cap = False
                await app(scope, receive, send)
                return
            body = _error_body(message, "overloaded", "server_error")
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})

        return limited

    def connection_made(self, transport) -> None:  # noqa: ANN001 - asyncio's signature
        super().connection_made(transport)
        admitted = self.pool.admit(self)  # past the cap: idle connections are shed to make room
        if admitted is None:
            self.transport.close()  # past the ceiling: closed on arrival, before it holds anything else
            return
        self.over_cap = not admitted
        # uvicorn starts its keep-alive timer only after a response: a connection that never sends stays idle here
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
        self.pool.rest(self)

    def shed(self) -> None:
        """Close this idle connection to make room for a new one (as its idle timeout would)."""
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_handler()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.our_state is h11.IDLE and \
                self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
            self.pool.rest(self)  # kept alive, waiting for the next request: idle again

    def data_received(self, data: bytes) -> None:
        self.pool.wake(self)
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
        self.pool.leave(self)
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
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:  # nothing of a reply sent yet
            if cycle is not None and not cycle.response_complete:  # a handler reading the body: from now on it
                cycle.disconnected = True  # sees the client as gone (receive: http.disconnect) and its sends are
                cycle.message_event.set()  # no-ops, so they cannot write after the 408
            self._send_error(408, f"the request did not arrive within {self.timeout_read:g} seconds",
                             "request_timeout")
        self.transport.close()  # (a reply under way: cut; the handler sees the client as gone)

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

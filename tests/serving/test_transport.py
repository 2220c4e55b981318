"""The server's transport against clients that misbehave (issue 23): silent and trickling sockets, too many
connections (idle ones shed to make room, a fast 503 when none is idle), a huge header, a non-streaming client
that leaves, bodies the JSON parser chokes on, a client leaving mid-body, HTTP/1.0 streaming, and an unexpected
exception in a handler. A real server process, except the last and the pure ones."""

import json
import re
import select
import socket
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn) is not installed")
httpx = pytest.importorskip("httpx", reason="the serve-test extra (httpx) is not installed")

from tests.serving.live import DE_EN, SHAKES, LiveServer, closed_by_server, connect, read_all, request_bytes  # noqa: E402

KEEP_ALIVE, READ = 1.0, 2.0


@pytest.fixture(scope="module")
def limited():
    s = LiveServer(SHAKES, "--timeout-keep-alive", str(KEEP_ALIVE), "--timeout-read", str(READ),
                   "--limit-concurrency", "350", "--max-header-bytes", "8192", "--max-tokens", "300",
                   "--max-batch", "2")
    yield s
    s.stop()


def assert_serving(server, offline):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 5, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline("ROMEO:", 5)
    log = server.log()
    assert "Traceback" not in log and " failed: " not in log, log[-2000:]  # no traceback, no catch-all 500


def health(server) -> httpx.Response:
    return httpx.get(server.url + "/health", timeout=10)


def test_silent_connections_are_closed_after_the_idle_timeout_while_health_answers(limited):
    sockets = [connect(limited) for _ in range(300)]  # they held their descriptors forever (19,990 filled them)
    try:
        time.sleep(0.2)
        r = health(limited)
        assert r.status_code == 200 and r.json()["status"] == "ok"  # 301 connections: under the limit
        start = time.monotonic()
        assert all(closed_by_server(s, max(0.05, start + KEEP_ALIVE + 3 - time.monotonic())) for s in sockets)
        assert time.monotonic() - start < KEEP_ALIVE + 3
    finally:
        for s in sockets:
            s.close()


def test_a_request_trickled_in_gets_408_at_the_read_timeout(limited):
    s = connect(limited)
    start = time.monotonic()
    s.sendall(f"GET /health HTTP/1.1\r\nHost: {limited.host}\r\n".encode())
    try:  # a header byte every 0.3 s: each resets an idle timer, not the read timeout
        while time.monotonic() - start < READ + 3:
            s.sendall(b"X")
            time.sleep(0.3)
    except OSError:
        pass
    reply = read_all(s, 5)
    assert time.monotonic() - start < READ + 3
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    s.close()


def test_a_body_trickled_in_gets_408_at_the_read_timeout_while_the_handler_reads_it(limited, offline):
    s = connect(limited)
    start = time.monotonic()
    s.sendall(request_bytes(limited, b'{"prompt": ', length=100))  # the handler starts reading the body
    try:  # a byte a second: each resets no timer; the handler waits for the rest (it got no reply at all)
        while time.monotonic() - start < READ + 3 and not select.select([s], [], [], 1.0)[0]:
            s.sendall(b" ")
    except OSError:
        pass
    reply = read_all(s, 5)
    assert time.monotonic() - start < READ + 2
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    head, payload = reply.split(b"\r\n\r\n", 1)
    assert b"connection: close" in head.lower()
    assert json.loads(payload)["error"]["code"] == "request_timeout"  # one reply: the handler's later 499 is a no-op
    s.close()
    time.sleep(0.3)
    assert health(limited).json()["active"] == 0
    assert_serving(limited, offline)  # no traceback (a send after the 408 would raise in the handler)


CONCURRENCY = 4
CAP = 2 * CONCURRENCY + 16  # --limit-connections' default


@pytest.fixture(scope="module")
def crowded():
    s = LiveServer(SHAKES, "--limit-concurrency", str(CONCURRENCY), "--timeout-keep-alive", "30", "--timeout-read",
                   "30", "--max-tokens", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def descriptors():
    """Room in this process's file-descriptor limit for the sockets a test holds (the soft limit raised to the
    hard one when it is lower; skipped when even that is too low)."""
    resource = pytest.importorskip("resource")
    needed = 700
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"ulimit -n allows {hard} file descriptors; the test holds {needed}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        yield
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    else:
        yield


def settle(server) -> None:
    """Wait until the server answers /health with 200 again (the sockets of the test before have gone)."""
    deadline = time.monotonic() + 5
    while health(server).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert health(server).status_code == 200


def partial(server) -> socket.socket:
    """A connection that has begun a request (half its headers): busy, never shed."""
    s = connect(server)
    s.sendall(f"GET /health HTTP/1.1\r\nHost: {server.host}\r\n".encode())
    return s


def test_600_idle_connections_are_shed_so_a_new_client_is_served(crowded, offline, descriptors):
    sockets = [connect(crowded) for _ in range(600)]  # 600 past a cap of 24: every new client was reset
    try:
        time.sleep(0.3)
        start = time.monotonic()
        r = httpx.post(crowded.url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 5,
                                                               "temperature": 0}, timeout=2)
        assert time.monotonic() - start < 2
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline("ROMEO:", 5)
        open_ = [not closed_by_server(s, 0.01) for s in sockets]
        assert sum(open_) <= CAP  # the rest were shed, ...
        assert not any(open_[:600 - CAP]) and all(open_[-(CAP - 1):])  # ... the longest idle first
    finally:
        for s in sockets:
            s.close()
    settle(crowded)
    assert "Traceback" not in crowded.log()


def test_past_the_cap_with_none_idle_a_new_client_gets_a_fast_503_and_past_twice_it_a_close(crowded):
    busy = [partial(crowded) for _ in range(CAP)]
    try:
        time.sleep(0.2)
        start = time.monotonic()
        r = health(crowded)  # nothing to shed: the newcomer's request is read and answered 503
        assert time.monotonic() - start < 2
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
        assert "--limit-connections" in r.json()["error"]["message"]
        busy += [partial(crowded) for _ in range(CAP)]  # kept past the cap (up to twice it), busy too
        time.sleep(0.2)
        late = connect(crowded)
        assert closed_by_server(late, 1)  # past twice the cap: closed on arrival
        late.close()
        assert not any(closed_by_server(s, 0.01) for s in busy)  # a request begun is never shed
    finally:
        for s in busy:
            s.close()
    settle(crowded)


def test_past_the_concurrency_limit_running_requests_get_503(crowded):
    readers = []
    try:
        for _ in range(CONCURRENCY):  # each handler waits for the rest of its body: a running request
            s = connect(crowded)
            s.sendall(request_bytes(crowded, b'{"prompt": ', length=100))
            readers.append(s)
        time.sleep(0.3)
        r = health(crowded)
        assert r.status_code == 503 and "--limit-concurrency" in r.json()["error"]["message"], r.text
    finally:
        for s in readers:
            s.close()
    settle(crowded)


def test_headers_over_the_limit_get_431_and_a_100_mb_header_is_cut_off(limited):
    s = connect(limited)
    s.sendall(f"GET /health HTTP/1.1\r\nHost: {limited.host}\r\nX-Big: {'a' * 20000}\r\n\r\n".encode())
    reply = read_all(s, 5)
    s.close()
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "headers_too_large"

    s = connect(limited)
    start, sent = time.monotonic(), 0
    try:  # it was buffered whole (and answered 200)
        s.sendall(f"GET /health HTTP/1.1\r\nHost: {limited.host}\r\nX-Big: ".encode())
        while sent < 100 << 20:
            s.sendall(b"a" * (1 << 20))
            sent += 1 << 20
    except OSError:
        pass
    s.close()
    assert sent < 32 << 20 and time.monotonic() - start < 5  # refused after 8 KiB (plus the socket buffers)


def test_a_non_streaming_client_that_leaves_frees_its_row(limited, offline):
    body = json.dumps({"prompt": "ROMEO:", "max_tokens": 250, "temperature": 0}).encode()
    clients = [connect(limited) for _ in range(10)]
    for c in clients:  # two rows (--max-batch 2), eight queued: about five times one request's time, if kept
        c.sendall(request_bytes(limited, body))
    deadline = time.monotonic() + 10
    while health(limited).json()["active"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    state = health(limited).json()
    assert state["active"] == 2 and state["queued"] >= 6, state
    for c in clients:
        c.close()
    left = time.monotonic()
    while (state := health(limited).json())["active"] + state["queued"] and time.monotonic() - left < 5:
        time.sleep(0.05)
    assert state["active"] == state["queued"] == 0 and time.monotonic() - left < 1.5, state  # freed at once
    assert_serving(limited, offline)


def test_http10_streaming_is_close_delimited_not_chunked(limited, offline):
    body = json.dumps({"prompt": "ROMEO:", "max_tokens": 20, "temperature": 0, "stream": True}).encode()
    s = connect(limited)
    s.sendall(request_bytes(limited, body, version="1.0"))
    reply = read_all(s, 30)
    s.close()
    head, payload = reply.split(b"\r\n\r\n", 1)
    headers = head.decode().lower()
    assert headers.startswith("http/1.1 200") and "transfer-encoding" not in headers, headers
    assert "connection: close" in headers
    events = [line[6:] for line in payload.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and payload.endswith(b"data: [DONE]\n\n")
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == offline("ROMEO:", 20)


@pytest.mark.parametrize("raw, code", [
    (b"[" * 100000, "invalid_json"),  # RecursionError in json.loads: a plain-text 500
    (b'{"prompt": ' * 50000 + b'"A"' + b"}" * 50000, "invalid_json"),
    (b'{"prompt": "A", "max_tokens": 1' + b"0" * 5000 + b"}", "invalid_json"),  # past the 4300-digit limit
    (b'{"prompt": "A", "seed": ' + b"9" * 5000 + b"}", "invalid_json"),
    (b'{"prompt": "A", "temperature": NaN}', "invalid_json"),
    (b'{"prompt": "A\\ud800"}', "invalid_json"),  # a lone surrogate
    (b'{"prompt": "A", "model": "\\udfff"}', "invalid_json"),  # ... quoted in the 404 message: a 500
    (b'{"prompt": "A\xed\xa0\x80"}', "invalid_json"),  # the same, as (surrogatepass) UTF-8 bytes
    (b'{"prompt": "A\xff"}', "invalid_json"),  # not UTF-8
    (b'{"prompt": "A", "stream_options": 5}', "invalid_type"),
    (b'{"prompt": "A", "stream": true, "stream_options": {"include_usage": "yes"}}', "invalid_type"),
    (b'{"prompt": "A", "max_tokens": 3, "max_completion_tokens": 0}', "invalid_value"),
    (b'{"messages": [{"content": "A"}]}', "invalid_type"),  # chat: no role
])
def test_bodies_the_parser_chokes_on_get_a_json_400(limited, offline, raw, code):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = httpx.post(limited.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"] and "\n" not in error["message"]
    assert_serving(limited, offline)


def test_a_client_leaving_mid_body_logs_no_traceback(limited, offline):
    for _ in range(3):
        s = connect(limited)
        s.sendall(request_bytes(limited, b'{"prompt": "RO', length=1000))  # 1000 bytes promised, 14 sent
        time.sleep(0.2)
        s.close()
    time.sleep(0.5)
    log = limited.log()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-2000:]
    assert_serving(limited, offline)


def test_the_default_max_tokens_fits_a_smaller_server_limit():
    s = LiveServer(SHAKES, "--max-tokens", "8")
    try:  # completions default to 16 tokens: over --max-tokens 8 every request without max_tokens was a 400
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "ROMEO:", "temperature": 0}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        s.stop()


@pytest.fixture(scope="module")
def translator():
    s = LiveServer(DE_EN)
    yield s
    s.stop()


@pytest.mark.parametrize("raw", [b'{"input": "Ein Hund\\ud800"}', b'{"input": ["Hund", "\\udc00"]}'])
def test_a_lone_surrogate_in_a_translation_is_a_400(translator, raw):
    r = httpx.post(translator.url + "/v1/translations", content=raw, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text  # a TypeError: a 500
    r = httpx.post(translator.url + "/v1/translations", json={"input": "Ein Hund rennt."}, timeout=60)
    assert r.status_code == 200 and r.json()["data"][0]["translation"] == "A dog runs."
    assert "Traceback" not in translator.log()


def test_an_unexpected_exception_is_a_one_line_json_500(monkeypatch, capsys):
    from fastapi.testclient import TestClient

    import tokenloom.serving.app as app_module
    import tokenloom.serving.routes.completions as completions_routes
    from tokenloom.checkpoint import load_model, load_tokenizer

    def broken(*_args):
        raise KeyError("a bug\nwith a second line")

    monkeypatch.setattr(completions_routes, "check_model", broken)  # where the route looks it up
    app = app_module.create_app(load_model(SHAKES)[0], load_tokenizer(SHAKES),
                                app_module.ServeConfig(model_name="shakes"))
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
        capsys.readouterr()
        r = client.post("/v1/completions", json={"prompt": "ROMEO:"})
        assert r.status_code == 500
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "internal_error")
        assert "\n" not in error["message"] and "Traceback" not in r.text and "second line" not in r.text
        logged = capsys.readouterr().err.strip().splitlines()
        assert len(logged) == 1 and "KeyError" in logged[0], logged
        assert client.get("/health").json()["status"] == "ok"  # the server goes on


class FakeConnection:
    def __init__(self, name: int) -> None:
        self.name, self.closed = name, False

    def shed(self) -> None:
        self.closed = True


def test_the_pool_sheds_the_longest_idle_first_and_never_a_busy_one():
    from tokenloom.serving.transport import ConnectionPool

    pool = ConnectionPool(cap=3, ceiling=5)
    a, b, c, d, e, f, g, h = (FakeConnection(i) for i in range(8))
    for conn in (a, b, c):
        assert pool.admit(conn) is True
        pool.rest(conn)
    pool.wake(a)  # a begins a request; then b goes busy and idle again (kept alive): c is now the longest idle
    pool.wake(b)
    pool.rest(b)
    assert pool.admit(d) is True and c.closed and not a.closed and not b.closed  # c shed for d
    pool.rest(d)
    assert pool.admit(e) is True and b.closed  # then b (idle since after c), then d
    pool.wake(d)
    pool.wake(e)
    assert pool.admit(f) is False and pool.open == 4  # nothing idle: kept past the cap (its request gets 503)
    pool.rest(f)
    assert pool.admit(g) is False and f.closed and pool.open == 4  # a newcomer sheds an idle one past the cap too
    pool.wake(g)
    assert pool.admit(h) is False and pool.open == 5
    assert pool.admit(FakeConnection(9)) is None and pool.open == 5  # past the ceiling: closed on arrival
    for conn in (a, d, e, g, h):
        pool.leave(conn)
    assert pool.open == 0 and not pool.idle and pool.shed == 3


def test_the_connection_cap_is_sized_under_the_file_descriptor_limit():
    from tokenloom.errors import ConfigError
    from tokenloom.serving.transport import FD_RESERVE, TransportLimits

    assert TransportLimits().max_connections == 2 * 256 + 16
    assert TransportLimits(limit_concurrency=8).max_connections == 32
    small = TransportLimits(fd_limit=FD_RESERVE + 100)  # ulimit -n leaves 100 connections: the default fits
    assert small.max_connections == 100 and small.connection_ceiling == 100
    assert TransportLimits(limit_connections=50, fd_limit=FD_RESERVE + 1000).connection_ceiling == 100
    with pytest.raises(ConfigError, match="ulimit -n"):
        TransportLimits(limit_connections=2000, fd_limit=1024)
    with pytest.raises(ConfigError, match="ulimit -n"):
        TransportLimits(fd_limit=FD_RESERVE)


def test_serve_raises_the_soft_file_descriptor_limit_to_the_hard_one():
    import subprocess
    import sys

    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 256 if hard == resource.RLIM_INFINITY else min(256, hard)
    code = ("import resource; from tokenloom.serving.transport import raise_fd_limit; "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({low}, resource.getrlimit(resource.RLIMIT_NOFILE)[1])); "
            "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    raised, now = out.stdout.split()
    expected = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    assert int(raised) == int(now) == expected


@pytest.mark.parametrize("flag, value", [("--timeout-keep-alive", "0"), ("--timeout-keep-alive", "nan"),
                                         ("--timeout-read", "-1"), ("--limit-concurrency", "0"),
                                         ("--limit-connections", "0"), ("--limit-connections", "5000000"),
                                         ("--backlog", "0"), ("--max-header-bytes", "100")])
def test_bad_transport_flags_are_one_line_errors(capsys, flag, value):
    from tokenloom.cli.main import main

    assert main(["serve", str(SHAKES), flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag}"), err


def test_the_openapi_schema_is_public_and_describes_the_served_routes():
    from fastapi.testclient import TestClient

    from tokenloom.checkpoint import load_model, load_tokenizer
    from tokenloom.serving.app import ServeConfig, create_app

    tokenizer = load_tokenizer(SHAKES)
    app = create_app(load_model(SHAKES)[0], tokenizer, ServeConfig(model_name="shakes", api_key="k", max_tokens=8))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert client.get("/v1/models").status_code == 401
        r = client.get("/openapi.json")  # documentation: no key needed
        assert r.status_code == 200
        paths = r.json()["paths"]
        assert set(paths) == {"/", "/health", "/v1/models", "/metrics", "/v1/completions", "/v1/chat/completions",
                              "/tokenize", "/detokenize", "/tokenizer_info"}
        body = paths["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["required"] == ["prompt"] and body["properties"]["max_tokens"]["maximum"] == 8
        prompt = body["properties"]["prompt"]["anyOf"][0]
        assert prompt["maxLength"] == 255  # the context (256) less one new token
        pattern = re.compile(prompt["pattern"])
        assert pattern.match("ROMEO:\nO, be some other name!") and not pattern.match("ROMEO: \u00e9")
        assert client.get("/docs").status_code == 404 and client.get("/redoc").status_code == 404

"""The server's transport against clients that misbehave (issue 23): silent and trickling sockets, too many
connections, a huge header, a non-streaming client that leaves, bodies the JSON parser chokes on, a client
leaving mid-body, HTTP/1.0 streaming, and an unexpected exception in a handler. A real server process, except
the last."""

import json
import re
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


def test_a_body_trickled_in_is_cut_at_the_read_timeout_without_a_traceback(limited, offline):
    s = connect(limited)
    start = time.monotonic()
    s.sendall(request_bytes(limited, b'{"prompt": ', length=100))
    try:
        while time.monotonic() - start < READ + 3:
            s.sendall(b" ")
            time.sleep(0.3)
    except OSError:
        pass
    assert not read_all(s, 5).endswith(b"<timeout>")
    assert time.monotonic() - start < READ + 3
    s.close()
    assert_serving(limited, offline)


@pytest.fixture(scope="module")
def crowded():
    s = LiveServer(SHAKES, "--limit-concurrency", "100", "--timeout-keep-alive", "30", "--max-tokens", "8")
    yield s
    s.stop()


def test_past_the_concurrency_limit_requests_get_503_and_past_twice_it_connections_close(crowded):
    sockets = [connect(crowded) for _ in range(110)]
    try:
        time.sleep(0.2)
        r = health(crowded)  # over --limit-concurrency 100
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        more = [connect(crowded) for _ in range(150)]  # 2 * 100 + 16 open is the cap
        sockets += more
        assert not closed_by_server(sockets[0], 0.2)  # the first ones wait for their idle timeout (30 s)
        assert all(closed_by_server(s, 0.5) for s in more[-20:])  # the ones past the cap are closed on arrival
    finally:
        for s in sockets:
            s.close()
    deadline = time.monotonic() + 5
    while health(crowded).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert health(crowded).status_code == 200


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


@pytest.mark.parametrize("flag, value", [("--timeout-keep-alive", "0"), ("--timeout-keep-alive", "nan"),
                                         ("--timeout-read", "-1"), ("--limit-concurrency", "0"),
                                         ("--max-header-bytes", "100")])
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

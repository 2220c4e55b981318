"""What a web page can do to a tokenloom server on this machine (issue 23, defect 7): a POST without a JSON content
type (the kind a page may send cross-origin without asking) is refused with 415; a Host header the server was not
started for (a DNS-rebinding page) is refused on every route; CORS stays off unless --cors-origin names the
origins; and an API key outside ASCII is compared as the UTF-8 bytes a client sends."""

import json
import socket

import pytest

from tests.serving.test_server import SHAKES, Server, httpx, openai

UNI_KEY = "clé-ключ"  # non-ASCII: a UTF-8 client sends these bytes
APP_ORIGIN = "http://app.example:3000"
BODY = {"prompt": "ROMEO:", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def open_server():
    """No API key, the default hosts, no CORS: the server a page on any site could try to reach."""
    s = Server(SHAKES, "--max-tokens", "50")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def guarded():
    s = Server(SHAKES, "--max-tokens", "50", "--api-key", UNI_KEY, "--cors-origin", APP_ORIGIN,
               "--allowed-hosts", "api.example,.internal.example", "--allowed-hosts", "other.example")
    yield s
    s.stop()


def send(server, method, path, headers=None, body=BODY, content_type="application/json", key=None):
    h = {}
    if content_type is not None:
        h["Content-Type"] = content_type
    if key is not None:
        h["Authorization"] = b"Bearer " + key.encode("utf-8")
    h.update(headers or {})
    content = json.dumps(body).encode() if method == "POST" else None
    return httpx.request(method, server.url + path, content=content, headers=h, timeout=60)


def assert_openai_error(r, status, code):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert error["message"] and "\n" not in error["message"]


# --- content type -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content_type", [
    "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",  # what a page sends unasked
    "multipart/form-data; boundary=x", None, "", "application/jsonp", "application/json; charset=iso-8859-1",
    "text/plain; application/json",
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_post_without_a_json_content_type_is_refused_with_415(open_server, path, content_type):
    body = BODY if path == "/v1/completions" else {"messages": [{"role": "user", "content": "ROMEO:"}],
                                                   "max_tokens": 3}
    r = send(open_server, "POST", path, body=body, content_type=content_type)
    assert_openai_error(r, 415, "unsupported_media_type")
    assert "application/json" in r.json()["error"]["message"]


def test_the_content_type_is_checked_on_post_routes_only(open_server):
    for path, status in (("/", 405), ("/health", 405), ("/v1/nothing", 404)):  # no POST route: 405/404, not 415
        assert send(open_server, "POST", path, content_type="text/plain").status_code == status, path
    assert send(open_server, "GET", "/v1/models", content_type="text/plain").status_code == 200


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=UTF-8",
                                          "application/json;charset=utf-8", "application/merge-patch+json"])
def test_json_content_types_are_served(open_server, content_type):
    r = send(open_server, "POST", "/v1/completions", content_type=content_type)
    assert r.status_code == 200, r.text


def test_the_openai_client_and_httpx_json_still_work(open_server):
    c = openai.OpenAI(base_url=open_server.url + "/v1", api_key="unused", max_retries=0)
    assert len(c.completions.create(model="shakespeare-char", prompt="ROMEO:", max_tokens=3).choices[0].text) == 3
    assert httpx.post(open_server.url + "/v1/completions", json=BODY, timeout=60).status_code == 200


# --- Host header ------------------------------------------------------------------------------------------------

FOREIGN_HOSTS = ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil.example",
                 "[::2]:8000", "10.1.2.3", "bad host"]
ROUTES = [("GET", "/"), ("GET", "/health"), ("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
          ("GET", "/v1/nothing"), ("OPTIONS", "/v1/completions")]


@pytest.mark.parametrize("host", FOREIGN_HOSTS)
def test_a_host_header_the_server_was_not_started_for_is_refused_on_every_route(open_server, host):
    for method, path in ROUTES:
        r = send(open_server, method, path, headers={"Host": host})
        assert_openai_error(r, 400, "host_not_allowed")
        assert "--allowed-hosts" in r.json()["error"]["message"]


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "[::1]:{port}", "LOCALHOST", "localhost.",
                                  "127.0.0.2", "[0:0:0:0:0:0:0:1]", "app.localhost:{port}"])
def test_local_host_headers_are_served(open_server, host):
    host = host.format(port=open_server.port)
    assert send(open_server, "GET", "/health", headers={"Host": host}).status_code == 200
    assert send(open_server, "POST", "/v1/completions", headers={"Host": host}).status_code == 200


def test_a_request_without_a_host_header_is_served(open_server):
    """HTTP/1.0 allows leaving Host out; browsers always send one, so there is nothing to check."""
    with socket.create_connection(("127.0.0.1", open_server.port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


def test_allowed_hosts_adds_names_and_domains(guarded):
    for host in ["api.example", "API.example:443", "other.example", "internal.example", "a.b.internal.example",
                 f"localhost:{guarded.port}", f"127.0.0.1:{guarded.port}"]:
        assert send(guarded, "GET", "/health", headers={"Host": host}).status_code == 200, host
    for host in ["evil.example", "api.example.evil.example", "xinternal.example"]:
        assert_openai_error(send(guarded, "GET", "/health", headers={"Host": host}), 400, "host_not_allowed")


# --- CORS -------------------------------------------------------------------------------------------------------

def preflight(server, origin, path="/v1/completions"):
    return httpx.options(server.url + path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                     "Access-Control-Request-Headers": "authorization,content-type"},
                         timeout=30)


def cors_headers(r) -> dict:
    return {k: v for k, v in r.headers.items() if k.lower().startswith("access-control-")}


def test_no_cors_without_the_flag(open_server):
    r = preflight(open_server, "http://evil.example")
    assert r.status_code >= 400 and cors_headers(r) == {}
    r = send(open_server, "POST", "/v1/completions", headers={"Origin": "http://evil.example"})
    assert r.status_code == 200 and cors_headers(r) == {}  # answered (a same-machine client), but not shared
    assert cors_headers(send(open_server, "GET", "/v1/models", headers={"Origin": "http://evil.example"})) == {}


def test_cors_origin_approves_that_origin_only(guarded):
    r = preflight(guarded, APP_ORIGIN)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == APP_ORIGIN
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type"} <= allowed
    assert "POST" in r.headers["access-control-allow-methods"]
    r = send(guarded, "POST", "/v1/completions", headers={"Origin": APP_ORIGIN}, key=UNI_KEY)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
    r = send(guarded, "POST", "/v1/completions", headers={"Origin": APP_ORIGIN}, key="wrong")
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == APP_ORIGIN  # the page reads why
    for origin in ["http://evil.example", "http://app.example", "https://app.example:3000"]:
        assert "access-control-allow-origin" not in cors_headers(preflight(guarded, origin)), origin
        r = send(guarded, "POST", "/v1/completions", headers={"Origin": origin}, key=UNI_KEY)
        assert r.status_code == 200 and cors_headers(r) == {}


# --- API key ----------------------------------------------------------------------------------------------------

def test_a_non_ascii_api_key_sent_as_utf8_is_accepted(guarded):
    r = send(guarded, "POST", "/v1/completions", key=UNI_KEY)
    assert r.status_code == 200, r.text
    assert send(guarded, "GET", "/metrics", key=UNI_KEY).status_code == 200
    for key, message in ((None, "missing API key"), ("clé-ключ2", "incorrect API key"), ("cle-kluch", "incorrect")):
        r = send(guarded, "POST", "/v1/completions", key=key)
        assert_openai_error(r, 401, "invalid_api_key")
        assert message in r.json()["error"]["message"]
    twice = UNI_KEY.encode("utf-8").decode("latin-1").encode("utf-8")  # what the old comparison accepted instead
    assert httpx.get(guarded.url + "/v1/models", headers={"Authorization": b"Bearer " + twice}).status_code == 401


def test_the_playground_sends_a_non_ascii_key_as_utf8(guarded):
    from urllib.parse import quote

    from tests.browser import run_page

    url = f"{guarded.url}/?autorun=1&prompt=ROMEO:&max_tokens=5&temperature=0#api_key={quote(UNI_KEY)}"
    (state, output), console = run_page(url, ["document.body.dataset.state", "$('output').textContent"])
    assert state == "done", (output, console)
    assert output.startswith("ROMEO:") and len(output) == len("ROMEO:") + 5


# --- the flags, in process --------------------------------------------------------------------------------------

def run_serve(monkeypatch, capsys, *flags):
    """``tokenloom serve`` with uvicorn.run replaced: (exit code, stderr, the app it would have served)."""
    import uvicorn

    from tokenloom.cli.main import main

    served = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: served.append(app))
    code = main(["serve", str(SHAKES), *flags])
    return code, capsys.readouterr().err, served[0] if served else None


def test_binding_all_interfaces_warns_and_serves_ip_addresses(monkeypatch, capsys):
    from fastapi.testclient import TestClient

    code, err, app = run_serve(monkeypatch, capsys, "--host", "0.0.0.0", "--allowed-hosts", "box.lan")
    assert code == 0 and "warning:" in err and "--allowed-hosts" in err
    with TestClient(app, base_url="http://192.168.1.20:8000") as client:  # any address of this machine
        assert client.get("/health").status_code == 200
        assert client.get("/health", headers={"Host": "[fe80::1]:8000"}).status_code == 200
        assert client.get("/health", headers={"Host": "box.lan:8000"}).status_code == 200
        assert client.get("/health", headers={"Host": "rebind.evil.example"}).status_code == 400
    code, err, app = run_serve(monkeypatch, capsys, "--host", "127.0.0.1")
    assert code == 0 and "warning" not in err
    with TestClient(app, base_url="http://192.168.1.20:8000") as client:  # bound to loopback: not an address of it
        assert client.get("/health").status_code == 400


def test_a_non_ascii_key_gets_a_startup_note(monkeypatch, capsys):
    code, err, _ = run_serve(monkeypatch, capsys, "--api-key", UNI_KEY)
    assert code == 0 and "UTF-8" in err


@pytest.mark.parametrize("flags, message", [
    (["--allowed-hosts", "http://evil.example/"], "--allowed-hosts"),
    (["--allowed-hosts", "bad host"], "--allowed-hosts"),
    (["--cors-origin", "app.example"], "--cors-origin"),
    (["--cors-origin", "http://app.example/path"], "--cors-origin"),
    (["--api-key", " key"], "--api-key"),
    (["--api-key", "key\x01"], "--api-key"),
])
def test_bad_browser_safety_flags_are_one_line_errors(monkeypatch, capsys, flags, message):
    code, err, app = run_serve(monkeypatch, capsys, *flags)
    assert code == 2 and app is None
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err

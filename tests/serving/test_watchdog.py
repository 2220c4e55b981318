"""The server's watchdog, in process: an engine thread that has stopped makes /health answer 503, and requests end
with a 504 at their deadline from the event loop instead of hanging (the engine alone checked deadlines)."""

import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn) is not installed")
pytest.importorskip("httpx", reason="the serve-test extra (httpx) is not installed")

from fastapi.testclient import TestClient  # noqa: E402

from tokenloom.checkpoint import load_model, load_tokenizer  # noqa: E402
from tokenloom.serving import Engine  # noqa: E402
from tokenloom.serving.app import ServeConfig, create_app  # noqa: E402

SHAKES = Path(__file__).resolve().parents[2] / "checkpoints" / "shakespeare-char"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stopped_engine_is_reported_and_requests_time_out(monkeypatch, stream):
    monkeypatch.setattr(Engine, "_run", lambda self: None)  # the engine thread ends at once, as a crashed one did
    model, tokenizer = load_model(SHAKES)[0], load_tokenizer(SHAKES)
    app = create_app(model, tokenizer, ServeConfig(model_name="shakes", request_timeout=1.0))
    with TestClient(app, base_url="http://127.0.0.1") as client:  # a Host the server answers (not "testserver")
        time.sleep(0.2)
        health = client.get("/health")
        assert health.status_code == 503 and "engine has stopped" in health.json()["error"]
        start = time.monotonic()
        r = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 3, "stream": stream})
        waited = time.monotonic() - start
        assert waited < 10  # the deadline (1 s) plus the event loop's grace (1 s), not forever
        if stream:
            assert r.status_code == 200 and "longer than the server's request timeout" in r.text  # an SSE error
        else:
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"

"""tokenloom serve, as a real server process on 127.0.0.1: the openai client, greedy == offline generate, 32
concurrent requests, bad input answered with the right status and OpenAI-shaped JSON, a client that leaves
mid-stream, /metrics, translations, and the playground in headless Chromium."""

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn) is not installed")
httpx = pytest.importorskip("httpx", reason="the serve-test extra (httpx, openai) is not installed")
openai = pytest.importorskip("openai", reason="the serve-test extra (httpx, openai) is not installed")

from tests.serving.live import LiveServer as Server  # noqa: E402 - after the extras are known to be there

REPO = Path(__file__).resolve().parents[2]
SHAKES = REPO / "checkpoints" / "shakespeare-char"
DE_EN = REPO / "checkpoints" / "multi30k-de-en"
KEY = "test-key-123"
PROMPTS = ["ROMEO:", "JULIET:\nO", "First Citizen:\n", "KING HENRY", "Good morrow", "To be, or not",
           "MERCUTIO:\nNay", "What light"]


@pytest.fixture(scope="module")
def server():
    s = Server(SHAKES, "--api-key", KEY, "--max-tokens", "300", "--max-body-bytes", "65536", "--max-batch", "8")
    yield s
    s.stop()


def post(server, path, body=None, key=KEY, raw=None, headers=None):
    h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    h.update(headers or {})
    return httpx.post(server.url + path, content=raw if raw is not None else json.dumps(body), headers=h,
                      timeout=120)


def client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def assert_still_serving(server, offline):
    r = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline("ROMEO:", 5)


def test_openai_client_completion_and_stream_equal_offline_greedy(server, offline):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["shakespeare-char"]
    done = c.completions.create(model="shakespeare-char", prompt="ROMEO:", max_tokens=40, temperature=0)
    assert done.choices[0].text == offline("ROMEO:", 40)
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (6, 40)
    chunks = list(c.completions.create(model="shakespeare-char", prompt="JULIET:\nO", max_tokens=30, temperature=0,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == offline("JULIET:\nO", 30)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_completion_and_stop_and_seeded_sampling(server, offline):
    c = client(server)
    chat = c.chat.completions.create(model="shakespeare-char", messages=[{"role": "user", "content": "ROMEO:"}],
                                     max_tokens=20, temperature=0)
    assert chat.choices[0].message.content == offline("ROMEO:\n", 20)
    full = offline("ROMEO:", 40)
    stop = full[10:13]
    cut = c.completions.create(model="shakespeare-char", prompt="ROMEO:", max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.find(stop)] and cut.choices[0].finish_reason == "stop"
    a = c.completions.create(model="shakespeare-char", prompt="ROMEO:", max_tokens=30, seed=7, n=2)
    b = c.completions.create(model="shakespeare-char", prompt="ROMEO:", max_tokens=30, seed=7, n=2)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]  # same seed, same samples
    assert a.choices[0].text != a.choices[1].text  # choice j samples with seed + j


def test_32_concurrent_requests_complete_with_the_offline_outputs(server, offline):
    jobs = [(PROMPTS[i % len(PROMPTS)], 12 + i % 5) for i in range(32)]
    expected = [offline(p, n) for p, n in jobs]

    def one(job):
        prompt, n = job
        stream = job[1] % 2 == 0
        r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": stream})
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["choices"][0]["text"]
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, jobs))
    assert got == expected


@pytest.mark.parametrize("body, raw, status, code", [
    (None, b"{not json", 400, "invalid_json"),
    (None, b"[1, 2]", 400, "invalid_json"),
    ({"prompt": "ROMEO:", "max_tokens": "ten"}, None, 400, "invalid_type"),
    ({"prompt": 5}, None, 400, "invalid_type"),
    ({"prompt": "ROMEO:", "max_tokens": -3}, None, 400, "invalid_value"),
    ({"prompt": "ROMEO:", "max_tokens": 10 ** 9}, None, 400, "invalid_value"),
    ({"prompt": "ROMEO:", "temperature": 7}, None, 400, "invalid_value"),
    # these three passed validation and stopped the engine thread: every later request hung (issue 23)
    ({"prompt": "A", "temperature": 1e-300, "max_tokens": 3}, None, 400, "invalid_value"),
    ({"prompt": "A", "seed": 2 ** 64, "max_tokens": 3}, None, 400, "invalid_value"),
    ({"prompt": "ROMEO:", "stream": "yes"}, None, 400, "invalid_type"),
    ({}, None, 400, "missing_field"),
    ({"prompt": "x" * 400}, None, 400, "context_length_exceeded"),
    ({"prompt": "ROMEO: \u00e9\u00e9"}, None, 400, "invalid_value"),  # characters outside a char vocabulary
    ({"prompt": "ROMEO:", "model": "gpt-4"}, None, 404, "model_not_found"),
    (None, b'{"prompt": "' + b"a" * 70000 + b'"}', 413, "body_too_large"),
])
def test_bad_requests_get_the_right_status_and_an_openai_error(server, offline, body, raw, status, code):
    r = post(server, "/v1/completions", body, raw=raw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"] and "\n" not in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert_still_serving(server, offline)


@pytest.mark.parametrize("body", [
    {"prompt": "A", "top_p": 1e-46, "max_tokens": 3, "temperature": 1},  # 0 in float32: it removed the top token
    {"prompt": "A", "seed": 2 ** 64 - 1, "n": 3, "max_tokens": 3},  # seed + j past 2^64 for the later choices
    {"prompt": "A", "temperature": 1.2e-38, "max_tokens": 3},  # the smallest accepted temperature
])
def test_extreme_accepted_settings_complete_and_the_server_goes_on(server, offline, body):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert all(len(c["text"]) == 3 for c in r.json()["choices"])  # 3 characters (a char model)
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
    assert_still_serving(server, offline)


def test_api_key_is_required_and_checked(server, offline):
    for key, message in ((None, "missing API key"), ("wrong", "incorrect API key")):
        r = post(server, "/v1/completions", {"prompt": "ROMEO:"}, key=key)
        assert r.status_code == 401 and message in r.json()["error"]["message"]
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # liveness stays open
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.get(server.url + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert_still_serving(server, offline)


def test_a_client_leaving_mid_stream_frees_its_slot(server, offline):
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "ROMEO:", "max_tokens": 300, "temperature": 0, "stream": True},
                      timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in got)
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").json()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(server.url + "/health").json()["active"] == 0  # dropped well before its 300 tokens
    assert_still_serving(server, offline)


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_metrics_move(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    before = httpx.get(server.url + "/metrics", headers=auth).text
    post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 10, "temperature": 0})
    post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 0})
    after = httpx.get(server.url + "/metrics", headers=auth).text
    assert metric(after, "tokenloom_tokens_generated_total") >= metric(before, "tokenloom_tokens_generated_total") + 10
    assert metric(after, 'tokenloom_requests_total{endpoint="completions"}') > \
        metric(before, 'tokenloom_requests_total{endpoint="completions"}')
    errors = 'tokenloom_errors_total{status="400"}'
    assert metric(after, errors) > metric(before, errors)
    assert metric(after, "tokenloom_request_latency_seconds_count") > \
        metric(before, "tokenloom_request_latency_seconds_count")
    for name in ("tokenloom_queue_depth", "tokenloom_batch_occupancy", "tokenloom_tokens_per_second",
                 "tokenloom_time_to_first_token_seconds_bucket"):
        assert name in after


def test_playground_streams_a_completion_in_the_browser(server, offline):
    from tests.browser import run_page

    url = f"{server.url}/?autorun=1&prompt=ROMEO:&max_tokens=20&temperature=0#api_key={KEY}"
    (state, output, status), console = run_page(url, ["document.body.dataset.state", "$('output').textContent",
                                                      "$('status').textContent"])
    assert state == "done", (output, console)
    assert output == "ROMEO:" + offline("ROMEO:", 20)
    assert "chunks in" in status
    assert console == []
    from tokenloom.serving.playground import PLAYGROUND_HTML

    assert not [m for m in PLAYGROUND_HTML.split('"') if m.startswith(("http:", "https:", "//"))]  # no external
    (state, output), _ = run_page(f"{server.url}/?autorun=1&prompt=ROMEO:&max_tokens=5",
                                  ["document.body.dataset.state", "$('output').textContent"])
    assert state == "error" and "missing API key" in output  # no key: the page shows the API's error


@pytest.fixture(scope="module")
def translator():
    s = Server(DE_EN)
    yield s
    s.stop()


def test_translation_server(translator):
    r = httpx.post(translator.url + "/v1/translations", json={"input": ["Ein Hund rennt.", "Zwei Hunde spielen."]},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert [d["translation"] for d in r.json()["data"]][0] == "A dog runs."
    r = httpx.post(translator.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_model"
    r = httpx.post(translator.url + "/v1/translations", json={"input": [], "beam": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = httpx.post(translator.url + "/v1/translations", json={"input": "Hund", "beam": 99})
    assert r.status_code == 400 and r.json()["error"]["param"] == "beam"


@pytest.fixture(scope="module")
def tight():
    """One batch row, one queue place, half a second per request."""
    s = Server(SHAKES, "--max-batch", "1", "--max-queue", "1", "--request-timeout", "0.5")
    yield s
    s.stop()


def test_a_full_queue_answers_429_and_a_slow_request_504(tight, offline):
    def one(_):
        r = httpx.post(tight.url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 250,
                                                             "temperature": 0}, timeout=60)
        return r.status_code, r.json()["error"]["code"] if r.status_code != 200 else None

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    assert (429, "queue_full") in results  # one running, one waiting, the rest turned away
    assert (504, "timeout") in results  # 250 tokens do not fit in half a second here
    r = httpx.post(tight.url + "/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 5, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline("ROMEO:", 5)

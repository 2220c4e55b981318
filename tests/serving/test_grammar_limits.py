"""A response_format grammar that explodes costs the server nothing once refused: it compiles in a worker process
that is killed at the server's limit (grammar_seconds, grammar_memory_mb), so the 400 comes within the limit, the
worker's pid is gone, no thread of this process is left compiling and its RSS stays put; a cached grammar never goes
to a worker, and a request without response_format never starts one."""

import os
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn) is not installed")
pytest.importorskip("httpx", reason="the serve-test extra (httpx) is not installed")
pytest.importorskip("outlines_core")

from tests.grammar.test_worker import gone  # noqa: E402 - after the skips

SHAKES = Path(__file__).resolve().parents[2] / "checkpoints" / "shakespeare-char"
EXPLODING = ["(a|b|c)*a(a|b){22}", "(a|b)*a(a|b){21}", "a{0,100000}"]


@pytest.fixture(scope="module")
def shakes():
    from tokenloom.checkpoint import load_model, load_tokenizer

    return load_model(SHAKES)[0].eval(), load_tokenizer(SHAKES)


def _client(shakes, **settings):
    from fastapi.testclient import TestClient

    from tokenloom.serving.app import ServeConfig, create_app

    model, tokenizer = shakes
    app = create_app(model, tokenizer, ServeConfig(model_name="shakes", max_tokens=32, request_timeout=60,
                                                   **settings))
    return TestClient(app, base_url="http://127.0.0.1")


def complete(client, regex=None, prompt="ROMEO:", max_tokens=8):
    body = {"prompt": prompt, "max_tokens": max_tokens}
    if regex is not None:
        body["response_format"] = {"type": "regex", "regex": regex}
    reply = client.post("/v1/completions", json=body)
    return reply.status_code, reply.json()


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def compiling_threads() -> list[str]:
    """Threads of this process with a grammar compile on their stack."""
    return [thread.name for thread in threading.enumerate()
            if any(f"tokenloom{os.sep}grammar" in frame.f_code.co_filename or frame.f_code.co_name == "compile_grammar"
                   for frame in _stack(sys._current_frames().get(thread.ident)))]


def _stack(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_an_exploding_grammar_is_refused_within_the_limit_and_leaves_nothing_behind(shakes):
    with _client(shakes, grammar_seconds=1.0) as c:
        grammars = c.app.state.server.grammars
        assert complete(c)[0] == 200 and grammars.pids == []  # free text never starts a worker
        assert complete(c, "(to|be)+")[0] == 200
        (pid,) = grammars.pids  # the worker the next compile runs in
        rss, threads = rss_mb(), threading.active_count()
        for regex in EXPLODING:
            start = time.perf_counter()
            status, reply = complete(c, regex)
            took = time.perf_counter() - start
            message = reply["error"]["message"]
            assert status == 400 and reply["error"]["param"] == "response_format", reply
            assert "took over 1 s to compile" in message and "\n" not in message
            assert took < 2.5, took  # the limit, the kill and the reply
            assert gone(pid) and grammars.pids == []  # killed and reaped; the next compile starts a new one
            assert compiling_threads() == []
        assert threading.active_count() <= threads + 1  # (at most the executor's idle thread)
        assert rss_mb() - rss < 200
        start = time.perf_counter()
        assert complete(c, EXPLODING[0])[0] == 400 and time.perf_counter() - start < 0.5  # refused again at once
        status, reply = complete(c)
        assert status == 200
        assert complete(c, "(or|not)+")[0] == 200 and len(grammars.pids) == 1  # a new worker, lazily


def test_a_grammar_over_the_memory_cap_is_a_400_naming_memory(shakes):
    with _client(shakes, grammar_seconds=60.0, grammar_memory_mb=64) as c:
        start = time.perf_counter()
        status, reply = complete(c, EXPLODING[0])
        assert status == 400 and "needed over 64 MB to compile" in reply["error"]["message"], reply
        assert time.perf_counter() - start < 15
        assert c.app.state.server.grammars.pids == [] and compiling_threads() == []
        assert complete(c)[0] == 200


def test_a_cached_grammar_does_not_go_to_the_worker(shakes, monkeypatch):
    from tokenloom.generation.constraints import clear_cache

    clear_cache()
    with _client(shakes) as c:
        grammars = c.app.state.server.grammars
        calls = []
        compile_ = grammars.compile

        async def counted(*args):
            calls.append(args[1:])
            return await compile_(*args)

        monkeypatch.setattr(grammars, "compile", counted)
        regex = "(to|be)( (or|not|to|be)){2}"
        first = complete(c, regex, max_tokens=16)
        second = complete(c, regex, max_tokens=16)
        assert first[0] == second[0] == 200 and len(calls) == 1
        assert first[1]["choices"][0]["text"] == second[1]["choices"][0]["text"]
        # the same constraint as offline build_constraint: the text matches the whole regex
        import re

        assert re.fullmatch(regex, first[1]["choices"][0]["text"])


@pytest.mark.parametrize("settings, says", [
    ({"grammar_seconds": 0}, "--grammar-seconds must be a number of seconds in (0, 3600], got 0"),
    ({"grammar_seconds": float("nan")}, "--grammar-seconds"),
    ({"grammar_memory_mb": 8}, "--grammar-memory-mb must be an integer number of MB in [16, 1048576], got 8"),
    ({"grammar_memory_mb": 64.5}, "--grammar-memory-mb"),
])
def test_the_limits_are_checked(settings, says):
    from tokenloom.errors import ConfigError
    from tokenloom.serving.config import ServeConfig

    with pytest.raises(ConfigError) as err:
        ServeConfig(model_name="m", **settings)
    assert says in str(err.value) and "\n" not in str(err.value)

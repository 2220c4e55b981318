"""``serve --rag``: POST /v1/rag answers as offline RAG does (the same passages in the same order, the same greedy
answer, its citations and fact check), refuses bad requests with a one-line 400, publishes its schema, and holds to
it under schemathesis (bodies that follow it and bodies that break it)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn) is not installed")

from tests.retrieval.conftest import QUESTION  # noqa: E402
from tokenloom.checkpoint import load_model, load_tokenizer  # noqa: E402
from tokenloom.generation import GenerationConfig  # noqa: E402
from tokenloom.retrieval import Encoder, IndexConfig, RagConfig, Retriever, build_index, rag_generate  # noqa: E402


@pytest.fixture(scope="module")
def served(corpus, checkpoint, tmp_path_factory):
    from fastapi.testclient import TestClient

    from tokenloom.serving.app import ServeConfig, create_app
    from tokenloom.serving.routes.rag import RagService

    out = tmp_path_factory.mktemp("served") / "idx"
    build_index(corpus, out, IndexConfig(chunk_size=12, chunk_overlap=4), Encoder.load(checkpoint))
    model, tokenizer = load_model(checkpoint)[0], load_tokenizer(checkpoint)
    retriever = Retriever.open(out, "hybrid", Encoder.load(checkpoint))
    app = create_app(model, tokenizer, ServeConfig(model_name="tiny", max_tokens=16, request_timeout=60),
                     rag=RagService(retriever, RagConfig()))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client, app, model, tokenizer, retriever


def test_rag_route_equals_offline_rag(served):
    client, _, model, tokenizer, retriever = served
    for method, k in (("bm25", 3), ("hybrid", 3), ("dense", 2)):
        r = client.post("/v1/rag", json={"question": QUESTION, "k": k, "retriever": method, "max_tokens": 8,
                                         "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        offline = rag_generate(model, tokenizer, retriever, QUESTION, RagConfig(top_k=k, retriever=method,
                                                                                fact_check="lexical"),
                               GenerationConfig(max_new_tokens=8, do_sample=False))
        assert [p["id"] for p in body["passages"]] == [h.passage.id for h in offline.hits]
        assert [p["score"] for p in body["passages"]] == pytest.approx([h.score for h in offline.hits])
        assert body["answer"] == offline.answer and body["citations"] == offline.citations
        assert body["fact_check"] == offline.fact_check.to_dict() and body["object"] == "rag.answer"
        assert body["usage"]["prompt_tokens"] == len(tokenizer.encode(offline.prompt))
    r = client.post("/v1/rag", json={"question": QUESTION, "fact_check": False, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["fact_check"] is None


@pytest.mark.parametrize("body, param", [
    ({}, "question"),
    ({"question": "   "}, "question"),
    ({"question": "Where is \u00e9?"}, "question"),  # outside the character vocabulary
    ({"question": QUESTION, "k": 0}, "k"),
    ({"question": QUESTION, "retriever": "sparse"}, "retriever"),
    ({"question": QUESTION, "alpha": 2}, "alpha"),
    ({"question": QUESTION, "max_tokens": 0}, "max_tokens"),
    ({"question": QUESTION, "temperature": "hot"}, "temperature"),
    ({"question": "Where " * 200}, "question"),  # longer than the context with the template
])
def test_bad_requests_are_one_line_400s(served, body, param):
    client = served[0]
    r = client.post("/v1/rag", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "\n" not in error["message"]


def test_the_route_is_in_the_schema_only_with_an_index(served, checkpoint):
    from fastapi.testclient import TestClient

    from tokenloom.serving.app import ServeConfig, create_app

    client, _, model, tokenizer, _ = served
    operation = client.get("/openapi.json").json()["paths"]["/v1/rag"]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    assert schema["required"] == ["question"] and schema["properties"]["retriever"]["enum"] == \
        ["bm25", "dense", "hybrid", None]
    plain = create_app(model, tokenizer, ServeConfig(model_name="tiny"))
    with TestClient(plain, base_url="http://127.0.0.1") as other:
        assert "/v1/rag" not in other.get("/openapi.json").json()["paths"]
        assert other.post("/v1/rag", json={"question": QUESTION}).status_code == 404


@pytest.fixture(scope="module")
def live(served, checkpoint):
    """``tokenloom serve CKPT --rag INDEX`` as a process (the CLI path), on 127.0.0.1."""
    pytest.importorskip("httpx", reason="the serve-test extra (httpx) is not installed")
    from tests.serving.live import LiveServer

    index = served[4].index.path
    server = LiveServer(checkpoint, "--rag", str(index), "--retriever", "hybrid", "--max-tokens", "8",
                        "--request-timeout", "60")
    yield server
    server.stop()


def test_serve_rag_from_the_command_line(live, served):
    import httpx

    r = httpx.post(live.url + "/v1/rag", json={"question": QUESTION, "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    expected = served[4].search(QUESTION, 3, "hybrid")  # --retriever hybrid: the server's default
    assert [p["id"] for p in r.json()["passages"]] == [h.passage.id for h in expected]


@pytest.mark.fuzz
def test_fuzz_the_rag_route(live):
    """schemathesis against ``serve --rag``, /v1/rag only: no 5xx, replies that match the schema, bodies the schema
    refuses refused (a body it allows may still be a 400: a question too long for the context)."""
    schemathesis = pytest.importorskip("schemathesis", reason="the serve-test extra (schemathesis) is not installed")
    hypothesis = pytest.importorskip("hypothesis", reason="the dev extra (hypothesis) is not installed")
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(live.url + "/openapi.json", timeout=30).include(path="/v1/rag")
    schema.config.generation.update(modes=["positive", "negative"], database="none",
                                    deterministic=bool(hypothesis.settings.default.derandomize))
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              negative_data_rejection]
    (operation,) = [op.ok() for op in schema.get_all_operations()]

    @hypothesis.given(case=operation.as_strategy())
    @hypothesis.settings(deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
    def run(case):
        case.call_and_validate(base_url=live.url, checks=checks, timeout=30)

    run()

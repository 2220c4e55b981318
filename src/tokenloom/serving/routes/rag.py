"""tokenloom's ``POST /v1/rag`` (``tokenloom serve CKPT --rag INDEX``): retrieve the top passages of the index for a
question, generate the answer on the continuous-batching engine from the prompt of
:func:`tokenloom.retrieval.rag.build_prompt`, and reply with the answer, its citations (passage ids), the retrieved
passages with their scores, and the lexical fact check::

    {"question": "Where was Ada born?", "k": 3, "retriever": "bm25", "max_tokens": 32, "temperature": 0}
    -> {"object": "rag.answer", "model", "answer", "citations": [id, ...], "passages": [{"id", "score", "text"}],
        "dropped": [id, ...], "fact_check": {"supported", "spans": [...]} | null, "usage"}

The sampling settings are those of the completions routes (``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
``seed``, ``stop`` — default a line break — and the penalties); one answer per request, no streaming.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from ...errors import GenerationError, TokenloomError
from ...retrieval.rag import RagAnswer, RagConfig, answer_text, finish, fit_prompt
from ...retrieval.search import RETRIEVERS, Retriever
from .. import schema as api_schema
from ..checks import APIError, encode_text, field, generation_settings, number
from ..logprobs import Choice
from ..state import ServerState
from .completions import collect, lm_request, make_requests, submit, usage, while_connected

MAX_K = 20  # passages one request may ask for
DEFAULT_MAX_TOKENS = 64  # an answer's new tokens when the request does not say (at most --max-tokens)


@dataclass
class RagService:
    """What ``serve --rag`` adds: the retriever over the index, and the defaults of a request."""

    retriever: Retriever  # the index (and the dense encoder, for dense and hybrid)
    config: RagConfig  # the default retriever, k, templates, stop and support threshold


def add_routes(router: APIRouter, state: ServerState) -> None:
    """POST /v1/rag, on a language model's server started with --rag."""
    if state.rag is None or not state.is_lm:
        return
    defaults = state.rag.config
    router.add_api_route("/v1/rag", rag, methods=["POST"], openapi_extra=api_schema.rag_operation(
        state.config, state.tokenizer, state.vocab, MAX_K, available(state), defaults.top_k, defaults.retriever))


def available(state: ServerState) -> list[str]:
    """The retrievers this server can run: dense and hybrid need an encoder."""
    return list(RETRIEVERS) if state.rag.retriever.encoder is not None else ["bm25"]


async def rag(request: HTTPRequest):
    state, body = await lm_request(request, "/v1/rag")
    service: RagService = state.rag
    question = field(body, "question", (str,), required=True)
    if not question.strip():
        raise APIError(400, "'question' is empty", param="question", code="invalid_value")
    encode_text(state.tokenizer, question, "question")
    k = field(body, "k", (int,), service.config.top_k)
    if not 1 <= k <= MAX_K:
        raise APIError(400, f"'k' must be in [1, {MAX_K}], got {k}", param="k", code="invalid_value")
    method = field(body, "retriever", (str,), service.config.retriever)
    if method not in available(state):
        raise APIError(400, f"'retriever' must be one of {', '.join(available(state))}, got {method[:40]!r}",
                       param="retriever", code="invalid_value")
    alpha = number(body, "alpha", service.config.alpha, 0.0, 1.0)
    checking = field(body, "fact_check", (bool,), True)
    settings = generation_settings({name: body[name] for name in api_schema.RAG_GENERATION_FIELDS
                                    if name in body}, state.config,
                                   default_max_tokens=DEFAULT_MAX_TOKENS, vocab=state.vocab)
    settings.update(stop=settings["stop"] or list(service.config.stop), logprobs=None, echo=False, constraint=None)
    config = RagConfig(top_k=k, retriever=method, alpha=alpha, template=service.config.template,
                       passage_template=service.config.passage_template, answer_tokens=service.config.answer_tokens,
                       threshold=service.config.threshold, fact_check="lexical" if checking else None)
    loop = asyncio.get_running_loop()
    try:  # (the dense encoder runs a forward pass: off the event loop)
        hits = await loop.run_in_executor(None, service.retriever.search, question, k, method, alpha)
        context = int(state.model.config.max_seq_len)
        prompt, ids, kept, dropped = fit_prompt(state.tokenizer, question, hits, context, settings["max_tokens"],
                                                config)
    except GenerationError as err:
        raise APIError(400, str(err), param="question", code="context_length_exceeded") from None
    except TokenloomError as err:
        raise APIError(400, str(err).splitlines()[0], param="question", code="invalid_value") from None
    settings["max_tokens"] = max(1, min(settings["max_tokens"], context - len(ids)))
    jobs = make_requests(state, [ids], settings, "question")
    started = await submit(state, jobs, settings)
    state.metrics.count_request("rag")
    choices = {index: Choice(index, r, state.tokenizer) for index, r, _ in started}
    await state.metrics.timed_collect(while_connected(request, collect(started, choices), started), started)
    raw = choices[0].text
    result = finish(RagAnswer(question, answer_text(raw, settings["stop"]), [], hits,
                              [h.passage.id for h in dropped], prompt), kept, config)
    out = result.to_dict()
    return {"object": "rag.answer", "model": state.config.model_name, "answer": out["answer"],
            "citations": out["citations"],
            "passages": [{"id": p["id"], "score": p["score"], "text": p["text"]} for p in out["passages"]],
            "dropped": out["dropped"], "fact_check": out["fact_check"], "usage": usage(started)}

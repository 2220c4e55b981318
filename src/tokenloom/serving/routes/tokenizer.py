"""vLLM's tokenizer routes, so a client can tokenize as the server does (lm-evaluation-harness's ``remote``
tokenizer needs only the server's address then): ``GET /tokenizer_info``, ``POST /tokenize`` (``{"prompt"}`` ->
``{"tokens", "count", "max_model_len"}``) and ``POST /detokenize`` (``{"tokens"}`` -> ``{"prompt"}``), on a language
model's server. Behind the API key like the ``/v1/`` routes."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from .. import schema as api_schema
from ..checks import APIError, encode_text, field, read_json, token_ids
from ..state import ServerState, server_state

MAX_DETOKENIZE = 65536  # ids one /detokenize request may send


def add_routes(router: APIRouter, state: ServerState) -> None:
    if not state.is_lm:  # (a translation model has two vocabularies: its source's and its target's)
        return
    router.add_api_route("/tokenizer_info", tokenizer_info, methods=["GET"],
                         responses=api_schema.tokenizer_info_responses())
    router.add_api_route("/tokenize", tokenize, methods=["POST"],
                         openapi_extra=api_schema.tokenize_operation(state.tokenizer))
    router.add_api_route("/detokenize", detokenize, methods=["POST"],
                         openapi_extra=api_schema.detokenize_operation(state.vocab, MAX_DETOKENIZE))


def context_of(state: ServerState) -> int:
    return state.model.config.max_seq_len


async def tokenizer_info(request: HTTPRequest):
    state = server_state(request)
    tokenizer = state.tokenizer
    eos = getattr(tokenizer, "eos_id", None)
    return {"model": state.config.model_name, "tokenizer_class": type(tokenizer).__name__,
            "vocab_size": state.vocab, "max_model_len": context_of(state),
            "eos_token": None if eos is None else tokenizer.backend.id_to_token(eos), "eos_token_id": eos,
            "bos_token": None, "pad_token": None}


async def tokenize(request: HTTPRequest):
    state = server_state(request)
    body = await read_json(request, state.config.max_body_bytes)
    prompt = field(body, "prompt", (str,), required=True)
    field(body, "add_special_tokens", (bool,), False)  # (tokenloom's tokenizers add none to a prompt)
    tokens = encode_text(state.tokenizer, prompt, "prompt", allow_empty=True)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": context_of(state)}


async def detokenize(request: HTTPRequest):
    state = server_state(request)
    body = await read_json(request, state.config.max_body_bytes)
    tokens = field(body, "tokens", (list,), required=True)
    if len(tokens) > MAX_DETOKENIZE:
        raise APIError(400, f"'tokens' holds {len(tokens)} ids; at most {MAX_DETOKENIZE}", param="tokens",
                       code="invalid_value")
    tokens = token_ids(tokens, state.vocab, "tokens", "a list of token ids")
    return {"prompt": state.tokenizer.decode(tokens)}

"""tokenloom's own ``/v1/translations`` for encoder-decoder and NAT models: a batch of sentences in, their
translations out, one batch at a time on the model (in a worker thread, off the event loop)."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from ...errors import TokenloomError
from ...models.registry import decoding_of
from .. import schema as api_schema
from ..checks import APIError, check_model, field, read_json
from ..state import ServerState, server_state

MAX_INPUTS, MAX_BEAM = 256, 8  # sentences per translation request, beam width


def add_routes(router: APIRouter, state: ServerState) -> None:
    """The route; the schema lists it only for a translation model (for a language model it answers 400
    unsupported_model)."""
    router.add_api_route("/v1/translations", translations, methods=["POST"], include_in_schema=not state.is_lm,
                         openapi_extra=api_schema.translations_operation(state.config, state.tokenizer, MAX_INPUTS,
                                                                         MAX_BEAM))


async def translations(request: HTTPRequest):
    state = server_state(request)
    model, config = state.model, state.config
    if state.engine is not None:
        raise APIError(400, "/v1/translations needs an encoder-decoder or NAT model; this server serves a "
                            "language model: use /v1/completions", code="unsupported_model")
    body = await read_json(request, config.max_body_bytes)
    check_model(body, config)
    given = field(body, "input", (str, list), required=True)
    sources = [given] if isinstance(given, str) else given
    if not sources or not all(isinstance(s, str) for s in sources) or len(sources) > MAX_INPUTS:
        raise APIError(400, f"'input' must be a string or a list of 1-{MAX_INPUTS} strings", param="input",
                       code="invalid_type")
    beam = field(body, "beam", (int,), 1)
    if not 1 <= beam <= MAX_BEAM:
        raise APIError(400, f"'beam' must be in [1, {MAX_BEAM}], got {beam}", param="beam", code="invalid_value")
    options = {} if decoding_of(model) == "parallel" else {"beam": beam}
    from ...tasks.translation import translate

    started = time.monotonic()
    async with state.translate_lock:  # one translation batch at a time on the model
        try:
            out = await asyncio.get_running_loop().run_in_executor(
                None, lambda: _translate(translate, model, state.tokenizer, sources, options))
        except TokenloomError as err:
            raise APIError(400, str(err), param="input", code="invalid_value") from None
    state.metrics.count_request("translations")
    state.metrics.observe_latency(time.monotonic() - started)
    return {"object": "list", "model": config.model_name,
            "data": [{"index": i, "translation": t} for i, t in enumerate(out)]}


def _translate(translate, model, tokenizer, sources, options):
    import torch

    with torch.inference_mode():
        return translate(model, tokenizer, sources, truncate=True, **options)

"""tokenloom's own ``/v1/translations`` for encoder-decoder and NAT models: a batch of sentences in, their
translations out. Requests batch together: those that arrive while the model translates wait, and the next batch
takes every waiting request of the same beam width (up to :data:`MAX_BATCH` sentences) in one call of the model (in
a worker thread, off the event loop), each request getting its own sentences' translations back
(:class:`TranslationBatcher`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fastapi import APIRouter
from fastapi import Request as HTTPRequest

from ...errors import TokenloomError
from ...models.registry import decoding_of
from .. import schema as api_schema
from ..checks import APIError, check_model, encode_text, field, read_json
from ..state import ServerState, server_state

MAX_INPUTS, MAX_BEAM = 256, 8  # sentences per translation request, beam width
MAX_BATCH = 256  # sentences one call of the model translates at most (requests of the same beam width together)


class TranslationBatcher:
    """Dynamic batching of translation requests: :meth:`translate` queues a request's sentences; one worker at a time
    runs ``run(sentences, options)`` (blocking, in a thread) over every waiting request with the first one's options,
    up to :data:`MAX_BATCH` sentences, and hands each request its slice. A batch that fails is run again request by
    request, so one request's error fails that request alone. ``batches`` / ``sentences`` count the calls made."""

    def __init__(self, run: Callable[[list[str], dict], list[str]]) -> None:
        self.run = run
        self.pending: list[tuple[list[str], dict, asyncio.Future]] = []
        self.worker: asyncio.Task | None = None
        self.batches = self.sentences = 0

    async def translate(self, sources: list[str], options: dict) -> list[str]:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((sources, options, future))
        if self.worker is None or self.worker.done():
            self.worker = asyncio.ensure_future(self._work())
        return await future

    async def _work(self) -> None:
        while self.pending:
            options = self.pending[0][1]
            batch, size = [], 0
            for item in self.pending:
                if item[1] == options and (not batch or size + len(item[0]) <= MAX_BATCH):
                    batch.append(item)
                    size += len(item[0])
            self.pending = [item for item in self.pending if item not in batch]
            batch = [item for item in batch if not item[2].done()]  # (a client that left)
            if not batch:
                continue
            try:
                outs = await self._call([s for item in batch for s in item[0]], options, [len(i[0]) for i in batch])
            except Exception as error:  # noqa: BLE001 — run each request alone: the error belongs to one of them
                if len(batch) == 1:
                    _settle(batch[0][2], error=error)
                    continue
                for sources, _, future in batch:
                    try:
                        [out] = await self._call(sources, options, [len(sources)])
                    except Exception as alone:  # noqa: BLE001
                        _settle(future, error=alone)
                    else:
                        _settle(future, out)
                continue
            for (_, _, future), out in zip(batch, outs, strict=True):
                _settle(future, out)

    async def _call(self, sources: list[str], options: dict, sizes: list[int]) -> list[list[str]]:
        out = await asyncio.get_running_loop().run_in_executor(None, self.run, sources, options)
        self.batches += 1
        self.sentences += len(sources)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [out[a:a + n] for a, n in zip(starts, sizes, strict=True)]


def _settle(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:  # noqa: ANN001
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def add_routes(router: APIRouter, state: ServerState) -> None:
    """The route; the schema lists it only for a translation model (for a language model it answers 400
    unsupported_model)."""
    router.add_api_route("/v1/translations", translations, methods=["POST"], include_in_schema=not state.is_lm,
                         openapi_extra=api_schema.translations_operation(state.config, state.tokenizer, MAX_INPUTS,
                                                                         MAX_BEAM, source_limit(state)))


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
    cut = over_the_limit(state, sources, isinstance(given, str), field(body, "truncate", (bool,), False))
    options = {} if decoding_of(model) == "parallel" else {"beam": beam}
    from ...tasks.translation import translate

    started = time.monotonic()
    if state.translator is None:
        state.translator = TranslationBatcher(
            lambda batch, opts: _translate(translate, model, state.tokenizer, batch, opts))
    try:
        out = await state.translator.translate(sources, options)
    except TokenloomError as err:
        raise APIError(400, str(err), param="input", code="invalid_value") from None
    state.metrics.count_request("translations")
    state.metrics.observe_latency(time.monotonic() - started)
    return {"object": "list", "model": config.model_name,
            "data": [{"index": i, "translation": t, "truncated": i in cut} for i, t in enumerate(out)]}


def source_limit(state: ServerState) -> int:
    """The model's source limit in tokens (its end-of-sentence token included); 0 for a language model (which has
    none: the route answers 400 unsupported_model)."""
    return 0 if state.is_lm else state.model.config.max_source_len


def over_the_limit(state: ServerState, sources: list[str], one: bool, truncate: bool) -> set[int]:
    """The indices of the sources longer than the model's source limit (in tokens, with the end-of-sentence token
    :func:`~tokenloom.tasks.translation.encode_sources` adds), which are translated truncated when the request
    asks ``truncate``; without it the first one is a 400 naming its index, its length and the limit."""
    limit = source_limit(state)
    cut = set()
    for i, text in enumerate(sources):
        where = "'input'" if one else f"'input'[{i}]"
        length = len(encode_text(state.tokenizer, text, "input", allow_empty=True)) + 1
        if length <= limit:
            continue
        if not truncate:
            raise APIError(400, f"{where} is {length} tokens (with its end-of-sentence token), over the model's "
                                f"source limit of {limit} tokens: split it, or send \"truncate\": true to translate "
                                f"its first {limit - 1} tokens", param="input", code="context_length_exceeded")
        cut.add(i)
    return cut


def _translate(translate, model, tokenizer, sources, options):
    import torch

    with torch.inference_mode():
        return translate(model, tokenizer, sources, truncate=True, **options)

"""What the routes, the middleware and the exception handlers of one app share: :class:`ServerState`, created by
:func:`~tokenloom.serving.app.create_app` and kept at ``app.state.server`` (:func:`server_state` reads it back)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse

from ..errors import ConfigError
from ..generation.choose import vocabulary_limit
from ..generation.drafting import PromptLookup
from ..grammar.worker import GrammarWorkers
from ..models.registry import decoding_of
from .checks import APIError
from .config import ServeConfig
from .engine import Engine
from .metrics import Metrics, log_to_stderr
from .security import check_api_key


@dataclass(eq=False)
class ServerState:
    """The served model and tokenizer, the settings, the metrics, the engine (language models only; ``None`` for a
    translation model) and the batcher that merges concurrent translation requests."""

    model: Any
    tokenizer: Any
    config: ServeConfig
    metrics: Metrics = field(default_factory=Metrics)
    is_lm: bool = False
    vocab: int = 0  # the token ids a request may name: below the tokenizer's vocabulary when the model's is padded
    #   past it, else below the model's
    engine: Engine | None = None
    translator: Any = None  # the translation batcher (routes.translations.TranslationBatcher), made at first use
    api_key: bytes | None = None  # the key's UTF-8 bytes, None: no key asked for
    post_paths: set[str] = field(default_factory=set)  # the routes that take a POST body (filled at the first request)
    loop: asyncio.AbstractEventLoop | None = None  # the event loop serving the app (set by the lifespan)
    chat_template: Any = None  # the checkpoint's recorded chat template (tokenloom.data.chat.ChatTemplate), which
    #   /v1/chat/completions renders messages with; None: the messages' contents joined by newlines
    rag: Any = None  # serve --rag: the routes.rag.RagService behind POST /v1/rag, None without it
    grammars: GrammarWorkers | None = None  # the worker processes response_format grammars compile in (none started
    #   until a grammar misses the cache), None for a translation model

    @classmethod
    def create(cls, model, tokenizer, config: ServeConfig, draft=None) -> ServerState:  # noqa: ANN001 - a model
        """``draft``: a draft model for speculative decoding (``config.prompt_lookup``: prompt lookup instead)."""
        state = cls(model, tokenizer, config, is_lm=decoding_of(model) == "causal_lm")
        if draft is not None and config.prompt_lookup:
            raise ConfigError("--draft and --prompt-lookup are two drafters: give one")
        if config.prompt_lookup:
            draft = PromptLookup(config.prompt_lookup)
        if draft is not None and not state.is_lm:
            raise ConfigError("speculative decoding (--draft, --prompt-lookup) applies to a language model's "
                              "completions; this server serves a translation model")
        if config.log_requests:  # serve --verbose: a speed line per finished completion
            state.metrics.log = log_to_stderr
        size = model.config.vocab_size
        state.vocab = vocabulary_limit(tokenizer, size) or size
        if state.is_lm:
            state.engine = Engine(model, tokenizer, config.max_batch, config.max_queue, on_step=state.metrics.on_step,
                                  dispatch=state.dispatch, draft=draft, num_draft_tokens=config.num_draft_tokens,
                                  on_draft=state.metrics.on_draft, block_size=config.block_size,
                                  kv_blocks=config.kv_blocks, prefix_caching=config.prefix_caching,
                                  prefill_tokens=config.prefill_tokens)
            state.grammars = GrammarWorkers(config.grammar_seconds, config.grammar_memory_mb)
        state.api_key = check_api_key(config.api_key) if config.api_key is not None else None
        if state.is_lm and getattr(tokenizer, "chat_template", None):  # loaded once; a bad one fails at start
            from ..data.chat import template_for_tokenizer

            state.chat_template = template_for_tokenizer(tokenizer, setting="tokenizer.chat_template")
        return state

    def dispatch(self, events: list) -> None:  # engine thread: one wake-up of the event loop per step
        self.loop.call_soon_threadsafe(_deliver_all, events)

    @asynccontextmanager
    async def lifespan(self, _app) -> AsyncIterator[None]:
        if self.loop is None:  # the first loop that serves the app stays the engine's
            self.loop = asyncio.get_running_loop()
        if self.engine is not None:
            self.engine.start()
        yield
        if self.engine is not None:
            self.engine.stop()
        if self.grammars is not None:
            self.grammars.close()

    def error_response(self, status: int, message: str, code: str) -> JSONResponse:
        """An error reply written outside a route (the middleware), counted like the ones routes raise."""
        self.metrics.count_error(status)
        return JSONResponse(APIError(status, message, code=code).body(), status_code=status)

    def wrong_host(self, host: str) -> JSONResponse:
        """The reply to a request whose ``Host`` the server does not answer (:class:`~.security.HostGuard`)."""
        shown = host if len(host) <= 80 else host[:80] + "..."
        return self.error_response(400, f"the Host header {shown!r} is not one this server answers (a page on "
                                        "another site, or DNS rebinding); start it with --allowed-hosts NAME to "
                                        "serve that name", code="host_not_allowed")


def server_state(request: HTTPRequest) -> ServerState:
    """The :class:`ServerState` of the app serving ``request``."""
    return request.app.state.server


def _deliver_all(events: list) -> None:
    for emit, event in events:
        emit(event)

"""The server's limits and settings: :class:`ServeConfig` (the ``tokenloom serve`` flags), checked on creation."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..grammar.worker import COMPILE_MEMORY_MB, COMPILE_SECONDS
from .security import HostPolicy, check_api_key, check_cors_origins


@dataclass
class ServeConfig:
    """Server limits and settings (``tokenloom serve`` flags)."""

    model_name: str
    api_key: str | None = None
    max_batch: int = 16
    max_queue: int = 64
    max_tokens: int = 1024  # the largest max_tokens a request may ask for
    max_body_bytes: int = 1 << 20
    max_prompts: int = 32  # prompts x n per request
    request_timeout: float = 300.0  # seconds
    # browser safety (tokenloom.serving.security): the address bound, extra Host names (``*``: any), CORS origins
    host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()  # empty: CORS off
    # speculative decoding (tokenloom.serving.speculation): prompt lookup's longest n-gram (0 = off; a draft model
    # is given to create_app), and the tokens drafted per verification pass
    prompt_lookup: int = 0
    num_draft_tokens: int = 4
    # the paged KV cache (tokenloom.serving.engine): positions per block, blocks in all (None: as many positions as
    # max_batch full contexts), whether prompts reuse cached blocks, and the tokens one step runs at most
    block_size: int = 16  # positions per block
    kv_blocks: int | None = None  # blocks in the pool; None: max_batch x the context's blocks
    prefix_caching: bool = True  # reuse the cached blocks of a prompt's prefix
    prefill_tokens: int = 512  # tokens a step runs at most: decode tokens and prompt chunks together
    # structured output (response_format): a grammar compiles in a worker process (tokenloom.grammar.worker), killed
    # past these limits (the request gets a 400)
    grammar_seconds: float = COMPILE_SECONDS  # wall-clock seconds a grammar may take to compile
    grammar_memory_mb: int = COMPILE_MEMORY_MB  # memory a grammar's compile may use, in MB
    log_requests: bool = False  # a line per finished completion on stderr (serve --verbose; Metrics.log)

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_queue", "max_tokens", "max_body_bytes", "max_prompts"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(self, name)}")
        for name, low in (("prompt_lookup", 0), ("num_draft_tokens", 1), ("block_size", 1), ("prefill_tokens", 1),
                          ("kv_blocks", 1)):
            if name == "kv_blocks" and self.kv_blocks is None:
                continue
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")
        if not (isinstance(self.request_timeout, (int, float)) and 0 < self.request_timeout <= 86400 * 7):
            raise ConfigError(f"--request-timeout must be a number of seconds in (0, 604800], got "
                              f"{self.request_timeout}")  # NaN fails the comparison too
        if not (isinstance(self.grammar_seconds, (int, float)) and not isinstance(self.grammar_seconds, bool)
                and 0 < self.grammar_seconds <= 3600):
            raise ConfigError(f"--grammar-seconds must be a number of seconds in (0, 3600], got "
                              f"{self.grammar_seconds!r}")  # NaN fails the comparison too
        if (not isinstance(self.grammar_memory_mb, int) or isinstance(self.grammar_memory_mb, bool)
                or not 16 <= self.grammar_memory_mb <= 1 << 20):
            raise ConfigError(f"--grammar-memory-mb must be an integer number of MB in [16, 1048576], got "
                              f"{self.grammar_memory_mb!r}")
        self.host_policy = HostPolicy.create(self.host, self.allowed_hosts)  # a ConfigError for a bad entry
        self.cors_origins = check_cors_origins(self.cors_origins)
        if self.api_key is not None:
            check_api_key(self.api_key)

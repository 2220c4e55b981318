"""Server counters in the Prometheus text format (version 0.0.4), written by hand (no client library)."""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

from ..speed import Speed, speed_line

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))


class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * len(BUCKETS)
        self.total, self.n = 0.0, 0

    def observe(self, value: float) -> None:
        for i, edge in enumerate(BUCKETS):
            if value <= edge:
                self.counts[i] += 1
        self.total += value
        self.n += 1

    def render(self, name: str, help_: str) -> list[str]:
        lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        for edge, count in zip(BUCKETS, self.counts, strict=True):
            le = "+Inf" if edge == float("inf") else f"{edge:g}"
            lines.append(f'{name}_bucket{{le="{le}"}} {count}')
        lines += [f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]
        return lines


def log_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def request_speed(request, finished: float) -> Speed:  # noqa: ANN001 - a serving Request
    """A finished request's :class:`~tokenloom.speed.Speed`, from the times the histograms observe: its arrival at the
    engine, its first token (time to first token), and ``finished`` (its last byte, time.monotonic())."""
    first = request.first_token_at
    speculative = request.drafted > 0
    return Speed(finished - request.submitted, new_tokens=len(request.new_ids), prompt_tokens=len(request.prompt_ids),
                 first_token_seconds=None if first is None else first - request.submitted,
                 drafted=request.drafted if speculative else None, accepted=request.accepted if speculative else None)


class Metrics:
    """Requests, errors, generated tokens, throughput over the last 10 s, latency and time-to-first-token
    histograms; the engine's queue depth and batch occupancy are read when rendering. ``log``, when set (``serve
    --verbose``), gets a line per finished completion request (:func:`request_speed`, one line per choice)."""

    WINDOW = 10.0  # seconds of the tokens/s gauge

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.errors: dict[int, int] = {}
        self.tokens = 0
        self.steps = 0
        self.drafted = self.accepted = 0  # speculative decoding: draft tokens verified, and kept
        self.recent: deque[tuple[float, int]] = deque()
        self.latency, self.ttft = Histogram(), Histogram()
        self.log: Callable[[str], None] | None = None

    def on_step(self, active: int, tokens: int) -> None:  # engine thread
        now = time.monotonic()
        with self._lock:
            self.tokens += tokens
            self.steps += 1
            self.recent.append((now, tokens))
            while self.recent and self.recent[0][0] < now - self.WINDOW:
                self.recent.popleft()

    def on_draft(self, drafted: int, accepted: int) -> None:  # engine thread
        with self._lock:
            self.drafted += drafted
            self.accepted += accepted

    def count_request(self, endpoint: str) -> None:
        with self._lock:
            self.requests[endpoint] = self.requests.get(endpoint, 0) + 1

    def count_error(self, status: int) -> None:
        with self._lock:
            self.errors[status] = self.errors.get(status, 0) + 1

    def observe_latency(self, seconds: float) -> None:
        with self._lock:
            self.latency.observe(seconds)

    def _finished(self, started, began: float) -> None:
        now = time.monotonic()
        with self._lock:
            self.latency.observe(now - began)
            for _, request, _ in started:
                if request.first_token_at is not None:
                    self.ttft.observe(request.first_token_at - request.submitted)
        if self.log is not None:
            for index, request, _ in started:
                head = "request" if len(started) == 1 else f"request (choice {index})"
                self.log(speed_line(request_speed(request, now), head))

    async def timed(self, events: AsyncIterator[bytes], started) -> AsyncIterator[bytes]:
        began = time.monotonic()
        try:
            async for item in events:
                yield item
        finally:
            self._finished(started, began)

    async def timed_collect(self, work: Awaitable, started):
        began = time.monotonic()
        try:
            return await work
        finally:
            self._finished(started, began)

    def render(self, engine, max_batch: int) -> str:
        now = time.monotonic()
        with self._lock:
            recent = [n for t, n in self.recent if t >= now - self.WINDOW]
            rate = sum(recent) / self.WINDOW
            lines = ["# HELP tokenloom_requests_total Requests accepted, by endpoint.",
                     "# TYPE tokenloom_requests_total counter"]
            lines += [f'tokenloom_requests_total{{endpoint="{k}"}} {v}' for k, v in sorted(self.requests.items())]
            lines += ["# HELP tokenloom_errors_total Error responses, by HTTP status.",
                      "# TYPE tokenloom_errors_total counter"]
            lines += [f'tokenloom_errors_total{{status="{k}"}} {v}' for k, v in sorted(self.errors.items())]
            lines += ["# HELP tokenloom_tokens_generated_total Tokens generated.",
                      "# TYPE tokenloom_tokens_generated_total counter",
                      f"tokenloom_tokens_generated_total {self.tokens}",
                      "# HELP tokenloom_decode_steps_total Engine steps (prefills and batched decode steps).",
                      "# TYPE tokenloom_decode_steps_total counter", f"tokenloom_decode_steps_total {self.steps}",
                      f"# HELP tokenloom_tokens_per_second Tokens generated per second over the last "
                      f"{self.WINDOW:g} s.", "# TYPE tokenloom_tokens_per_second gauge",
                      f"tokenloom_tokens_per_second {rate:.3f}",
                      "# HELP tokenloom_draft_tokens_total Speculative decoding: draft tokens verified by the model.",
                      "# TYPE tokenloom_draft_tokens_total counter", f"tokenloom_draft_tokens_total {self.drafted}",
                      "# HELP tokenloom_draft_tokens_accepted_total Speculative decoding: draft tokens the model kept.",
                      "# TYPE tokenloom_draft_tokens_accepted_total counter",
                      f"tokenloom_draft_tokens_accepted_total {self.accepted}"]
            active = engine.active if engine is not None else 0
            queued = engine.queued if engine is not None else 0
            lines += ["# HELP tokenloom_queue_depth Requests waiting for a batch slot.",
                      "# TYPE tokenloom_queue_depth gauge", f"tokenloom_queue_depth {queued}",
                      "# HELP tokenloom_active_requests Requests in the running batch.",
                      "# TYPE tokenloom_active_requests gauge", f"tokenloom_active_requests {active}",
                      "# HELP tokenloom_batch_occupancy Running batch / its capacity.",
                      "# TYPE tokenloom_batch_occupancy gauge", f"tokenloom_batch_occupancy {active / max_batch:.4f}"]
            if engine is not None:
                lines += cache_lines(engine.cache_stats())
            lines += self.latency.render("tokenloom_request_latency_seconds", "Time from request to its last byte.")
            lines += self.ttft.render("tokenloom_time_to_first_token_seconds",
                                      "Time from a request's arrival at the engine to its first token.")
        return "\n".join(lines) + "\n"


def cache_lines(stats: dict) -> list[str]:
    """The paged KV cache's gauges and counters (:meth:`~tokenloom.serving.engine.Engine.cache_stats`)."""
    queried, hit = stats["query_tokens"], stats["hit_tokens"]
    rows = [("kv_blocks_used", "gauge", "KV cache blocks held by requests.", stats["used"]),
            ("kv_blocks_free", "gauge", "KV cache blocks free or evictable.", stats["free"]),
            ("kv_blocks_cached", "gauge", "KV cache blocks registered in the prefix cache.", stats["cached_blocks"]),
            ("prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.", queried),
            ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache.", hit),
            ("prefix_cache_hit_rate", "gauge", "Prompt tokens found / looked up in the prefix cache.",
             f"{hit / queried if queried else 0.0:.4f}"),
            ("kv_evictions_total", "counter", "Cached blocks evicted for new ones.", stats["evictions"]),
            ("preemptions_total", "counter", "Requests preempted (blocks given back, prefilled again).",
             stats["preemptions"])]
    lines = []
    for name, kind, help_, value in rows:
        lines += [f"# HELP tokenloom_{name} {help_}", f"# TYPE tokenloom_{name} {kind}", f"tokenloom_{name} {value}"]
    return lines

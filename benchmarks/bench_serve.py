"""Serving throughput and latency: ``tokenloom serve`` (continuous batching) under one client at a time and under N
concurrent clients, on the same N greedy streaming completions.

The server runs as a subprocess on 127.0.0.1 (a free port unless ``--port``). After one untimed warm-up request,
phase A sends the N requests one after another and phase B sends them all at once (N concurrent streaming clients,
asyncio + httpx). Each request is a ``POST /v1/completions`` with ``temperature`` 0 and ``stream`` true; per request
the client records the time to the first non-empty text chunk (TTFT), the gaps between consecutive non-empty chunks
(inter-token latency: the bundled model is character-level, so one chunk is one token), the tokens (non-empty
chunks, checked against the length of the text and the server's ``usage``), the text and the finish reason.
tokens/s = all completion tokens of a phase / the phase's wall time.

Checks: every request ends with ``stop`` or ``length`` and no error event, and every concurrent text equals the
sequential text of the same prompt (greedy decoding: batching must not change the output). The exit status is 1
when a request was lost or a text differs. The target is concurrent tokens/s >= 5x sequential with 16 clients.

    python benchmarks/bench_serve.py                                   # 16 clients x 128 tokens, batch 16
    python benchmarks/bench_serve.py --clients 32 --max-tokens 64 --out serve.json
    python benchmarks/bench_serve.py --checkpoint runs/my-gpt --max-batch 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from tokenloom.benchmarks import report_load_and_save
from tokenloom.hardware import machine

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CHECKPOINT = REPO / "checkpoints" / "shakespeare-char"
# Tiny Shakespeare's characters only (no digits but 3): prompts past the 16th get a scene number in Roman numerals
LINES = ["ROMEO:\n", "JULIET:\nO ", "First Citizen:\nBefore we proceed", "KING HENRY:\n", "MERCUTIO:\nNay, ",
         "Good morrow, ", "To be, or not", "What light", "GLOUCESTER:\nNow is the ", "DUKE VINCENTIO:\n",
         "LADY CAPULET:\nWhat, ", "Second Servingman:\n", "BRUTUS:\nRomans, ", "MENENIUS:\nWhy, masters",
         "QUEEN MARGARET:\n", "PROSPERO:\nThou "]


def roman(n: int) -> str:
    out = ""
    for value, letters in ((1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"),
                           (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")):
        while n >= value:
            out, n = out + letters, n - value
    return out


def prompts(n: int) -> list[str]:
    """``n`` distinct prompts: the 16 lines, then the same lines under SCENE II., SCENE III., ..."""
    return [(f"SCENE {roman(i // len(LINES) + 1)}.\n" if i >= len(LINES) else "") + LINES[i % len(LINES)]
            for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command() -> list[str]:
    """``python -m tokenloom.cli.main``, or the ``tokenloom`` script next to the interpreter if that fails."""
    probe = subprocess.run([sys.executable, "-m", "tokenloom.cli.main", "serve", "--help"], capture_output=True)
    if probe.returncode == 0:
        return [sys.executable, "-m", "tokenloom.cli.main"]
    script = Path(sys.executable).with_name("tokenloom")
    if script.exists() or shutil.which("tokenloom"):
        return [str(script) if script.exists() else "tokenloom"]
    raise SystemExit(f"cannot run the server: python -m tokenloom.cli.main failed ({probe.stderr.decode()[-300:]})")


@dataclass
class Result:
    """One streamed completion as the client saw it (times in seconds from sending the request)."""

    index: int
    prompt: str
    text: str = ""
    chunks: int = 0  # non-empty text deltas
    usage_tokens: int | None = None  # the server's completion_tokens (stream_options.include_usage)
    finish_reason: str | None = None
    error: str | None = None
    ttft: float | None = None
    latency: float | None = None
    gaps: list[float] = field(default_factory=list)  # between consecutive non-empty deltas

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish_reason in ("stop", "length")


async def stream_one(client: httpx.AsyncClient, url: str, index: int, prompt: str, max_tokens: int) -> Result:
    result = Result(index, prompt)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "seed": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    parts: list[str] = []
    start = time.perf_counter()
    last: float | None = None
    done = False
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return result
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"error event: {json.dumps(event['error'])}"
                    continue
                if event.get("usage"):
                    result.usage_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        parts.append(choice["text"])
                        result.chunks += 1
                        if last is None:
                            result.ttft = now - start
                        else:
                            result.gaps.append(now - last)
                        last = now
                    if choice.get("finish_reason") is not None:
                        result.finish_reason = choice["finish_reason"]
    except httpx.HTTPError as err:
        result.error = f"{type(err).__name__}: {err}"
    result.latency = time.perf_counter() - start
    result.text = "".join(parts)
    if result.error is None and not done:
        result.error = "the stream ended without [DONE]"
    return result


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary(name: str, results: list[Result], wall: float) -> dict:
    done = [r for r in results if r.completed]
    tokens = sum(r.chunks for r in done)
    ttft = [r.ttft for r in done if r.ttft is not None]
    gaps = [g for r in done for g in r.gaps]

    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1e3

    return {"phase": name, "requests": len(results), "completed": len(done), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
            "itl_p50_ms": ms(percentile(gaps, 50)), "itl_p99_ms": ms(percentile(gaps, 99)),
            "itl_mean_ms": ms(sum(gaps) / len(gaps)) if gaps else None}


async def run_phases(url: str, texts: list[str], max_tokens: int) -> tuple[list[Result], float, list[Result], float]:
    timeout = httpx.Timeout(600.0, connect=30.0)
    limits = httpx.Limits(max_connections=len(texts) + 4, max_keepalive_connections=len(texts) + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        warm = await stream_one(client, url, -1, texts[0], max_tokens)
        if not warm.completed:
            raise RuntimeError(f"the warm-up request failed: {warm.error or warm.finish_reason}")
        start, cpu = time.perf_counter(), time.process_time()
        sequential = [await stream_one(client, url, i, t, max_tokens) for i, t in enumerate(texts)]
        sequential_wall = time.perf_counter() - start
        CLIENT_CPU["sequential"] = time.process_time() - cpu
        start, cpu = time.perf_counter(), time.process_time()
        concurrent = await asyncio.gather(*(stream_one(client, url, i, t, max_tokens) for i, t in enumerate(texts)))
        concurrent_wall = time.perf_counter() - start
        CLIENT_CPU["concurrent"] = time.process_time() - cpu
    return sequential, sequential_wall, list(concurrent), concurrent_wall


CLIENT_CPU: dict[str, float] = {}  # CPU seconds this benchmark's own clients used per phase (same 2 cores)


def start_server(command: list[str], checkpoint: Path, port: int, args: argparse.Namespace, log) -> subprocess.Popen:
    return subprocess.Popen([*command, "serve", str(checkpoint), "--host", "127.0.0.1", "--port", str(port),
                             "--max-batch", str(args.max_batch), "--max-queue", str(max(64, args.clients)),
                             "--precision", args.precision],
                            stdout=log, stderr=subprocess.STDOUT)


def wait_ready(process: subprocess.Popen, url: str, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not ready within {timeout:.0f} s")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def fmt(value: float | None, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def print_table(rows: list[dict]) -> None:
    print(f"{'phase':<11} {'requests':>8} {'tokens':>7} {'wall s':>7} {'tokens/s':>9} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}")
    for r in rows:
        print(f"{r['phase']:<11} {r['completed']:>4}/{r['requests']:<3} {r['tokens']:>7} {fmt(r['wall_s'], 7, 2)} "
              f"{fmt(r['tokens_per_s'], 9)} {fmt(r['ttft_p50_ms'], 9)} {fmt(r['ttft_p99_ms'], 9)} "
              f"{fmt(r['itl_p50_ms'], 8, 2)} {fmt(r['itl_p99_ms'], 8, 2)}")
    print("(TTFT = time to the first non-empty chunk, ITL = gap between non-empty chunks; both in ms)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                        help="a GPT checkpoint or run directory (default: checkpoints/shakespeare-char)")
    parser.add_argument("--clients", type=int, default=16, help="requests per phase = concurrent clients (16)")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (128)")
    parser.add_argument("--max-batch", type=int, default=16, help="the server's --max-batch (16)")
    parser.add_argument("--port", type=int, default=None, help="the server's port (default: a free one)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="fp32",
                        help="the server's --precision (default fp32: batched greedy output equals sequential "
                             "bit for bit; with bf16 a batch's rounding differs from one request's)")
    parser.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for /health (120)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="run both phases this many times, alternating; report each phase's fastest run (3)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if min(args.clients, args.max_tokens, args.max_batch, args.repeats) < 1:
        parser.error("--clients, --max-tokens, --max-batch and --repeats must be >= 1")

    print(f"Machine: {machine().describe()}", flush=True)
    load_before = os.getloadavg()[0]
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    texts = prompts(args.clients)
    command = server_command()
    with tempfile.TemporaryFile() as log:
        process = start_server(command, args.checkpoint, port, args, log)
        try:
            ready_s = wait_ready(process, url, args.ready_timeout)
            print(f"server ready in {ready_s:.1f} s: {args.checkpoint.name}, --max-batch {args.max_batch}; "
                  f"{args.clients} requests x max_tokens {args.max_tokens}, greedy, streaming")
            runs = [asyncio.run(run_phases(url, texts, args.max_tokens)) for _ in range(args.repeats)]
        finally:
            stop_server(process)
            log.seek(0)
            server_log = log.read().decode(errors="replace")

    def throughput(results: list[Result], wall: float) -> float:
        return sum(r.chunks for r in results if r.completed) / wall

    # the table shows each phase's fastest run (the phases alternate across --repeats, so a burst of load from
    # elsewhere hits both alike); every run is checked for lost and mismatched requests
    sequential, seq_wall = max(((r[0], r[1]) for r in runs), key=lambda run: throughput(*run))
    concurrent, conc_wall = max(((r[2], r[3]) for r in runs), key=lambda run: throughput(*run))
    per_run = [(throughput(r[0], r[1]), throughput(r[2], r[3])) for r in runs]
    rows = [summary("sequential", sequential, seq_wall), summary("concurrent", concurrent, conc_wall)]
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"] if rows[0]["tokens_per_s"] else 0.0
    lost = [(phase, r) for run in runs for phase, results in (("sequential", run[0]), ("concurrent", run[2]))
            for r in results if not r.completed]
    mismatched = [c for run in runs for results in (run[0], run[2]) for s, c in zip(runs[0][0], results, strict=True)
                  if s.completed and c.completed and s.text != c.text]
    # the three token counts (non-empty chunks, characters, the server's usage) should agree for a char model
    inconsistent = [r for r in sequential + concurrent
                    if r.completed and not (r.chunks == len(r.text) and r.usage_tokens in (None, r.chunks))]

    print()
    print_table(rows)
    print(f"concurrent / sequential tokens/s: {ratio:.2f}x (target >= 5x with 16 clients; fastest run of each "
          f"phase of {args.repeats})")
    print("per run (sequential, concurrent tokens/s, ratio): "
          + "; ".join(f"{a:.0f}, {b:.0f}, {b / a:.2f}x" for a, b in per_run))
    print("CPU seconds of this benchmark's own clients (they share the machine with the server): "
          + ", ".join(f"{phase} {seconds:.2f} s of {row['wall_s']:.2f} s wall" for (phase, seconds), row
                      in zip(CLIENT_CPU.items(), rows, strict=True)))
    print(f"lost requests: {len(lost)} of {2 * args.clients * args.repeats}; outputs different from the first "
          f"sequential run's: {len(mismatched)} of {2 * args.clients * args.repeats}")
    for phase, r in lost:
        print(f"  lost ({phase}) #{r.index} {r.prompt!r}: {r.error or f'finish_reason {r.finish_reason}'}")
    for c in mismatched:
        s = runs[0][0][c.index]
        at = next((i for i, (a, b) in enumerate(zip(s.text, c.text, strict=False)) if a != b),
                  min(len(s.text), len(c.text)))
        print(f"  mismatch #{c.index} {c.prompt!r}: first difference at character {at} "
              f"(sequential {s.text[at:at + 20]!r}, concurrent {c.text[at:at + 20]!r})")
    for r in inconsistent:
        print(f"  token counts differ #{r.index} {r.prompt!r}: {r.chunks} chunks, {len(r.text)} characters, "
              f"usage {r.usage_tokens}")
    server_lines = [line for line in server_log.splitlines() if line.strip() and not line.startswith("serving ")]
    if server_lines:  # warnings and errors (uvicorn logs at level warning)
        print("server output:\n" + "\n".join("  " + line for line in server_lines[-20:]))

    results = {"machine": machine().as_dict(), "checkpoint": str(args.checkpoint), "clients": args.clients,
               "max_tokens": args.max_tokens, "max_batch": args.max_batch, "phases": rows, "ratio": ratio,
               "lost": len(lost), "mismatched": len(mismatched), "client_cpu_s": CLIENT_CPU,
               "per_run_tokens_per_s": per_run, "inconsistent_token_counts": len(inconsistent),
               "requests": {"sequential": [asdict(r) for r in sequential],
                            "concurrent": [asdict(r) for r in concurrent]}}
    report_load_and_save(results, load_before, os.cpu_count() or 1, args.out)
    return 1 if lost or mismatched else 0


if __name__ == "__main__":
    sys.exit(main())

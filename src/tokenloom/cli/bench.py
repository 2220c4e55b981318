"""``tokenloom bench attention`` and ``tokenloom bench roofline``.

``bench attention``: time and peak memory of the attention backends over sequence lengths, with the
approximation error of the linear-time ones against exact softmax attention, as a table and a PNG.

Each (backend, length, mode) runs in a fresh worker process (``multiprocessing`` spawn), so that its peak
resident memory (``ru_maxrss``) minus the memory held before the call is the extra memory attention itself
needed; the worker times the forward pass (the fastest of ``--repeats`` after one warm-up call). ``math`` is the
explicit softmax (it materialises the (B, H, T, T) scores) and is skipped above ``--math-max-length``; full
``sdpa`` (time quadratic in T) above ``--sdpa-max-length``.

``window`` is sliding-window attention of ``--window`` W positions (:mod:`tokenloom.nn.sliding`): block-wise
through :class:`~tokenloom.nn.sliding.Band` with ``sdpa`` as the inner backend (the plan built inside the timed
call, as a model builds it once per forward), time and memory linear in T. Where T is too short for blocks
(:meth:`Band.plan` returns None) the row is ``window (dense)``: ``sdpa`` with the (T, T) windowed additive mask,
what a model runs then. Its rel. error is against that dense windowed attention (a check of the block-wise
computation, not an approximation error).
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from pathlib import Path

from ..errors import ConfigError

MODES = ("causal", "bidirectional")
BACKENDS = ("sdpa", "math", "performer", "linformer", "window")


def _split(values: list) -> list[str]:
    """``--flag a b,c`` -> ["a", "b", "c"] (empty pieces dropped)."""
    return [piece.strip() for value in values for piece in str(value).split(",") if piece.strip()]


def parse_lengths(values: list) -> list[int]:
    """Sequence lengths, space- or comma-separated, ``k`` = 1024 (``1k,4k`` -> [1024, 4096])."""
    lengths = []
    for piece in _split(values):
        text = piece.lower()
        scale = 1024 if text.endswith("k") else 1
        digits = text[:-1] if scale > 1 else text
        if not digits.isdigit() or int(digits) < 1:
            raise ConfigError(f"--lengths must be positive integers, optionally with a k suffix (1k = 1024), "
                              f"got {piece!r}")
        lengths.append(int(digits) * scale)
    if not lengths:
        raise ConfigError("--lengths must be positive integers, optionally with a k suffix (1k = 1024), got none")
    return lengths


def parse_backends(values: list) -> list[str]:
    backends = _split(values)
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ConfigError(f"--backends: unknown attention backend {unknown[0]!r}; known: {', '.join(BACKENDS)}")
    if not backends:
        raise ConfigError(f"--backends: no backend given; known: {', '.join(BACKENDS)}")
    return backends


def _worker(backend: str, length: int, causal: bool, batch: int, heads: int, head_dim: int, repeats: int,
            error_max_length: int, threads: int, window: int, queue) -> None:
    from .main import one_line_warnings

    one_line_warnings()  # a spawned process starts with Python's own format
    import resource
    import time

    import torch
    from torch.nn import functional as F

    from ..nn import ATTENTION_BACKENDS

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, head_dim) for _ in range(3))
    banded = None
    if backend == "window":
        from ..nn.attention import sdpa_attention
        from ..nn.masks import additive_mask
        from ..nn.sliding import Band, Window

        shape = Window(window, causal)

        def windowed_mask():  # the (T, T) additive mask a model uses where the sequence is too short for blocks
            pos = torch.arange(length)
            return additive_mask(shape.allowed(pos[:, None], pos[None]), q.dtype)

        def plan():
            return Band.plan(shape, length, dtype=q.dtype, device=q.device)

        banded = plan() is not None

        def implementation(q, k, v, mask, causal, dropout, need_weights):
            if banded:
                return plan().attend(sdpa_attention, q, k, v, dropout), None
            return sdpa_attention(q, k, v, windowed_mask(), False, dropout, need_weights)
    else:
        implementation = ATTENTION_BACKENDS.get(backend)
        if isinstance(implementation, type):
            implementation = implementation(heads, head_dim, max_len=length).eval()

    def run():
        with torch.inference_mode():
            return implementation(q, k, v, None, causal, 0.0, False)[0]

    def status_kib(field: str) -> int | None:  # VmRSS (now) or VmHWM (the high-water mark) from /proc
        try:
            with open("/proc/self/status") as fh:
                return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))
        except (OSError, StopIteration):
            return None

    try:  # reset the high-water mark to the current resident set (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass
    before = status_kib("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    out = run()
    first = time.perf_counter() - start
    peak = status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    del out
    times = [first]
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    error = None
    if (backend in ("performer", "linformer") or banded) and length <= error_max_length:
        with torch.inference_mode():
            if banded:  # the block-wise computation against the dense windowed mask
                exact = F.scaled_dot_product_attention(q, k, v, attn_mask=windowed_mask())
            else:
                exact = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            error = float((run() - exact).norm() / exact.norm())
    queue.put(dict(seconds=min(times[1:] or times), extra_mib=max(peak - before, 0) / 1024, error=error,
                   banded=banded))


def measure(backend: str, length: int, causal: bool, args: argparse.Namespace) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_worker, args=(backend, length, causal, args.batch, args.heads, args.head_dim,
                                                    args.repeats, args.error_max_length, args.threads,
                                                    args.window, queue))
    process.start()
    process.join()
    if process.exitcode != 0 or queue.empty():
        return dict(failed=f"worker exited with code {process.exitcode} (out of memory?)")
    return queue.get()


def bench_attention(args: argparse.Namespace) -> int:
    import dataclasses
    import datetime

    from ..hardware import machine

    for name in ("batch", "heads", "head_dim", "repeats", "threads", "window"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.lengths = parse_lengths(args.lengths)
    args.backends = parse_backends(args.backends)
    modes = MODES if args.mode == "both" else (args.mode,)
    rows = []
    for mode in modes:
        for backend in args.backends:
            if backend == "linformer" and mode == "causal":
                continue  # non-causal by construction
            for length in args.lengths:
                row = dict(mode=mode, backend=backend, length=length)
                if backend == "math" and length > args.math_max_length:
                    scores = args.batch * args.heads * length * length * 4 / 2**30
                    row["failed"] = f"skipped: the explicit scores alone take {scores:.1f} GiB"
                elif backend == "sdpa" and length > args.sdpa_max_length:
                    row["failed"] = _sdpa_skipped(rows, mode, length, args.sdpa_max_length)
                else:
                    row.update(measure(backend, length, mode == "causal", args))
                rows.append(row)
                name = "window (dense)" if row.get("banded") is False else backend
                print(f"  {mode:<13} {name:<14} {length:>6}: " + (row.get("failed") or
                      f"{1000 * row['seconds']:9.1f} ms  {row['extra_mib']:9.1f} MiB extra" +
                      (f"  rel. error {row['error']:.2e}" if row.get("error") is not None else "")),
                      file=sys.stderr, flush=True)
    for row in rows:  # ratios against exact SDPA of the same mode and length
        base = next((r for r in rows if r["backend"] == "sdpa" and r["mode"] == row["mode"]
                     and r["length"] == row["length"] and "seconds" in r), None)
        if base and "seconds" in row:
            row["speedup"] = base["seconds"] / row["seconds"]
            row["memory_ratio"] = row["extra_mib"] / base["extra_mib"] if base["extra_mib"] > 0 else None
    header = ["mode", "backend", "length", "ms", "ms / 1k positions", "extra MiB", "speedup vs sdpa",
              "memory / sdpa's", "rel. error"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['mode']} | {r['backend']} | {r['length']} | {r['failed']} |" + " |" * 5)
            continue
        name = "window (dense)" if r.get("banded") is False else r["backend"]
        speedup = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "-"
        memory_ratio = f"{r['memory_ratio']:.2f}" if r.get("memory_ratio") is not None else "-"
        error = (f"{r['error']:.3f}" if r["error"] >= 1e-3 else f"{r['error']:.1e}") if r.get("error") is not None \
            else "-"
        lines.append(f"| {r['mode']} | {name} | {r['length']} | {1000 * r['seconds']:.1f} | "
                     f"{1000 * r['seconds'] * 1024 / r['length']:.2f} | {r['extra_mib']:.1f} | {speedup} | "
                     f"{memory_ratio} | {error} |")
    table = "\n".join(lines)
    notes = _window_notes(rows, args) if "window" in args.backends else ""
    described = dataclasses.replace(machine(), threads=args.threads).describe()  # the workers' threads
    print(f"attention: batch {args.batch}, {args.heads} heads, head dim {args.head_dim}, float32; forward pass, "
          f"fastest of {args.repeats}; extra MiB = peak resident memory during the call minus before it; rel. error = "
          f"|out - exact| / |exact| (lengths <= {args.error_max_length})\n{described}\n\n{table}"
          + (f"\n\n{notes}" if notes else ""))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "attention-bench.md").write_text(f"{table}\n\n" + (f"{notes}\n\n" if notes else "")
                                                + f"Measured on: {described}, "
                                                f"{datetime.date.today().isoformat()}\n", encoding="utf-8")
        _plot(rows, out / "attention-bench.png")
    return 0


def _sdpa_skipped(rows: list[dict], mode: str, length: int, limit: int) -> str:
    """The table's entry for full sdpa above ``--sdpa-max-length``, with the time the square law predicts from
    the longest length measured."""
    measured = [r for r in rows if r["backend"] == "sdpa" and r["mode"] == mode and "seconds" in r]
    text = f"skipped: above --sdpa-max-length {limit}"
    if measured:
        base = max(measured, key=lambda r: r["length"])
        text += f" (~{base['seconds'] * (length / base['length']) ** 2:.3g} s by the square of {base['length']}'s)"
    return text


def _window_notes(rows: list[dict], args: argparse.Namespace) -> str:
    """What the window rows are, and per mode how their time and memory per position change over the lengths."""
    W = args.window
    lines = [f"window: sliding-window attention, W = {W} (causal: a query sees itself and the {W - 1} before it; "
             f"bidirectional: the {W // 2} either side), block-wise through tokenloom.nn.sliding.Band with sdpa "
             f"inside (the plan built in the timed call); window (dense): too few positions for blocks, sdpa with "
             f"the (T, T) windowed mask; rel. error against that dense windowed attention."]
    for mode in MODES:
        points = [r for r in rows if r["backend"] == "window" and r["mode"] == mode and r.get("banded")]
        if len(points) < 2:
            continue
        points.sort(key=lambda r: r["length"])
        first, last = points[0], points[-1]
        per_1k = ", ".join(f"{1000 * r['seconds'] * 1024 / r['length']:.2f} ({_k(r['length'])})" for r in points)
        growth = last["length"] / first["length"]
        memory = (f", extra memory x{last['extra_mib'] / first['extra_mib']:.1f}" if first["extra_mib"] > 0
                  else "")
        lines.append(f"window, {mode}, block-wise: ms per 1k positions {per_1k}; from {_k(first['length'])} to "
                     f"{_k(last['length'])} (x{growth:g} positions) time x{last['seconds'] / first['seconds']:.1f}"
                     f"{memory} (linear: x{growth:g})")
    return "\n".join(lines)


def _k(length: int) -> str:
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def _plot(rows: list[dict], path: Path) -> None:
    from .plotting import pyplot

    plt = pyplot("attention plot")
    if plt is None:
        return
    fig, (ax_time, ax_memory) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, style in (("causal", "-"), ("bidirectional", "--")):
        for backend in BACKENDS:
            points = [r for r in rows if r["mode"] == mode and r["backend"] == backend and "seconds" in r]
            if not points:
                continue
            lengths = [r["length"] for r in points]
            label = f"{backend} ({mode})"
            ax_time.plot(lengths, [1000 * r["seconds"] for r in points], style, marker="o", label=label)
            ax_memory.plot(lengths, [max(r["extra_mib"], 0.1) for r in points], style, marker="o", label=label)
    for ax, title in ((ax_time, "forward time (ms)"), (ax_memory, "extra memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax_time.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def memory_bandwidth(gib: float = 1.0, repeats: int = 10) -> tuple[float, float]:
    """(read, copy) bandwidth in bytes/s: the best of ``repeats`` ``x.sum()`` (reads ``gib`` GiB) and
    ``y.copy_(x)`` (reads and writes it) over float32 tensors."""
    import time

    import torch

    x = torch.ones(int(gib * 2**30) // 4)
    y = torch.empty_like(x)
    x.sum()
    y.copy_(x)
    read = copy = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        read = min(read, time.perf_counter() - start)
        start = time.perf_counter()
        y.copy_(x)
        copy = min(copy, time.perf_counter() - start)
    return x.numel() * 4 / read, 2 * x.numel() * 4 / copy


def bench_roofline(args: argparse.Namespace) -> int:
    """The machine's limits, measured now: matrix-product peak in float32 and bfloat16, memory bandwidth."""
    import torch

    from ..hardware import machine, matmul_peak

    if args.size < 64:
        raise ConfigError(f"--size must be >= 64, got {args.size}")
    if args.threads:
        torch.set_num_threads(args.threads)
    fp32 = matmul_peak(torch.float32, args.size)
    bf16 = matmul_peak(torch.bfloat16, args.size)
    read, copy = memory_bandwidth(args.gib)
    rows = [("matmul peak, float32", f"{fp32 / 1e9:,.0f} GFLOP/s", f"{args.size}^3, best of 5"),
            ("matmul peak, bfloat16", f"{bf16 / 1e9:,.0f} GFLOP/s", f"{bf16 / fp32:.1f}x float32"),
            ("memory read bandwidth", f"{read / 1e9:.1f} GB/s", f"x.sum() over {args.gib:g} GiB, best of 10"),
            ("memory copy bandwidth", f"{copy / 1e9:.1f} GB/s", "y.copy_(x): bytes read + written"),
            ("ridge point, float32", f"{fp32 / read:.0f} FLOP/byte", "below it a kernel is bandwidth-bound"),
            ("ridge point, bfloat16", f"{bf16 / read:.0f} FLOP/byte", "")]
    print(f"{machine().describe()}\n")
    print("| quantity | measured | note |\n|---|---:|---|")
    for name, value, note in rows:
        print(f"| {name} | {value} | {note} |")
    return 0

"""Depth-adaptive early exit on the bundled shakespeare-char model: the quality / speed curve, against the full
model measured in the same run.

The model is ``checkpoints/shakespeare-char`` (6 layers, 384 dims, 6 heads, vocabulary 65; float32), its exit heads
after each of layers 1-5 either **shared** (its own final norm and output layer: no new weights) or **trained** (a
norm of their own per layer in front of the tied output layer, trained here on the training split with the model
frozen, ``--train-steps`` steps of ``--train-batch`` random windows of 128 characters). For each kind and each
``--thresholds`` value:

* **ms/token**: greedy decoding at batch 1 from the first ``--prompt`` characters of the validation text,
  ``--tokens`` one-token steps, each timed alone (the forward under early exit and the argmax). Every
  configuration, the full model first, decodes its own sequence with its own cache, and they take turns step by
  step (so the machine's load hits all alike); ms/token is the median of all steps of all ``--repeats`` passes.
  **CPU** is the thread's CPU time (``time.thread_time``: the work of this step alone, steady on a machine whose
  other jobs preempt this one), **wall** the elapsed time (``time.perf_counter``: preemptions included).
  **speedup** = the full model's CPU ms/token / this one's (in brackets: the same from wall times).
* **layers (decode)**: the mean number of layers the decode steps ran (an exited position's layers above still
  store its keys and values: :mod:`tokenloom.generation.early_exit`).
* **val bpc**: bits per character under early exit, teacher-forced (one pass per window, no cache) over the first
  ``--val-windows`` windows of 256 characters of the validation split (the last 10% of Tiny Shakespeare, as the
  model's training split it); **layers (val)** the mean layers run there; **= full** the share of positions whose
  argmax equals the full model's; **bpc change** relative to the full model's bpc on the same windows.

``torch.set_num_threads(--threads)`` (default 1: on a 2-core machine shared with other jobs one thread is the
steadiest). ``--plot PATH`` writes the curve (speedup and bpc change against the threshold, and bpc against
speedup) as a PNG.

    python benchmarks/bench_early_exit.py                                  # about 5-8 minutes on 2 busy cores
    python benchmarks/bench_early_exit.py --tokens 24 --val-windows 1 --train-steps 5 --thresholds 1,0.9
    python benchmarks/bench_early_exit.py --plot early_exit.png
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _thresholds(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,0.9,0.8, got {text!r}") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"thresholds must be in (0, 1], got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(ROOT / "checkpoints" / "shakespeare-char"))
    parser.add_argument("--data", default=str(ROOT / "data" / "tinyshakespeare" / "input.txt"))
    parser.add_argument("--thresholds", type=_thresholds, default=[1.0, 0.99, 0.95, 0.9, 0.8, 0.6, 0.4],
                        help="exit thresholds, comma-separated (default 1,0.99,0.95,0.9,0.8,0.6,0.4)")
    parser.add_argument("--heads", default="shared,trained", help="exit head kinds (default shared,trained)")
    parser.add_argument("--tokens", type=_positive, default=96, help="decode steps timed per pass (default 96)")
    parser.add_argument("--prompt", type=_positive, default=32, help="prompt characters (default 32)")
    parser.add_argument("--repeats", type=_positive, default=3, help="timed passes (default 3)")
    parser.add_argument("--val-windows", type=_positive, default=8, help="validation windows of 256 (default 8)")
    parser.add_argument("--train-steps", type=_positive, default=40, help="exit-head training steps (default 40)")
    parser.add_argument("--train-batch", type=_positive, default=4, help="windows per training step (default 4)")
    parser.add_argument("--threads", type=_positive, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--plot", default=None, help="write the curve to this PNG")
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.heads.split(",") if k.strip()]
    if not kinds or any(k not in ("shared", "trained") for k in kinds):
        parser.error(f"--heads: shared and/or trained, got {args.heads!r}")

    import numpy as np
    import torch
    from torch.nn import functional as F

    from tokenloom.checkpoint import load_model, load_tokenizer
    from tokenloom.data.text import read_text
    from tokenloom.generation.early_exit import EarlyExit, ExitTally, early_exit_logits
    from tokenloom.hardware import machine
    from tokenloom.nn.exits import ExitHeads
    from tokenloom.training.exits import random_windows, train_exit_heads

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.perf_counter()
    model, _ = load_model(args.checkpoint)
    model = model.float().eval()
    c = model.config
    tokenizer = load_tokenizer(args.checkpoint)
    ids = np.asarray(tokenizer.encode_array(read_text(args.data)), dtype=np.int64)
    split = int(len(ids) * 0.9)
    train_ids, val_ids = ids[:split], ids[split:]
    W = 256
    windows = torch.from_numpy(np.stack([val_ids[i * W:(i + 1) * W + 1] for i in range(args.val_windows)]))
    val_x, val_y = windows[:, :-1], windows[:, 1:]  # (N, 256) each
    prompt = torch.from_numpy(val_ids[None, :args.prompt].copy())  # (1, P)

    print(f"Machine: {machine().describe()}")
    print(f"Model: {args.checkpoint} ({c.num_layers} layers, {c.embed_dim} dims, {c.num_heads} heads, vocab "
          f"{c.vocab_size}), float32, {args.threads} thread(s)", flush=True)

    heads = {"shared": ExitHeads.shared(c.num_layers)}
    if "trained" in kinds:
        trained = ExitHeads.trained(model.final_norm, c.num_layers, c.norm, c.embed_dim, c.norm_eps)
        t0 = time.perf_counter()
        losses = train_exit_heads(model, trained, random_windows(train_ids, args.train_batch, 128, seed=0),
                                  args.train_steps)
        print(f"trained exit heads: {args.train_steps} steps of {args.train_batch} x 128 characters in "
              f"{time.perf_counter() - t0:.0f} s (mean exit-head loss {losses[0]:.3f} -> "
              f"{statistics.mean(losses[-5:]):.3f} nats)", flush=True)
        heads["trained"] = trained
    configs = [("full", 1.0)] + [(kind, t) for kind in kinds for t in args.thresholds]

    # --- quality: teacher-forced bpc on the validation windows --------------------------------------------------
    def bits(logits) -> float:
        return F.cross_entropy(logits.flatten(0, 1).float(), val_y.flatten()).item() / math.log(2)

    with torch.inference_mode():
        full_logits = model(val_x)
        quality = {("full", 1.0): (bits(full_logits), float(c.num_layers), 1.0)}
        for kind, t in configs[1:]:
            out = early_exit_logits(model, val_x, t, heads[kind])
            same = (out.logits.argmax(-1) == full_logits.argmax(-1)).float().mean().item()
            quality[(kind, t)] = (bits(out.logits), out.layers.float().mean().item(), same)
    print(f"teacher-forced passes done ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)

    # --- speed: interleaved greedy decoding at batch 1 ----------------------------------------------------------
    times = {key: [] for key in configs}  # (cpu, wall) seconds of each step
    tallies = {key: ExitTally(c.num_layers) for key in configs}
    with torch.inference_mode():
        for _ in range(args.repeats):
            runs = []
            for key in configs:
                kind, t = key
                forward = model if kind == "full" else EarlyExit(model, t, heads[kind], tallies[key])
                cache = model.create_cache(1, args.prompt + args.tokens + 1)
                token = forward(prompt, cache=cache)[:, -1].argmax(-1, keepdim=True)  # (1, 1)
                runs.append([key, forward, cache, token])
            for _step in range(args.tokens):
                for run in runs:
                    key, forward, cache, token = run
                    cpu, wall = time.thread_time(), time.perf_counter()
                    token = forward(token, cache=cache)[:, -1].argmax(-1, keepdim=True)
                    times[key].append((time.thread_time() - cpu, time.perf_counter() - wall))
                    run[3] = token
    def ms(key: tuple[str, float], which: int) -> float:
        return 1000 * statistics.median(step[which] for step in times[key])

    full_cpu, full_wall = ms(("full", 1.0), 0), ms(("full", 1.0), 1)
    full_bpc = quality[("full", 1.0)][0]

    print(f"\nms/token = median of {args.repeats} x {args.tokens} one-token steps (batch 1, greedy, configurations "
          f"interleaved step by step; CPU = the thread's CPU time, wall = elapsed); val bpc over {args.val_windows} x "
          f"{W} characters of the validation split\n")
    print("| heads | threshold | ms/token CPU | ms/token wall | speedup CPU (wall) | layers (decode) | layers (val) | "
          "val bpc | bpc change | = full |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for key in configs:
        kind, t = key
        cpu, wall = ms(key, 0), ms(key, 1)
        decode_layers = tallies[key].mean_layers if kind != "full" else float(c.num_layers)
        bpc, val_layers, same = quality[key]
        change = 100 * (bpc - full_bpc) / full_bpc
        rows.append((kind, t, cpu, full_cpu / cpu, decode_layers, val_layers, bpc, change, same))
        print(f"| {kind} | {'-' if kind == 'full' else f'{t:g}'} | {cpu:.2f} | {wall:.2f} | {full_cpu / cpu:.2f}x "
              f"({full_wall / wall:.2f}x) | {decode_layers:.2f} | {val_layers:.2f} | {bpc:.4f} | {change:+.2f}% | "
              f"{same:.3f} |")
    print(f"\ntotal: {time.perf_counter() - started:.0f} s")
    if args.plot:
        _plot(rows, kinds, Path(args.plot))
        print(f"curve written to {args.plot}")
    return 0


def _plot(rows: list[tuple], kinds: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind in kinds:
        mine = [r for r in rows if r[0] == kind]
        left.plot([r[1] for r in mine], [r[3] for r in mine], "o-", label=f"{kind}: speedup")
        left.plot([r[1] for r in mine], [1 + r[7] / 100 for r in mine], "s--", label=f"{kind}: bpc / full")
        right.plot([r[3] for r in mine], [r[7] for r in mine], "o-", label=kind)
        for r in mine:
            right.annotate(f"{r[1]:g}", (r[3], r[7]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    left.set_xlabel("exit threshold")
    left.set_ylabel("x full model")
    left.invert_xaxis()
    left.legend(fontsize=8)
    right.axhline(2.0, color="grey", lw=0.8, ls=":")
    right.axvline(1.5, color="grey", lw=0.8, ls=":")
    right.set_xlabel("decode speedup at batch 1 (x)")
    right.set_ylabel("val bpc change (%)")
    right.legend(fontsize=8)
    fig.suptitle("Early exit, bundled shakespeare-char model")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

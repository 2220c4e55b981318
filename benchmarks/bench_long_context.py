"""Long-sequence models side by side (issue 27): trained runs of full attention over 64 and 256 positions, a sliding
window of 64 over 256 and Transformer-XL (segment 64 + memory 192), compared on

* validation bpc over the whole validation split (each model's own evaluation: windows of its context, or for
  Transformer-XL consecutive segments of streams with its memory; ``tokenloom evaluate``'s figure / ln 2),
* training throughput (the median ``tokens_per_s`` of the run's log) and training time,
* attention FLOPs per token (the score and value products, 4 C keys per layer, over the keys each query sees on
  average; Transformer-XL adds its position term's product with the S distances, 2 C S, and the projection of the
  distance table, 2 S C^2 per segment),
* the key/value memory decoding holds after 4,096 generated tokens (measured on the cache object after generating
  them; a full-attention model cannot pass its context, so ``tokenloom generate`` holds its context's cache and
  rebuilds it every half context: that size is reported).

    python benchmarks/bench_long_context.py runs/full-64 runs/full-256 runs/swa runs/xl [--generate 4096]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from tokenloom.checkpoint import load_model
from tokenloom.data.text import TextDataset
from tokenloom.hardware import machine
from tokenloom.nn.kv_cache import SegmentMemory
from tokenloom.tasks import LMTask


def attention_flops_per_token(config, seq_len: int) -> float:
    """Multiply-adds x 2 of q k^T and p v per token, all layers, averaged over a training window / segment."""
    C, L, T = config.embed_dim, config.num_layers, seq_len
    if config.memory_len:
        keys = config.memory_len + (T + 1) / 2
        S = config.memory_len + T
        per_layer = 4 * C * keys + 2 * C * S + 2 * S * C * C / T  # + (q + v) R^T and R's projection
        return L * per_layer
    if config.attention_window:
        W = min(config.attention_window, T)
        keys = (sum(min(i + 1, W) for i in range(T))) / T
    else:
        keys = (T + 1) / 2
    return L * 4 * C * keys


def cache_bytes(cache) -> int:
    """The key/value tensors a cache holds (a Transformer-XL memory: its layers' tensors; else its storage)."""
    if isinstance(cache, SegmentMemory):
        return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.k, layer.v)
                   if t is not None)
    return cache.kv.numel() * cache.kv.element_size()


def measure(run: Path, generated: int) -> dict:
    model, config = load_model(run / "checkpoint")
    model.eval()
    c = model.config
    train = config["train"]
    seq_len = train.get("seq_len") or c.max_seq_len
    dataset = TextDataset.open(run / "data")
    order = (config.get("data") or {}).get("order", "random")
    task = LMTask(dataset, batch_size=train["batch_size"], seq_len=seq_len, order=order, memory_len=c.memory_len)
    with torch.inference_mode():
        result = task.evaluate(model, max_batches=None)
    log = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in log if "tokens_per_s" in r]
    elapsed = max((r["elapsed_s"] for r in log if "elapsed_s" in r), default=float("nan"))
    steps = max((r["step"] for r in log if "step" in r), default=0)
    # decoding: greedy, one token at a time over the model's own cache strategy, `generated` tokens where the
    # model can pass its context, else up to its context
    prompt = torch.tensor([dataset.tokens("val")[:8].astype("int64")])
    n = generated if c.max_positions is None else c.max_seq_len - prompt.shape[1]
    cache = model.create_cache(1, prompt.shape[1] + n)
    with torch.inference_mode():
        token = model(prompt, cache=cache)[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(n - 1):
            token = model(token, cache=cache)[:, -1:].argmax(-1)
        seconds = time.perf_counter() - start
    return dict(run=run.name, params=sum(p.numel() for p in model.parameters()), steps=steps, minutes=elapsed / 60,
                bpc=result["val_loss"] / math.log(2), tokens=result["tokens"],
                tokens_per_s=statistics.median(rates) if rates else float("nan"),
                flops=attention_flops_per_token(c, seq_len), cache_mib=cache_bytes(cache) / 2**20, decoded=n,
                ms_per_token=1000 * seconds / max(n - 1, 1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--generate", type=int, default=4096, help="tokens to decode for the memory column")
    args = parser.parse_args()
    rows = [measure(run, args.generate) for run in args.runs]
    print(f"{machine().describe()}, {time.strftime('%Y-%m-%d')}\n")
    print("| run | parameters | steps (minutes) | val bpc (tokens) | train tokens/s | attention FLOPs/token | "
          "KV memory while decoding | decode ms/token |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        note = "" if r["decoded"] == args.generate else f" (its context: {r['decoded'] + 8} positions)"
        print(f"| {r['run']} | {r['params'] / 1e6:.2f}M | {r['steps']} ({r['minutes']:.1f}) | {r['bpc']:.4f} "
              f"({r['tokens']:,}) | {r['tokens_per_s']:,.0f} | {r['flops'] / 1e6:.2f}M | {r['cache_mib']:.2f} MiB"
              f"{note} | {r['ms_per_token']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

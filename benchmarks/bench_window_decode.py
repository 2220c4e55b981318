"""Decoding with sliding-window attention: the rolling KV cache against a dense one, per-token cost and cache
memory as the sequence grows, both in the same run.

The model is the shakespeare-char shape (6 layers, 384 dims, 6 heads, vocabulary 65, max_seq_len 256) with RoPE
and ``attention_window`` W (``--window``, default 256), random weights, eval mode, float32, batch 1. It decodes
``--tokens`` tokens greedily from a random ``--prompt`` token prompt, one token per call of ``model(ids,
cache=cache)`` under ``torch.inference_mode()`` (the call ``tokenloom.generation.generate`` makes per step):

* rolling: ``model.create_cache(1, rolling=True)``, a ring of W positions per layer (memory flat, each step
  attends W keys);
* dense (the reference): ``create_cache(1, N, rolling=False)``, N = prompt + tokens positions preallocated, the
  window applied by the mask (each step attends every position so far, the mask hiding all but the last W). The
  dense cache does not grow the RoPE tables past ``max_seq_len`` (the rolling one does), so the reference model is
  the same GPT with ``max_seq_len`` = N, sharing the rolling model's weights (the same tensors).

The two take turns step by step (rolling, then dense fed the same token), so the machine's load hits both alike;
the dense run is teacher-forced on the rolling run's tokens and its greedy choice is compared with them. Each
step is timed alone (the forward and the argmax); **ms/token at a checkpoint c** is the mean over the
``--slice`` (200) steps ending at the c-th generated token, the cache holding prompt + c positions then.
**cache MiB** = ``cache.kv.numel() * cache.kv.element_size()`` (what is allocated; the dense cache's is N
positions from the start), **filled** = the part holding positions (the dense cache's first prompt + c).

    python benchmarks/bench_window_decode.py                         # 10000 tokens, checkpoints 1k, 5k, 10k
    python benchmarks/bench_window_decode.py --tokens 600 --threads 1  # a smoke run (checkpoint 600)
    python benchmarks/bench_window_decode.py --window 512 --tokens 20000 --checkpoints 1k,10k,20k
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _count(text: str) -> int:
    text = text.strip().lower()
    value = int(text[:-1]) * 1000 if text.endswith("k") else int(text)
    if value < 1:
        raise ValueError(text)
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=_positive, default=256, help="attention_window W (default 256)")
    parser.add_argument("--tokens", type=_positive, default=10000, help="tokens to generate (default 10000)")
    parser.add_argument("--prompt", type=_positive, default=16, help="prompt length in tokens (default 16)")
    parser.add_argument("--checkpoints", default="1k,5k,10k",
                        help="generated-token counts to report at, comma-separated, k = 1000 (default 1k,5k,10k; "
                             "those past --tokens are dropped, --tokens itself is added when none is left)")
    parser.add_argument("--slice", type=_positive, default=200, help="steps averaged per checkpoint (default 200)")
    parser.add_argument("--threads", type=_positive, default=os.cpu_count() or 1,
                        help="torch.set_num_threads (default: all cores)")
    args = parser.parse_args(argv)
    try:
        requested = sorted({_count(c) for c in args.checkpoints.split(",") if c.strip()})
    except ValueError:
        parser.error(f"--checkpoints: expected counts like 1k,5k,10k, got {args.checkpoints!r}")
    checkpoints = [c for c in requested if c <= args.tokens] or [args.tokens]

    import torch

    from tokenloom.hardware import machine
    from tokenloom.models.gpt import GPT, GPTConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    N = args.prompt + args.tokens
    shape = dict(vocab_size=65, num_layers=6, num_heads=6, embed_dim=384, position="rope",
                 attention_window=args.window)
    model = GPT(GPTConfig(max_seq_len=256, **shape)).eval()
    reference = GPT(GPTConfig(max_seq_len=max(256, N), **shape)).eval()
    reference.load_state_dict(model.state_dict(), assign=True)  # the same weight tensors
    rolling = model.create_cache(1, rolling=True)
    dense = reference.create_cache(1, N, rolling=False)
    assert type(rolling).__name__ == "RollingKVCache" and type(dense).__name__ == "KVCache"
    prompt = torch.randint(0, 65, (1, args.prompt), generator=torch.Generator().manual_seed(0))

    print(f"Machine: {machine().describe()}")
    print(f"GPT shakespeare-char shape (6 layers, 384 dims, 6 heads, vocab 65), rope, attention_window "
          f"{args.window}, random weights, float32, batch 1; prompt {args.prompt} tokens, {args.tokens} generated "
          f"greedily one per step; rolling and dense steps interleaved", flush=True)

    times = {"rolling": [], "dense": []}  # seconds of step t (t = 1 .. tokens): the t-th generated token fed
    filled = {}
    agree, worst = 0, 0.0
    report = sorted(set(checkpoints) | {min(args.tokens, c + 1) for c in range(0, args.tokens, 1000)})
    started = time.perf_counter()
    with torch.inference_mode():
        logits = model(prompt, cache=rolling)[:, -1]
        reference(prompt, cache=dense)
        token = logits.argmax(-1, keepdim=True)  # (1, 1)
        for t in range(1, args.tokens + 1):
            start = time.perf_counter()
            logits = model(token, cache=rolling)[:, -1]
            following = logits.argmax(-1, keepdim=True)
            middle = time.perf_counter()
            dense_logits = reference(token, cache=dense)[:, -1]
            dense_choice = dense_logits.argmax(-1, keepdim=True)
            end = time.perf_counter()
            times["rolling"].append(middle - start)
            times["dense"].append(end - middle)
            agree += int(dense_choice.item() == following.item())
            worst = max(worst, float((dense_logits - logits).abs().max()))
            token = following
            if t in checkpoints:
                filled[t] = dense.length
            if t in report or t == args.tokens:
                print(f"  {t:>6} tokens: rolling {1000 * times['rolling'][-1]:.2f} ms, dense "
                      f"{1000 * times['dense'][-1]:.2f} ms (last step), {time.perf_counter() - started:.0f} s",
                      file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - started

    def mib(cache) -> float:
        return cache.kv.numel() * cache.kv.element_size() / 2**20

    per_position = mib(dense) / dense.max_len  # MiB per position, all layers, keys and values
    print(f"\nms/token = mean of the {args.slice} steps ending at the checkpoint; cache MiB = cache.kv.numel() x "
          f"element_size() (allocated); filled = the part holding positions\n")
    print("| generated | positions | rolling ms/token | dense ms/token | rolling / dense | rolling cache MiB "
          "| dense cache MiB (filled) | rolling / dense (filled) |\n|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in checkpoints:
        lo = max(0, c - args.slice)
        r = 1000 * sum(times["rolling"][lo:c]) / (c - lo)
        d = 1000 * sum(times["dense"][lo:c]) / (c - lo)
        dense_filled = per_position * filled[c]
        print(f"| {c} | {filled[c]} | {r:.2f} | {d:.2f} | {r / d:.2f} | {mib(rolling):.2f} | "
              f"{mib(dense):.2f} ({dense_filled:.2f}) | {mib(rolling) / mib(dense):.3f} "
              f"({mib(rolling) / dense_filled:.3f}) |")
    print(f"\nrolling cache: {rolling.slots} slots + 1 spare per layer (window {args.window}), the same size at "
          f"every checkpoint; dense cache: {dense.max_len} positions preallocated")
    print(f"agreement: the dense run's greedy token equals the rolling run's at {agree}/{args.tokens} steps; "
          f"max |logit difference| {worst:.2e}")
    print(f"total: {elapsed:.1f} s (rolling {sum(times['rolling']):.1f} s, dense {sum(times['dense']):.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Attention backends over sequence lengths: forward time, extra peak memory (each measurement in a fresh
process) and, for the linear-time backends (Performer, Linformer), the relative error against exact softmax
attention; a Markdown table and a log-log PNG. Every argument is passed on to ``tokenloom bench attention``.

    python benchmarks/bench_attention.py                                   # 512 2048 8192 16384, 8 heads x 64
    python benchmarks/bench_attention.py --lengths 1024 4096 --mode causal --backends sdpa performer --out att/
    python benchmarks/bench_attention.py --backends sdpa,window,performer --lengths 1k,4k,16k,64k  # W = 512
"""

from __future__ import annotations

import sys

from tokenloom.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "attention", *sys.argv[1:]]))

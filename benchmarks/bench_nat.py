"""Autoregressive vs non-autoregressive translation, measured side by side in one run: the matched table of
``tokenloom bench translate`` (AR greedy and beam 5, also of a deep-encoder / shallow-decoder AR model; NAT and
GLAT one pass and length beam; CMLM 1 / 4 / 10 iterations; CTC; Levenshtein 3 / 10 rounds; Insertion; SAT K
tokens per step) with BLEU and its gap to AR beam 5, chrF, latency per sentence at batch 1, throughput at batch
64, speedup relative to AR beam 5 and AR greedy, decoder passes per sentence and the Pareto frontier, written as
Markdown, CSV and a speed/quality PNG (frontier marked).

    python benchmarks/bench_nat.py checkpoints/multi30k-de-en runs/cmlm runs/ctc runs/nat --out bench/nat
    python benchmarks/bench_nat.py checkpoints/multi30k-de-en runs/deep-shallow runs/semi-ar runs/glat \
        runs/levenshtein runs/insertion --out bench/family
    python benchmarks/bench_nat.py checkpoints/multi30k-de-en runs/cmlm --limit 200 --latency-sentences 50

Every argument is passed on to ``tokenloom bench translate`` (``--split`` defaults to test2016 there).
"""

from __future__ import annotations

import sys

from tokenloom.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "translate", *sys.argv[1:]]))

"""Training throughput: 1 process x batch 2B against 2 processes x batch B (DDP, FSDP) on the demo recipe.

The same global batch, the same recipe (configs/shakespeare-char.yaml unless given); tokens/s is the median of
the logged windows after the first 10 steps (every window counts the global batch's tokens). Rounds alternate
the configurations so the machine's drift falls on all of them.

    python benchmarks/bench_distributed.py [--steps 60] [--rounds 2] [--recipe configs/shakespeare-char.yaml]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(recipe: str, out: Path, steps: int, nproc: int, strategy: str, batch: int, precision: str) -> float:
    command = [sys.executable, "-m", "tokenloom", "train", recipe, "--out", str(out),
               "--set", f"train.max_steps={steps}", "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0",
               "--set", "train.log_every=5", "--set", "train.max_minutes=null", "--set", "train.eval_batches=1",
               "--set", f"train.batch_size={batch}", "--set", f"train.precision={precision}"]
    if nproc > 1:
        command += ["--nproc", str(nproc), "--strategy", strategy]
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True, text=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="configs/shakespeare-char.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="the global batch (sequences)")
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    args = parser.parse_args()
    from tokenloom.hardware import machine

    print(f"Machine: {machine().describe()}", flush=True)
    configs = [("1 process", 1, "single", args.batch), ("2 processes DDP", 2, "ddp", args.batch // 2),
               ("2 processes FSDP", 2, "fsdp", args.batch // 2)]
    results: dict[str, list[float]] = {name: [] for name, *_ in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, (name, nproc, strategy, batch) in enumerate(configs):
                results[name].append(run(args.recipe, Path(tmp) / f"{r}-{i}", args.steps, nproc, strategy, batch,
                                         args.precision))
    base = statistics.median(results["1 process"])
    print(f"{args.recipe}, {args.precision}, global batch {args.batch}, {args.steps} steps, {args.rounds} rounds")
    print(f"{'configuration':<20} {'tokens/s':>10} {'vs 1 process':>13}   per round")
    for name, values in results.items():
        tps = statistics.median(values)
        print(f"{name:<20} {tps:>10,.0f} {tps / base:>12.2f}x   " + ", ".join(f"{v:,.0f}" for v in values))


if __name__ == "__main__":
    main()

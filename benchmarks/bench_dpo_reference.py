"""DPO's frozen reference: the training step with the reference log-probabilities cached once per example
(``data.reference_cache: true``, the default) against running the reference model on every batch (``false``).

A random GPT checkpoint (character vocabulary) stands in for the SFT model; the pairs are synthetic prompts with two
replies of ``--reply`` characters. Both variants train the same batches from the same weights in one process,
taking turns ``--repeats`` times; after ``--warmup`` steps each step (``Trainer.train_step``: forward, backward,
AdamW) is timed and the median reported, with the one-off cost of filling the cache (every item's two sequences
through the reference once, then the reference freed).

    python benchmarks/bench_dpo_reference.py                     # 4 layers, 256 dims, batch 8
    python benchmarks/bench_dpo_reference.py --layers 6 --dim 384 --threads 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--reply", type=int, default=48, help="characters per reply")
    p.add_argument("--steps", type=int, default=12, help="timed steps per variant and repeat")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()

    import torch

    from tokenloom.checkpoint import write_checkpoint
    from tokenloom.data.tokenizers import Tokenizer
    from tokenloom.hardware import machine
    from tokenloom.models.factory import model_config_to_dict
    from tokenloom.models.gpt import GPT, GPTConfig
    from tokenloom.training import load_run_config, setup_run

    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine().describe())
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz "

    def text(n: int) -> str:
        return "".join(rng.choice(letters) for _ in range(n))

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pairs = [{"prompt": text(24), "chosen": text(args.reply), "rejected": text(args.reply)}
                 for _ in range(args.pairs)]
        (tmp / "pairs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in pairs))
        tok = Tokenizer.train_char("System: User: Assistant: \n" + letters)
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=tok.vocab_size, num_layers=args.layers, num_heads=args.heads,
                           embed_dim=args.dim, max_seq_len=128)
        write_checkpoint(tmp / "sft", GPT(config), {"model": model_config_to_dict("gpt", config), "tokenizer": {}},
                         tok)
        trainers = {}
        for cache in (True, False):
            run = load_run_config({"task": "dpo", "data": {"path": str(tmp / "pairs.jsonl"), "reference_cache": cache},
                                   "train": {"init_from": str(tmp / "sft"), "max_steps": 10_000,
                                             "batch_size": args.batch, "device": "cpu", "precision": "fp32",
                                             "warmup_steps": 0}})
            trainers[cache] = setup_run(run, tmp / f"run-{cache}", show_progress=False)
            trainers[cache].model.train()
        start = time.perf_counter()
        trainers[True].task.fill_reference_cache(trainers[True].model)
        fill = time.perf_counter() - start
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for cache, trainer in trainers.items():
                for i in range(args.warmup + args.steps):
                    start = time.perf_counter()
                    trainer.train_step()
                    if i >= args.warmup:
                        times[cache].append(time.perf_counter() - start)
        cached, uncached = statistics.median(times[True]), statistics.median(times[False])
        items = len(trainers[True].task.splits["train"]) + len(trainers[True].task.splits["val"])
        print(f"GPT {args.layers} x {args.dim}, batch {args.batch} pairs, replies of {args.reply} characters")
        print(f"reference every step : {uncached * 1e3:8.1f} ms/step (median of {len(times[False])})")
        print(f"reference cached     : {cached * 1e3:8.1f} ms/step (median of {len(times[True])}); "
              f"{uncached / cached:.2f}x faster, {1 - cached / uncached:.0%} less time per step")
        print(f"cache fill (once)    : {fill * 1e3:8.1f} ms for {items} pairs "
              f"(= {fill / max(uncached - cached, 1e-9):.1f} steps' saving)")


if __name__ == "__main__":
    main()

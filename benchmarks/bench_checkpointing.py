"""Activation checkpointing (``train.activation_checkpointing``): peak memory and time of a GPT training step
with and without it, each variant in a fresh process.

A step is forward + cross-entropy + backward + AdamW. After one untimed step (which also allocates the
optimizer state) the process's high-water mark is reset (``/proc/self/clear_refs``); the extra peak memory of
the next steps is VmHWM minus VmRSS before them, and the time is the median of ``--steps`` steps.

    python benchmarks/bench_checkpointing.py                               # 6 layers, 384 dims, context 1024
    python benchmarks/bench_checkpointing.py --batch 8 --precision bf16
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))


def _worker(checkpointing: bool, args: argparse.Namespace, queue) -> None:
    import torch
    from torch.nn import functional as F

    from tokenloom.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model = GPT(GPTConfig(vocab_size=65, num_layers=args.layers, num_heads=args.heads, embed_dim=args.dim,
                          max_seq_len=args.context, gradient_checkpointing=checkpointing)).to(dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 65, (args.batch, args.context + 1), generator=gen)

    def step() -> float:
        start = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before = _status_kib("VmRSS")
    times = [step() for _ in range(args.steps)]
    peak = _status_kib("VmHWM")
    queue.put(dict(seconds=statistics.median(times), extra_mib=(peak - before) / 1024, peak_mib=peak / 1024))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    from tokenloom.hardware import machine

    print(f"Machine: {machine().describe()}")
    context = multiprocessing.get_context("spawn")
    rows = {}
    for checkpointing in (False, True):
        queue = context.Queue()
        process = context.Process(target=_worker, args=(checkpointing, args, queue))
        process.start()
        process.join()
        rows[checkpointing] = queue.get()
    plain, saved = rows[False], rows[True]
    print(f"GPT {args.layers} layers, {args.dim} dims, context {args.context}, batch {args.batch}, {args.precision}")
    print("| activation checkpointing | step time (s) | extra peak memory (MiB) | process peak (MiB) |\n"
          "|---|---:|---:|---:|")
    for name, r in (("off", plain), ("on", saved)):
        print(f"| {name} | {r['seconds']:.2f} | {r['extra_mib']:,.0f} | {r['peak_mib']:,.0f} |")
    print(f"\nextra peak memory {100 * (1 - saved['extra_mib'] / plain['extra_mib']):.0f}% lower "
          f"(process peak {100 * (1 - saved['peak_mib'] / plain['peak_mib']):.0f}%), "
          f"time {100 * (saved['seconds'] / plain['seconds'] - 1):+.0f}%")


if __name__ == "__main__":
    main()

"""LoRA vs full fine-tuning (issue 32): validation loss, trainable parameters, peak memory and step time.

The pretrained character-level GPT of the knowledge base (``tokenloom train kb-char --out runs/kb-lm``; 4 layers of
256, 3.2M parameters) is fine-tuned with ``task: sft`` on the question/answer set ``data/kb/format_sft.jsonl``
(default chat template, packed rows of 256 tokens; the last 10% of the conversations validate) three ways, each
run in its own process (``tokenloom train``) with the same data, steps, batch and seed:

* **full**: every weight trains (AdamW, lr ``--full-lr``);
* **LoRA r8, attention**: ``train.lora`` rank 8, alpha 16, on the attention projections only (``*.attn.*_proj``:
  qkv and out, 1.5% of the weights), lr ``--lora-lr`` (adapters usually want a larger rate than full fine-tuning);
* **LoRA r8, attention + MLP**: the default targets (``*.attn.*_proj``, ``*.mlp.fc_*``), 4% of the weights.

Reported per run: the final validation loss (mean cross-entropy over the response tokens, the whole split), its
gap to full fine-tuning, the trainable parameters (count and share), the peak resident memory of the process
(``ru_maxrss``: the runtime, the model and the optimizer state together; at 3.2M parameters the frozen weights'
gradients, AdamW moments and fp32 master copies that adapters save are about 50 MB; the runtime's few hundred MB
dominate) and the mean time per step. Prints a Markdown table and one JSON line; the machine first.

    python benchmarks/exp_lora.py                   # 13.1 minutes on 2 shared CPU cores (AMD EPYC)
    python benchmarks/exp_lora.py --quick           # a smoke run: a tiny model, a few steps
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from pathlib import Path

import torch
from kb_common import KB, REPO, ensure_base, machine_line, markdown_table, pct, train

ATTENTION = ["*.attn.*_proj"]
VARIANTS = {  # name -> train.lora (None: full fine-tuning)
    "full": None,
    "LoRA r8, attention": {"rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": ATTENTION},
    "LoRA r8, attention + MLP": {"rank": 8, "alpha": 16.0, "dropout": 0.0},
}
_COUNTS = re.compile(r"\(([\d.]+)M parameters(?:, ([\d,]+) trainable)?")


def recipe(base: Path, lora: dict | None, args: argparse.Namespace) -> dict:
    lr = args.lora_lr if lora else args.full_lr
    train_section = {"init_from": str(base), "max_steps": args.steps, "batch_size": args.batch_size, "seq_len": 256,
                     "lr": lr, "min_lr": lr / 10, "warmup_steps": max(1, args.steps // 10), "schedule": "cosine",
                     "weight_decay": 0.0, "grad_clip": 1.0, "precision": "auto", "eval_every": 0,
                     "eval_batches": 1000, "checkpoint_every": 0, "seed": args.seed,
                     "log_every": 1 if args.steps < 50 else 10}
    if lora:
        train_section["lora"] = lora
    return {"task": "sft", "model": {"dropout": 0.0},
            "data": {"path": str(KB / "format_sft.jsonl"), "template": "default", "packing": True,
                     "val_fraction": 0.1},
            "train": train_section}


def parameter_counts(log: Path, total: int) -> int:
    """The trainable parameters a run's log reports (all of them when it names no trainable count)."""
    match = _COUNTS.search(log.read_text(errors="replace"))
    return int(match.group(2).replace(",", "")) if match and match.group(2) else total


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=None, help="the pretrained checkpoint (default runs/kb-lm/checkpoint)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "exp-lora", help="work directory")
    parser.add_argument("--quick", action="store_true", help="smoke run: a tiny base model, a few steps")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--full-lr", type=float, default=5e-4)
    parser.add_argument("--lora-lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    args.out = args.out.resolve()  # the training processes run in the repository root
    if args.quick:
        args.steps, args.batch_size = 3, 4
    torch.set_num_threads(1)
    print(machine_line(), flush=True)
    start = time.perf_counter()
    base = ensure_base(args.base, args.quick, args.out)
    from tokenloom.checkpoint import load_model

    total = sum(p.numel() for p in load_model(base)[0].parameters())
    rows: dict[str, dict] = {}
    for i, (name, lora) in enumerate(VARIANTS.items()):
        out = args.out / f"run{i}"
        shutil.rmtree(out, ignore_errors=True)
        run = train(recipe(base, lora, args), out)
        trainable = parameter_counts(out.with_suffix(".log"), total)
        rows[name] = {"val_loss": run.last("val_loss"), "trainable": trainable, "trainable_share": trainable / total,
                      "peak_rss_mb": run.max_rss_mb, "step_seconds": run.step_seconds(), "seconds": run.seconds,
                      "lora": lora}
        print(f"{name}: {json.dumps(rows[name])}", flush=True)
    full = rows["full"]["val_loss"]
    for r in rows.values():
        r["val_loss_gap"] = (r["val_loss"] - full) / full if full else None
    seconds = time.perf_counter() - start

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    table = markdown_table(
        ["fine-tuning", "val loss", "vs full", "trainable parameters", "peak memory (RSS)", "time per step"],
        [[name, fmt(r["val_loss"], ".4f"), "-" if name == "full" else f"{100 * r['val_loss_gap']:+.2f}%",
          f"{r['trainable']:,} ({pct(r['trainable_share'])})", f"{r['peak_rss_mb']:,.0f} MB",
          f"{fmt(r['step_seconds'], '.3f')} s"] for name, r in rows.items()])
    print()
    print(table)
    print(f"\n{total:,} parameters in the model; {args.steps} steps of {args.batch_size} packed rows of 256 tokens "
          f"each; lr {args.full_lr} (full), {args.lora_lr} (LoRA); total {seconds / 60:.1f} min")
    result = {"experiment": "lora", "machine": machine_line(), "quick": args.quick, "seconds": seconds,
              "parameters": total,
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "rows": rows}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

"""Vision throughput: tokenloom ViT / Swin vs Hugging Face ViTForImageClassification / SwinForImageClassification
of the same shape and the same weights (``tokenloom.interop.to_hf``), measured alternately in one run.

* train: forward + cross-entropy + backward + AdamW step on random (B, C, H, W) images, model in train mode
  (dropout 0, so both do the same arithmetic);
* infer: eval mode under ``torch.inference_mode``.

Precisions: ``fp32``; ``bf16`` = float32 weights under ``torch.autocast("cpu", bfloat16)``; ``bf16w`` = both models
cast to bfloat16 (the weights the Trainer's bf16 precision trains; here without its float32 master copy).

images/s = batch / median step time over the timed steps (the median shrugs off bursts of load from other
processes). tokenloom and HF take turns for ``--repeats`` rounds and their steps are pooled. The ratio column is
HF time / tokenloom time (> 1: tokenloom is faster).

    python benchmarks/bench_vision.py                             # both MNIST shapes, fp32
    python benchmarks/bench_vision.py --precision fp32,bf16,bf16w
    python benchmarks/bench_vision.py --shapes swin-mnist --modes train --steps 10 --out vision.json
    python benchmarks/bench_vision.py --modes train --compile tokenloom     # train.compile: true vs HF eager
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from tokenloom.hardware import machine
from tokenloom.interop import to_hf
from tokenloom.models import Swin, SwinConfig, ViT, ViTConfig

SHAPES: dict[str, Callable[[], nn.Module]] = {  # the MNIST recipes' models (28x28, one channel, 10 classes)
    "vit-mnist": lambda: ViT(ViTConfig.from_name("vit-mnist-tiny")),  # patch 4, dim 128, depth 6, 4 heads
    "swin-mnist": lambda: Swin(SwinConfig.from_name("swin-mnist-tiny")),  # patch 2, window 7, depths [2, 2]
}


def autocast(precision: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def logits_fn(model: nn.Module, is_hf: bool) -> Callable[[Tensor], Tensor]:
    return (lambda x: model(pixel_values=x).logits) if is_hf else model


def time_steps(model: nn.Module, is_hf: bool, mode: str, precision: str, batches: list[tuple[Tensor, Tensor]],
               warmup: int, compiled: bool = False) -> list[float]:
    """Seconds of each step after ``warmup`` (train: forward + backward + AdamW step; infer: forward);
    ``compiled``: the model through ``torch.compile`` (compiled during the first, untimed, step)."""
    if precision == "bf16w":
        model.to(torch.bfloat16)
        batches = [(x.to(torch.bfloat16), y) for x, y in batches]
    forward = logits_fn(torch.compile(model) if compiled else model, is_hf)
    seconds = []
    if mode == "train":
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for i, (x, y) in enumerate(batches):
            start = time.perf_counter()
            with autocast(precision):
                loss = F.cross_entropy(forward(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= warmup:
                seconds.append(time.perf_counter() - start)
    else:
        model.eval()
        with torch.inference_mode():
            for i, (x, _) in enumerate(batches):
                start = time.perf_counter()
                with autocast(precision):
                    forward(x)
                if i >= warmup:
                    seconds.append(time.perf_counter() - start)
    return seconds


def bench(shape: str, mode: str, precision: str, batch: int, steps: int, warmup: int, repeats: int,
          hf_attn: str | None, seed: int, compile_: str = "none") -> dict:
    torch.manual_seed(seed)
    base = SHAPES[shape]()
    c = base.config
    size = (c.image_size, c.image_size) if isinstance(c.image_size, int) else c.image_size
    gen = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(batch, c.in_channels, *size, generator=gen),
                torch.randint(0, c.num_classes, (batch,), generator=gen)) for _ in range(warmup + steps)]
    with torch.no_grad():  # same weights, same function: check before timing
        hf = to_hf(base.eval(), attn_implementation=hf_attn).eval()
        diff = (base(batches[0][0]) - hf(pixel_values=batches[0][0]).logits).abs().max().item()
    times: dict[str, list[float]] = {"tokenloom": [], "HF": []}
    for _ in range(repeats):
        for label in ("tokenloom", "HF"):
            model = copy.deepcopy(base)
            if label == "HF":
                model = to_hf(model, attn_implementation=hf_attn)
            compiled = compile_ == "both" or (compile_ == "tokenloom" and label == "tokenloom")
            times[label] += time_steps(model, label == "HF", mode, precision, batches, warmup, compiled)
            del model
    ours, theirs = statistics.median(times["tokenloom"]), statistics.median(times["HF"])
    row = dict(shape=shape, mode=mode, precision=precision, compiled=compile_, batch=batch,
               tokenloom_images_per_s=batch / ours,
               hf_images_per_s=batch / theirs, hf_over_tokenloom=theirs / ours, max_abs_logit_diff=diff,
               steps=steps, repeats=repeats, params=sum(p.numel() for p in base.parameters()))
    print(f"  {shape:<11} {mode:<6} {precision:<5} compiled: {compile_:<9} "
          f"tokenloom {row['tokenloom_images_per_s']:8.0f} img/s   "
          f"HF {row['hf_images_per_s']:8.0f} img/s   {row['hf_over_tokenloom']:.2f}x", file=sys.stderr, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--modes", default="train,infer")
    parser.add_argument("--precision", default="fp32", help="comma-separated: fp32, bf16 (autocast), bf16w")
    parser.add_argument("--batch-size", type=int, default=128, help="training batch, as in the recipes (infer: 4x)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="rounds in which tokenloom and HF take turns")
    parser.add_argument("--hf-attn", default=None, help="HF attn_implementation (default: transformers' own, sdpa)")
    parser.add_argument("--compile", default="none", choices=["none", "tokenloom", "both"],
                        help="torch.compile tokenloom's model (what train.compile does) or both models")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the rows as JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for shape in args.shapes.split(","):
        for mode in args.modes.split(","):
            for precision in args.precision.split(","):
                batch = args.batch_size * (4 if mode == "infer" else 1)
                rows.append(bench(shape, mode, precision, batch, args.steps, args.warmup, args.repeats, args.hf_attn,
                                  args.seed, args.compile))
    print(f"{machine().describe()}, compiled: {args.compile}")
    print(f"{'shape':<11} {'mode':<6} {'prec':<5} {'batch':>5} {'tokenloom img/s':>16} {'HF img/s':>9} "
          f"{'HF/tokenloom':>13} {'max |dlogit|':>13}")
    for r in rows:
        print(f"{r['shape']:<11} {r['mode']:<6} {r['precision']:<5} {r['batch']:>5} "
              f"{r['tokenloom_images_per_s']:>16.0f} "
              f"{r['hf_images_per_s']:>9.0f} {r['hf_over_tokenloom']:>12.2f}x {r['max_abs_logit_diff']:>13.1e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(machine=machine().as_dict(), date=time.strftime("%Y-%m-%d"), rows=rows), f, indent=2)


if __name__ == "__main__":
    main()

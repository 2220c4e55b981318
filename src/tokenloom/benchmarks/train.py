"""Training throughput: tokenloom GPT vs Hugging Face GPT2LMHeadModel of the same shape and weights.

Each variant trains a fresh copy of the same initial weights with fused AdamW(lr=3e-4) -- tokenloom's Trainer
and Hugging Face Trainer's default (``adamw_torch_fused``) alike -- on the same random token batches. The loss
is computed the same way for both models (logits, then ``F.cross_entropy``), so what differs is the model
forward/backward only.
tokens/s = batch * context / median step time over the timed steps (the median shrugs off bursts of
load from other processes; the mean is printed too). Variants take turns across ``--repeats``.

    tokenloom bench train                          # small and medium shapes
    tokenloom bench train --shapes small --timed-steps 50 --out train.json
    tokenloom bench train --loss-curve 500         # bf16 vs fp32 loss on Tiny Shakespeare
    tokenloom bench train --preset gpt-6l-384 --dtype bf16 --compile   # with torch.compile variants

Every row also gets its MFU: tokens/s x training FLOPs per token (6 N + 12 L C T) / the matmul peak of its
dtype (fp32 for fp32, bf16 for the bf16 variants) measured at the start of the run.

``--loss-curve N`` trains tokenloom in fp32 and in bf16 (float32 master weights) from the same init on the same
batches of real char-level text (medium shape) and prints the validation loss at N/4, N/2 and N.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from tokenloom.benchmarks import report_load_and_save
from tokenloom.devices import DEVICE_HELP, choose_device, default_device, peak_memory, synchronize
from tokenloom.hardware import machine
from tokenloom.interop import to_hf
from tokenloom.models.gpt import GPT, GPTConfig
from tokenloom.training.compile import CompiledForward
from tokenloom.training.precision import MasterWeights

SHAPES: dict[str, dict] = {
    "small": dict(num_layers=4, embed_dim=128, num_heads=4, max_seq_len=64, batch_size=12, timed_steps=20),
    "medium": dict(num_layers=6, embed_dim=384, num_heads=6, max_seq_len=256, batch_size=8, timed_steps=10),
}
PRESETS = {"gpt-4l-128": "small", "gpt-6l-384": "medium"}  # --preset names of the shapes
VOCAB = 65
DEFAULT_DATA = Path("data/tinyshakespeare/input.txt")  # relative to the working directory (the repository)


def model_config(shape: str, vocab_size: int = VOCAB) -> GPTConfig:
    s = SHAPES[shape]
    return GPTConfig(vocab_size=vocab_size, num_layers=s["num_layers"], num_heads=s["num_heads"],
                     embed_dim=s["embed_dim"], max_seq_len=s["max_seq_len"], dropout=0.0)


def autocast(bf16: bool, device_type: str = "cpu") -> contextlib.AbstractContextManager:
    return torch.autocast(device_type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def make_step(model: nn.Module, is_hf: bool, precision: str, lr: float = 3e-4,
              compiled: bool = False) -> Callable[[Tensor, Tensor], Tensor]:
    """One training step in ``precision``: ``fp32``, ``bf16-autocast`` (torch.autocast), or ``bf16``
    (tokenloom's default: a bf16 model with float32 master weights, as the Trainer does it); ``compiled``: the
    forward through the Trainer's ``train.compile`` wrapper (eager, with a warning, where it cannot compile)."""
    master = MasterWeights(model) if precision == "bf16" else None
    # fused AdamW on both sides: what tokenloom's Trainer runs and Hugging Face Trainer's default optimizer
    # (``adamw_torch_fused`` with torch >= 2.8)
    opt = torch.optim.AdamW(master.masters if master else model.parameters(), lr=lr, fused=True)
    if master:
        master.to_low()
    forward = logits_fn(CompiledForward(model) if compiled else model, is_hf)

    device_type = next(model.parameters()).device.type

    def step(x: Tensor, y: Tensor) -> Tensor:
        with autocast(precision == "bf16-autocast", device_type):
            logits = forward(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        if master:
            master.accumulate_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if master:
            master.copy_to_model()
        return loss

    step.master = master  # type: ignore[attr-defined]
    return step


def logits_fn(model: nn.Module, is_hf: bool) -> Callable[[Tensor], Tensor]:
    if is_hf:
        return lambda ids: model(input_ids=ids, use_cache=False).logits
    return model


def train_steps(model: nn.Module, is_hf: bool, precision: str, batches: list[tuple[Tensor, Tensor]],
                warmup: int, compiled: bool = False) -> tuple[list[float], float]:
    """Train on ``batches`` (on the model's device); return (seconds of each step after ``warmup``, last loss). On an
    accelerator the clock is read after synchronising."""
    model.train()
    device = next(model.parameters()).device
    train_step = make_step(model, is_hf, precision, compiled=compiled)
    seconds = []
    loss = torch.zeros(())
    for step, (x, y) in enumerate(batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        synchronize(device)
        start = time.perf_counter()
        loss = train_step(x, y)
        synchronize(device)
        if step >= warmup:
            seconds.append(time.perf_counter() - start)
    return seconds, float(loss.detach())


def random_batches(n: int, batch_size: int, seq_len: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=gen)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


VARIANTS = [  # (label, is_hf, precision)
    ("HF fp32", True, "fp32"),
    ("tokenloom fp32", False, "fp32"),
    ("tokenloom bf16", False, "bf16"),
    ("tokenloom bf16-autocast", False, "bf16-autocast"),
    ("HF bf16-autocast", True, "bf16-autocast"),
]


def variants(dtype: str, compiled: bool) -> list[tuple[str, bool, str, bool]]:
    """(label, is_hf, precision, compiled) for ``--dtype`` fp32 | bf16 | all (HF fp32, the reference, always)
    and ``--compile`` (tokenloom compiled variants added)."""
    chosen = [(label, hf, precision, False) for label, hf, precision in VARIANTS
              if label == "HF fp32" or dtype == "all" or precision.startswith(dtype)]
    if compiled:
        chosen += [(f"{label} compiled", hf, precision, True) for label, hf, precision, _ in chosen
                   if not hf and precision != "bf16-autocast"]
    return chosen


def flops_per_token(model: GPT) -> float:
    """Training FLOPs per token (forward + backward): 6 N for the matrix products of N parameters plus
    12 L C T for attention's scores and weighted sums (Chowdhery et al. 2022, appendix B)."""
    from ..models.sizes import training_flops_per_token

    return training_flops_per_token(model.config, sum(p.numel() for p in model.parameters()))


def bench_shape(shape: str, warmup: int, timed: int, repeats: int, seed: int, dtype: str = "all",
                compiled: bool = False, peaks: dict[str, float] | None = None,
                device: torch.device | str = "cpu") -> list[dict]:
    """Every variant from the same initial weights on the same batches, on ``device``. tokens/s comes from the
    median step time (robust to bursts of load from other processes); the mean is kept alongside. With ``peaks``
    (matmul FLOP/s per dtype, measured in this run) each row gets its model FLOPs utilisation; on CUDA each row
    gets its peak memory."""
    device = torch.device(device)
    memory: dict[str, int] = {}
    s = SHAPES[shape]
    torch.manual_seed(seed)
    base = GPT(model_config(shape))
    batches = random_batches(warmup + timed, s["batch_size"], s["max_seq_len"], seed)
    step_tokens = s["batch_size"] * s["max_seq_len"]
    chosen = variants(dtype, compiled)
    steps: dict[str, list[float]] = {label: [] for label, _, _, _ in chosen}
    losses: dict[str, float] = {}
    for _ in range(repeats):  # variants take turns, so a burst of load from elsewhere hits them alike
        for label, is_hf, precision, compile_ in chosen:
            model = (to_hf(copy.deepcopy(base)) if is_hf else copy.deepcopy(base)).to(device)
            peak_memory(device, reset=True)
            seconds, losses[label] = train_steps(model, is_hf, precision, batches, warmup, compile_)
            if (peak := peak_memory(device)) is not None:
                memory[label] = max(memory.get(label, 0), peak)
            steps[label] += seconds
            del model
            print(f"  {shape:<7} {label:<15} {step_tokens / statistics.median(seconds):>10.0f} tok/s "
                  f"(median step)", file=sys.stderr, flush=True)
    rows = []
    for label, _, precision, _ in chosen:
        median, mean = statistics.median(steps[label]), statistics.fmean(steps[label])
        rows.append(dict(shape=shape, variant=label, tokens_per_s=step_tokens / median,
                         tokens_per_s_mean=step_tokens / mean, ms_per_step_median=1000 * median,
                         ms_per_step_mean=1000 * mean, timed_steps=timed, repeats=repeats, warmup_steps=warmup,
                         batch_size=s["batch_size"], seq_len=s["max_seq_len"], last_loss=losses[label],
                         device=str(device)))
        if label in memory:
            rows[-1]["peak_memory_mb"] = memory[label] / 2**20
        if peaks:
            peak = peaks["fp32" if precision == "fp32" else "bf16"]
            rows[-1]["mfu"] = rows[-1]["tokens_per_s"] * flops_per_token(base) / peak
    ref = next(r["tokens_per_s"] for r in rows if r["variant"] == "HF fp32")
    for r in rows:
        r["vs_hf_fp32"] = r["tokens_per_s"] / ref
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'shape':<8} {'variant':<33} {'tokens/s':>10} {'vs HF fp32':>11} {'MFU':>6} {'ms/step':>8} "
          f"{'(mean)':>8} {'last loss':>10}")
    for r in rows:
        mfu = f"{100 * r['mfu']:5.1f}%" if "mfu" in r else f"{'-':>6}"
        memory = f"  peak {r['peak_memory_mb']:,.0f} MB" if "peak_memory_mb" in r else ""
        print(f"{r['shape']:<8} {r['variant']:<33} {r['tokens_per_s']:>10.0f} {r['vs_hf_fp32']:>10.2f}x {mfu} "
              f"{r['ms_per_step_median']:>8.1f} {r['ms_per_step_mean']:>8.1f} {r['last_loss']:>10.4f}{memory}")


# ---------------------------------------------------------------- loss curve on real text

def load_chars(path: Path) -> tuple[Tensor, int]:
    text = path.read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return torch.tensor([index[c] for c in text], dtype=torch.long), len(chars)


def windows(data: Tensor, starts: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
    rows = torch.stack([data[i: i + seq_len + 1] for i in starts.tolist()])  # (B, T + 1)
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def eval_loss(model: GPT, val: list[tuple[Tensor, Tensor]], bf16: bool) -> float:
    model.eval()
    total = 0.0
    for x, y in val:
        with autocast(bf16):
            logits = model(x)
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)))
    model.train()
    return total / len(val)


def loss_curve(steps: int, data_path: Path, seed: int) -> dict:
    data, vocab = load_chars(data_path)
    split = int(0.9 * len(data))
    train, val_data = data[:split], data[split:]
    s = SHAPES["medium"]
    B, T = s["batch_size"], s["max_seq_len"]
    gen = torch.Generator().manual_seed(seed)
    train_starts = [torch.randint(0, len(train) - T - 1, (B,), generator=gen) for _ in range(steps)]
    val_gen = torch.Generator().manual_seed(seed + 1)
    val = [windows(val_data, torch.randint(0, len(val_data) - T - 1, (B,), generator=val_gen), T)
           for _ in range(8)]
    checkpoints = sorted({max(1, steps // 4), max(1, steps // 2), steps})
    torch.manual_seed(seed)
    init = GPT(model_config("medium", vocab_size=vocab))
    result: dict = {"steps": steps, "checkpoints": checkpoints, "runs": {}}
    for label in ("fp32", "bf16"):
        model = copy.deepcopy(init)
        model.train()
        train_step = make_step(model, False, label)
        curve = []
        train_seconds = 0.0
        for step in range(1, steps + 1):
            x, y = windows(train, train_starts[step - 1], T)
            start = time.perf_counter()
            loss = train_step(x, y)
            train_seconds += time.perf_counter() - start
            if step in checkpoints:
                master = train_step.master
                if master:
                    master.to_fp32()  # evaluate the float32 master weights
                point = dict(step=step, train_loss=float(loss.detach()),
                             val_loss_fp32=eval_loss(model, val, False),
                             val_loss_bf16=eval_loss(model, val, True))
                if master:
                    master.to_low()
                curve.append(point)
                print(f"  {label} step {step}: val loss (fp32 eval) {point['val_loss_fp32']:.4f}",
                      file=sys.stderr, flush=True)
        result["runs"][label] = dict(curve=curve, seconds=train_seconds)
    print(f"\nloss curve: medium shape, Tiny Shakespeare chars (vocab {vocab}), batch {B} x {T}, "
          f"AdamW lr 3e-4, {steps} steps; val = 8 fixed batches from the last 10% of the text")
    print(f"{'step':>6} {'fp32 val':>9} {'bf16 val':>9} {'|diff|':>7} {'bf16 val (bf16 eval)':>21}")
    for a, b in zip(result["runs"]["fp32"]["curve"], result["runs"]["bf16"]["curve"], strict=True):
        diff = abs(a["val_loss_fp32"] - b["val_loss_fp32"])
        print(f"{a['step']:>6} {a['val_loss_fp32']:>9.4f} {b['val_loss_fp32']:>9.4f} {diff:>7.4f} "
              f"{b['val_loss_bf16']:>21.4f}")
    for label, run in result["runs"].items():
        print(f"{label} training: {run['seconds']:.1f} s ({1000 * run['seconds'] / steps:.0f} ms/step, "
              f"evaluation excluded)")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tokenloom bench train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="small,medium", help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS),
                        help="one shape by its preset name (gpt-4l-128 = small, gpt-6l-384 = medium)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "all"], default="all",
                        help="the tokenloom variants to time (HF fp32, the reference, always runs)")
    parser.add_argument("--compile", action="store_true",
                        help="add tokenloom variants whose forward runs through torch.compile (train.compile)")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--timed-steps", type=int, default=None,
                        help="timed steps per variant (default: 20 for small, 10 for medium)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each variant this many times (taking turns) and pool the timed steps")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch.set_num_threads (default: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loss-curve", type=int, default=0, metavar="N",
                        help="instead of timing, train tokenloom fp32 and bf16 for N steps on real text")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="text file for --loss-curve")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--device", default=default_device(), help=DEVICE_HELP)
    args = parser.parse_args(argv)
    choice = choose_device(args.device)
    device = choice.device
    print(choice.describe())
    torch.set_num_threads(args.threads)
    info = dict(torch=torch.__version__, threads=args.threads, date=time.strftime("%Y-%m-%d"),
                machine=machine().as_dict())
    print(machine().describe())
    load_before = os.getloadavg()[0]
    if args.loss_curve:
        results: dict = dict(info, loss_curve=loss_curve(args.loss_curve, args.data, args.seed))
    else:
        rows = []
        shapes = [PRESETS[args.preset]] if args.preset else [shape.strip() for shape in args.shapes.split(",")]
        for shape in shapes:
            if shape not in SHAPES:
                parser.error(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        from ..hardware import matmul_peak

        peaks = {"fp32": matmul_peak(torch.float32, device=device), "bf16": matmul_peak(torch.bfloat16, device=device)}
        print(f"matmul peak measured now: fp32 {peaks['fp32'] / 1e9:,.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:,.0f} "
              "GFLOP/s (MFU = tokens/s x training FLOPs per token / the peak of the variant's matmul dtype)")
        info["matmul_peak"] = peaks
        for shape in shapes:
            timed = args.timed_steps or SHAPES[shape]["timed_steps"]
            rows += bench_shape(shape, args.warmup_steps, timed, args.repeats, args.seed, args.dtype, args.compile,
                                peaks, device)
        print()
        print_table(rows)
        results = dict(info, train=rows)
    report_load_and_save(results, load_before, args.threads, args.out)


if __name__ == "__main__":
    main()

"""Adaptive Computation Time on Graves' parity task (Graves 2016, section 3.1; issue 29).

The input is a vector of 64 entries: the first n (n uniform in [1, L]) are +1 or -1 at random, the rest 0; the
target is the parity of the number of +1s. The network sees the vector once (a sequence of length 1) and ponders:
a tanh RNN cell of 128 units reads [vector, first-step flag] at every step (the flag is 1 at step 1 only, as in
Graves), a logistic unit reads the state. Three networks of the same cell and size (25,089 weights; 25,218 with
ACT's halting unit):

* ``ACT``: up to M steps (``--max-steps``, 10), halting by :func:`tokenloom.nn.act.act_step` (halting unit
  :class:`~tokenloom.nn.act.HaltingUnit`, initial bias 1, eps 0.01); the output reads the halting-weighted sum of
  the states; the loss adds tau * mean(N + R) (tau 1e-3).
* ``1 step``: Graves' baseline, exactly one step (a one-hidden-layer network).
* ``fixed M``: exactly M steps (ACT's most), the output reads the last state: fixed depth of the same size.

One model of each kind per maximum length L (``--lengths``, default 16, 32, 64), trained on n uniform in [1, L]
with the same batches for the three: Adam, batches of 128, ``--steps`` updates (12,000), cosine decay of the
learning rate to 1/20, gradient clipping 1.0. Learning rate 1e-2 for ACT and the 1-step model, 3e-3 for the fixed-M
one: of the two tried in short trials at L = 16 and 32, the better one for each (the M-step tanh network stayed at
chance at L = 32 with 1e-2). Evaluated on ``--eval-per-n`` (256) fresh vectors for each n in [1, L]; "accuracy" is
the mean over n (each n weighs the same), and the table by n shows where each model fails and how many steps ACT
takes. Seeded: the same command gives the same numbers (times aside).

    python benchmarks/exp_parity.py                                  # L = 16, 32, 64
    python benchmarks/exp_parity.py --lengths 8,16 --steps 3000 --json parity.json --plot parity.png
    python benchmarks/exp_parity.py --minutes 30                     # also stop each training at its share
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from tokenloom.hardware import machine
from tokenloom.nn.act import HaltingUnit, act_step

BITS = 64  # Graves' vector size
KINDS = ("act", "one", "fixed")
LABELS = {"act": "ACT", "one": "1 step", "fixed": "fixed M"}
BUCKETS = ((1, 8), (9, 16), (17, 24), (25, 32), (33, 48), (49, 64))  # n ranges of the table by n


def parity_data(batch: int, max_n: int, gen: torch.Generator, bits: int = BITS,
                n: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``batch`` parity examples: x (batch, bits) with its first n entries +-1 at random and the rest 0, n uniform
    in [1, max_n] (or exactly ``n``); y (batch,) 1.0 where the number of +1s is odd; n (batch,)."""
    count = torch.randint(1, max_n + 1, (batch,), generator=gen) if n is None else torch.full((batch,), n)
    signs = torch.randint(0, 2, (batch, bits), generator=gen).float() * 2 - 1
    x = signs * (torch.arange(bits)[None] < count[:, None])  # (batch, bits)
    y = ((x > 0).sum(dim=1) % 2).float()
    return x, y, count


class PonderNet(nn.Module):
    """A recurrent cell that reads the same input at every step: ``kind`` "act" (halting by ACT, at most
    ``max_steps``), "one" (1 step) or "fixed" (``max_steps`` steps)."""

    def __init__(self, kind: str, bits: int = BITS, hidden: int = 128, max_steps: int = 10, cell: str = "rnn",
                 halting_bias: float = 1.0, eps: float = 0.01) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kind, self.eps, self.cell_type = kind, eps, cell
        self.steps = 1 if kind == "one" else max_steps
        self.cell = nn.RNNCell(bits + 1, hidden) if cell == "rnn" else nn.LSTMCell(bits + 1, hidden)
        self.halting = HaltingUnit(hidden, bias=halting_bias) if kind == "act" else None
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, bits) -> (B,) parity logits, (B,) ponder counts N + R and (B,) steps taken N (both the fixed step
        count without ACT)."""
        B = x.shape[0]
        h = x.new_zeros(B, self.cell.hidden_size)  # (B, H)
        c = torch.zeros_like(h)
        first = torch.cat([x, x.new_ones(B, 1)], dim=1)  # (B, bits + 1): the first-step flag set
        later = torch.cat([x, x.new_zeros(B, 1)], dim=1)
        acc = None
        for n in range(self.steps):
            inputs = first if n == 0 else later
            if self.cell_type == "rnn":
                h = self.cell(inputs, h)
            else:
                h, c = self.cell(inputs, (h, c))
            if self.halting is not None:
                acc = act_step(acc, self.halting(h), h, self.eps, last=n == self.steps - 1)
                if not bool(acc.running.any()):  # every example halted: later states have weight 0
                    break
        if acc is None:
            fixed = x.new_full((B,), float(self.steps))
            return self.head(h).squeeze(-1), fixed, fixed
        return self.head(acc.output).squeeze(-1), acc.ponder, acc.steps


def train(model: PonderNet, max_n: int, steps: int, *, batch: int = 128, lr: float = 1e-3, tau: float = 1e-3,
          seed: int = 0, seconds: float | None = None) -> dict:
    """Adam on fresh batches (the same ones for every model given the same seed) for ``steps`` updates or until
    ``seconds`` of wall time; returns the steps done, the time and the last 100 steps' training accuracy."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    # cosine decay from lr to lr / 20 over the steps (without it the accuracy plateaus a few points lower)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: 0.05 + 0.475 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    model.train()
    start, cpu = time.perf_counter(), time.process_time()
    correct = []
    done = 0
    while done < steps:
        done += 1
        x, y, _ = parity_data(batch, max_n, gen)
        logits, ponder, _ = model(x)
        loss = F.binary_cross_entropy_with_logits(logits, y)
        if model.kind == "act":
            loss = loss + tau * ponder.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        correct.append(((logits > 0).float() == y).float().mean().item())
        if seconds is not None and time.perf_counter() - start > seconds:
            break
    return {"updates": done, "seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
            "train_accuracy": sum(correct[-100:]) / len(correct[-100:])}


@torch.no_grad()
def evaluate(model: PonderNet, max_n: int, per_n: int = 256, seed: int = 1234) -> dict:
    """Accuracy and mean ponder count for each n in [1, max_n] on ``per_n`` fresh vectors each; ``accuracy`` is
    the mean over n."""
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    accuracy, ponder, steps = {}, {}, {}
    for n in range(1, max_n + 1):
        x, y, _ = parity_data(per_n, max_n, gen, n=n)
        logits, ponder_n, steps_n = model(x)
        accuracy[n] = ((logits > 0).float() == y).float().mean().item()
        ponder[n], steps[n] = ponder_n.mean().item(), steps_n.mean().item()
    return {"accuracy": sum(accuracy.values()) / max_n, "ponder": sum(ponder.values()) / max_n,
            "steps": sum(steps.values()) / max_n, "accuracy_per_n": accuracy, "ponder_per_n": ponder,
            "steps_per_n": steps}


def run(lengths: list[int], steps: int, *, max_steps: int = 10, hidden: int = 128, cell: str = "rnn",
        tau: float = 1e-3, lr: float = 1e-2, lr_fixed: float = 3e-3, batch: int = 128, halting_bias: float = 1.0,
        eval_per_n: int = 256, seed: int = 0, minutes: float | None = None, log=print) -> list[dict]:
    """Train and evaluate the three kinds at every maximum length; one row per length."""
    share = None if minutes is None else 60.0 * minutes / (len(lengths) * len(KINDS))
    rows = []
    for max_n in lengths:
        row = {"length": max_n}
        for kind in KINDS:
            torch.manual_seed(seed)
            model = PonderNet(kind, hidden=hidden, max_steps=max_steps, cell=cell, halting_bias=halting_bias)
            fit = train(model, max_n, steps, batch=batch, lr=lr_fixed if kind == "fixed" else lr, tau=tau,
                        seed=seed + max_n, seconds=share)
            result = evaluate(model, max_n, eval_per_n, seed=10_000 + max_n)
            row[kind] = {**fit, **result, "parameters": sum(p.numel() for p in model.parameters())}
            log(f"  L={max_n:>2} {LABELS[kind]:<7}: accuracy {result['accuracy']:.3f}, steps N {result['steps']:.2f}"
                f" ({fit['updates']} updates, {fit['seconds']:.0f} s, {fit['cpu_seconds']:.0f} CPU s)", flush=True)
        rows.append(row)
    return rows


def bucket_mean(per_n: dict, lo: int, hi: int) -> float | None:
    """The mean of ``per_n`` (n -> value) over the n in [lo, hi] (None: no such n)."""
    values = [v for n, v in per_n.items() if lo <= int(n) <= hi]
    return sum(values) / len(values) if values else None


def tables(rows: list[dict], max_steps: int) -> str:
    """The summary table (one row per L) and the table by n (per L: the three accuracies and ACT's steps N)."""
    lines = ["| max length L | ACT accuracy | 1 step accuracy | fixed M accuracy | ACT mean steps N | "
             "ACT mean N + R | train CPU s ACT / 1 step / fixed M |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['length']} | {r['act']['accuracy']:.3f} | {r['one']['accuracy']:.3f} | "
                     f"{r['fixed']['accuracy']:.3f} | {r['act']['steps']:.2f} | {r['act']['ponder']:.2f} | "
                     + " / ".join(f"{r[k]['cpu_seconds']:.0f}" for k in KINDS) + " |")
    buckets = [(lo, hi) for lo, hi in BUCKETS if lo <= max(r["length"] for r in rows)]
    lines += ["", f"By n, the number of nonzero entries (accuracy; ACT's mean steps N, M = {max_steps}):", "",
              "| L | | " + " | ".join(f"n {lo}-{hi}" for lo, hi in buckets) + " |",
              "|---:|---|" + "---:|" * len(buckets)]
    for r in rows:
        rows_by_n = [(f"{LABELS[k]} accuracy", r[k]["accuracy_per_n"], 3) for k in KINDS]
        for name, per_n, digits in rows_by_n + [("ACT steps N", r["act"]["steps_per_n"], 2)]:
            cells = [bucket_mean(per_n, lo, hi) for lo, hi in buckets]
            lines.append(f"| {r['length']} | {name} | "
                         + " | ".join("" if c is None else f"{c:.{digits}f}" for c in cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    from tokenloom.cli.plotting import pyplot

    plt = pyplot("parity plot")
    if plt is None:
        return
    fig, (ax_acc, ax_n, ax_ponder) = plt.subplots(1, 3, figsize=(14, 3.8))
    lengths = [r["length"] for r in rows]
    colors = dict(zip(KINDS, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    dashes = ("-", "--", ":", "-.")
    for kind, marker in zip(KINDS, "os^", strict=True):
        ax_acc.plot(lengths, [r[kind]["accuracy"] for r in rows], marker=marker, color=colors[kind],
                    label=LABELS[kind])
        for r, dash in zip(rows, dashes * len(rows), strict=False):
            per_n = r[kind]["accuracy_per_n"]
            ax_n.plot([int(n) for n in per_n], list(per_n.values()), dash, color=colors[kind], lw=1,
                      label=f"{LABELS[kind]}, L = {r['length']}")
    ax_acc.set(xlabel="max length L (n uniform in [1, L])", ylabel="accuracy (mean over n)",
               ylim=(0.4, 1.02), title="parity accuracy vs L")
    ax_acc.set_xscale("log", base=2)
    ax_acc.minorticks_off()
    ax_acc.set_xticks(lengths, [str(n) for n in lengths])
    ax_n.set(xlabel="n (nonzero entries)", ylabel="accuracy", ylim=(0.4, 1.02), title="accuracy vs n")
    ax_acc.legend()
    ax_n.legend(fontsize=6, ncol=2)
    for r, dash in zip(rows, dashes * len(rows), strict=False):
        per_n = r["act"]["steps_per_n"]
        ax_ponder.plot([int(n) for n in per_n], list(per_n.values()), dash, color=colors["act"],
                       label=f"ACT trained on L = {r['length']}")
    ax_ponder.set(xlabel="n (nonzero entries)", ylabel="mean ponder steps N", title="ACT ponder steps vs n")
    ax_ponder.legend(fontsize=8)
    for ax in (ax_acc, ax_n, ax_ponder):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="16,32,64", help="comma-separated maximum lengths L (each <= 64)")
    parser.add_argument("--steps", type=int, default=12000, help="training updates per model")
    parser.add_argument("--minutes", type=float, default=None,
                        help="wall-time cap for all trainings together, shared equally (default: none, --steps)")
    parser.add_argument("--max-steps", type=int, default=10, help="M: ACT's most ponder steps and the fixed depth")
    parser.add_argument("--tau", type=float, default=1e-3, help="ponder cost")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate for ACT and the 1-step model")
    parser.add_argument("--lr-fixed", type=float, default=3e-3, help="Adam's learning rate for the fixed-M model")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--cell", choices=("rnn", "lstm"), default="rnn")
    parser.add_argument("--halting-bias", type=float, default=1.0)
    parser.add_argument("--eval-per-n", type=int, default=256, help="test vectors for each n")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="write a PNG here: accuracy vs L, ACT ponder vs n")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if any(not 1 <= n <= BITS for n in lengths):
        parser.error(f"--lengths must lie in [1, {BITS}], got {args.lengths}")
    torch.set_num_threads(args.threads)
    print(machine().describe())
    settings = {k: getattr(args, k) for k in ("steps", "minutes", "max_steps", "tau", "lr", "lr_fixed", "batch",
                                                "hidden", "cell", "halting_bias", "eval_per_n", "seed")}
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    start, cpu = time.perf_counter(), time.process_time()
    rows = run(lengths, args.steps, max_steps=args.max_steps, hidden=args.hidden, cell=args.cell, tau=args.tau,
               lr=args.lr, lr_fixed=args.lr_fixed, batch=args.batch, halting_bias=args.halting_bias,
               eval_per_n=args.eval_per_n, seed=args.seed, minutes=args.minutes)
    total, total_cpu = time.perf_counter() - start, time.process_time() - cpu
    print()
    print(tables(rows, args.max_steps))
    print("\nparameters: " + ", ".join(f"{LABELS[k]} {rows[0][k]['parameters']:,}" for k in KINDS)
          + f"; total time {total / 60:.1f} min ({total_cpu / 60:.1f} CPU min)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine().as_dict(), "settings": settings, "seconds": total,
                       "cpu_seconds": total_cpu, "rows": rows}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()

"""A long-range dependency: recalling a key over a gap of filler tokens, LSTM vs Transformer (issue 29).

A sequence is ``[key, f_1, ..., f_g, QUERY]``: one of K key tokens (16), g filler tokens drawn at random from a
separate filler alphabet (16 tokens), then the query marker; at the query the model must output the key (chance =
1/K). Vocabulary: K keys + 16 fillers + the marker. Gaps g in ``--gaps`` (default 8, 16, ..., 512).

Two models of about the same size: tokenloom's ``GPT`` (family gpt, causal; 2 layers x 80, 4 heads, RoPE positions,
so no position table to learn for the long, rare gaps; max_seq_len = the longest gap + 2; 158,480 parameters) and
tokenloom's ``RNNLM`` (family rnn, one LSTM layer of 136, untied output layer; 158,032 parameters). Untied: with
``RNNConfig``'s default tied embeddings (uniform +-0.1) the LSTM stayed at chance for 400 updates even on gap 8
alone, where the untied one had started to learn.

Both train for the same number of updates (``--steps``, 1,500) on the same batches of ``--batch`` (32) sequences
of one gap each; the loss is the cross-entropy at the query position only; AdamW, lr ``--lr`` (2e-3), warmup 100
updates, cosine decay to 10%, gradient clipping 1.0. A curriculum (``--curriculum`` 0.5): the gap is drawn
uniformly from the gaps opened so far, shortest first, one more joining every ``0.5 * steps / 7`` updates (gap 512
from 43% of the updates on). Without it the LSTM learned next to nothing in 1,500 updates (10-15% at every gap);
the GPT needs none. Accuracy per gap on ``--eval`` (512) fresh sequences each (seeded).

    python benchmarks/exp_recall.py                               # gaps 8 .. 512
    python benchmarks/exp_recall.py --steps 300 --gaps 8,64,512 --json recall.json --plot recall.png
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
from tokenloom.models.gpt import GPT, GPTConfig
from tokenloom.models.rnn import RNNLM, RNNConfig

KEYS = 16  # key tokens 0 .. KEYS - 1
FILLERS = 16  # filler tokens KEYS .. KEYS + FILLERS - 1
QUERY = KEYS + FILLERS  # the query marker
VOCAB = KEYS + FILLERS + 1


def recall_data(batch: int, gap: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """``batch`` sequences (batch, gap + 2): a key, ``gap`` random fillers, the query marker; and the keys (batch,)
    the model must output at the last position."""
    keys = torch.randint(0, KEYS, (batch,), generator=gen)
    fillers = torch.randint(KEYS, KEYS + FILLERS, (batch, gap), generator=gen)
    ids = torch.cat([keys[:, None], fillers, torch.full((batch, 1), QUERY)], dim=1)  # (batch, gap + 2)
    return ids, keys


def create_models(max_gap: int, gpt_dim: int = 80, lstm_dim: int = 136) -> dict[str, nn.Module]:
    """The two models, seeded, sized to about the same parameter count."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=VOCAB, num_layers=2, num_heads=4, embed_dim=gpt_dim, max_seq_len=max_gap + 2,
                        position="rope", dropout=0.0))
    torch.manual_seed(0)
    lstm = RNNLM(RNNConfig(vocab_size=VOCAB, cell="lstm", num_layers=1, embed_dim=lstm_dim, max_seq_len=max_gap + 2,
                           tie_embeddings=False))
    return {"GPT": gpt, "LSTM": lstm}


def parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def curriculum_gaps(gaps: list[int], step: int, steps: int, fraction: float) -> list[int]:
    """The gaps a batch of update ``step`` (0-based) of ``steps`` draws from: all of them without a curriculum
    (``fraction`` 0); else the shortest ones first, the k-th shortest (k = 0, 1, ...) joining at update
    ``k * fraction * steps / len(gaps)``."""
    ordered = sorted(gaps)
    if fraction <= 0:
        return ordered
    return ordered[:min(len(ordered), 1 + int(len(ordered) * step / (fraction * steps)))]


def train(model: nn.Module, gaps: list[int], steps: int, *, batch: int = 32, lr: float = 2e-3, seed: int = 0,
          curriculum: float = 0.5, seconds: float | None = None, log=None) -> dict:
    """``steps`` AdamW updates (or until ``seconds`` of wall time) on batches of one gap each, the gap uniform over
    :func:`curriculum_gaps`; the same batches for every model given the same seed. Loss at the query position
    only."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = min(100, max(1, steps // 10))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    model.train()
    start, cpu = time.perf_counter(), time.process_time()
    losses = []
    done = 0
    for done in range(1, steps + 1):
        allowed = curriculum_gaps(gaps, done - 1, steps, curriculum)
        gap = allowed[int(torch.randint(len(allowed), (1,), generator=gen))]
        ids, keys = recall_data(batch, gap, gen)
        logits = model(ids)[:, -1]  # (batch, V): the query position
        loss = F.cross_entropy(logits, keys)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        losses.append(loss.item())
        if log is not None and done % max(1, steps // 10) == 0:
            log(f"    step {done}: loss {sum(losses[-50:]) / len(losses[-50:]):.3f} "
                f"({time.perf_counter() - start:.0f} s)", flush=True)
        if seconds is not None and time.perf_counter() - start > seconds:
            break
    return {"steps": done, "seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
            "final_loss": sum(losses[-50:]) / len(losses[-50:])}


@torch.no_grad()
def evaluate(model: nn.Module, gaps: list[int], count: int = 512, seed: int = 1234, batch: int = 128) -> dict:
    """Accuracy at the query position for each gap, on ``count`` fresh sequences each."""
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    accuracy = {}
    for gap in gaps:
        correct = 0
        for first in range(0, count, batch):
            ids, keys = recall_data(min(batch, count - first), gap, gen)
            correct += int((model(ids)[:, -1].argmax(-1) == keys).sum())
        accuracy[gap] = correct / count
    return accuracy


def run(gaps: list[int], steps: int, *, batch: int = 32, lr: float = 2e-3, curriculum: float = 0.5,
        eval_count: int = 512, seed: int = 0, minutes: float | None = None, gpt_dim: int = 80, lstm_dim: int = 136,
        log=print) -> dict:
    """Train and evaluate both models; {name: {parameters, steps, seconds, ..., accuracy: {gap: acc}}}."""
    built = create_models(max(gaps), gpt_dim, lstm_dim)
    share = None if minutes is None else 60.0 * minutes / len(built)
    results = {}
    for name, model in built.items():
        log(f"  {name} ({parameters(model):,} parameters)", flush=True)
        fit = train(model, gaps, steps, batch=batch, lr=lr, seed=seed, curriculum=curriculum, seconds=share, log=log)
        results[name] = {"parameters": parameters(model), **fit,
                         "accuracy": evaluate(model, gaps, eval_count, seed=seed + 1234)}
    return results


def table(gaps: list[int], results: dict) -> str:
    names = list(results)
    lines = ["| gap g | " + " | ".join(f"{n} accuracy" for n in names) + " |", "|---:|" + "---:|" * len(names)]
    for gap in gaps:
        lines.append(f"| {gap} | " + " | ".join(f"{results[n]['accuracy'][gap]:.3f}" for n in names) + " |")
    lines.append("| mean | " + " | ".join(
        f"{sum(results[n]['accuracy'].values()) / len(gaps):.3f}" for n in names) + " |")
    return "\n".join(lines)


def plot(gaps: list[int], results: dict, path: str) -> None:
    from tokenloom.cli.plotting import pyplot

    plt = pyplot("recall plot")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for (name, r), style in zip(results.items(), ("o-", "s--"), strict=False):
        ax.plot(gaps, [r["accuracy"][g] for g in gaps], style, label=f"{name} ({r['parameters'] / 1e3:.0f}K)")
    ax.axhline(1 / KEYS, color="gray", lw=0.8, label="chance")
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set_xticks(gaps, [str(g) for g in gaps])
    ax.set(xlabel="gap g (filler tokens between key and query)", ylabel="accuracy at the query", ylim=(0, 1.03),
           title="recall over a gap")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gaps", default="8,16,32,64,128,256,512", help="comma-separated gaps g")
    parser.add_argument("--steps", type=int, default=1500, help="training updates per model")
    parser.add_argument("--minutes", type=float, default=None,
                        help="wall-time cap for both trainings together, shared equally (default: none, --steps)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--curriculum", type=float, default=0.5,
                        help="fraction of the updates over which the gaps open up, shortest first (0: all at once)")
    parser.add_argument("--eval", type=int, default=512, help="test sequences per gap")
    parser.add_argument("--gpt-dim", type=int, default=80, help="the GPT's embed_dim (2 layers, 4 heads)")
    parser.add_argument("--lstm-dim", type=int, default=136, help="the LSTM's width (1 layer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="write a PNG here: accuracy vs gap")
    args = parser.parse_args(argv)
    gaps = [int(x) for x in args.gaps.split(",")]
    if any(g < 0 for g in gaps):
        parser.error(f"--gaps must be non-negative, got {args.gaps}")
    torch.set_num_threads(args.threads)
    print(machine().describe())
    settings = {k: getattr(args, k) for k in ("steps", "minutes", "batch", "lr", "curriculum", "eval", "gpt_dim",
                                                "lstm_dim", "seed")}
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    start, cpu = time.perf_counter(), time.process_time()
    results = run(gaps, args.steps, batch=args.batch, lr=args.lr, curriculum=args.curriculum, eval_count=args.eval,
                  seed=args.seed, minutes=args.minutes, gpt_dim=args.gpt_dim, lstm_dim=args.lstm_dim)
    total, total_cpu = time.perf_counter() - start, time.process_time() - cpu
    print()
    print(table(gaps, results))
    print(f"\nchance {1 / KEYS:.3f}; " + "; ".join(
        f"{n}: {r['parameters']:,} parameters, {r['steps']} steps in {r['seconds']:.0f} s ({r['cpu_seconds']:.0f} CPU)"
        for n, r in results.items())
        + f"; total time {total / 60:.1f} min ({total_cpu / 60:.1f} CPU min)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine().as_dict(), "settings": settings, "seconds": total,
                       "cpu_seconds": total_cpu, "gaps": gaps, "results": results}, f, indent=1)
    if args.plot:
        plot(gaps, results, args.plot)


if __name__ == "__main__":
    main()

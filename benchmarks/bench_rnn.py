"""Training throughput against sequence length: an LSTM language model and a Transformer (GPT) of about the same
size, the parallelism claim of the articles as a measurement (issue 29).

Both are the recipes' shapes at vocabulary 65: ``configs/shakespeare-char.yaml``'s GPT (4 layers x 256, 4 heads;
3.2M parameters) and ``configs/shakespeare-char-lstm.yaml``'s LSTM (2 layers x 448, tied; 3.25M). Every step
holds ``--tokens`` tokens (batch = tokens // T), so each row of the table does the same work per step in tokens
and only the length changes. A step is forward, cross-entropy, backward and a fused AdamW update, in fp32, on
random token batches; after ``--warmup`` steps, ``--steps`` steps are timed and **tokens/s = tokens per step /
median step time**. The reference beside tokenloom's ``RNNLM`` is a plain PyTorch LSTM LM (``nn.Embedding`` ->
``nn.LSTM`` -> tied ``nn.Linear``, no tokenloom code): their ratio is tokenloom's overhead.

    python benchmarks/bench_rnn.py                          # T = 64 .. 1024, 4096 tokens a step
    python benchmarks/bench_rnn.py --lengths 128,1024 --steps 3 --out rnn.json --plot rnn.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

from tokenloom.hardware import machine
from tokenloom.models.gpt import GPT, GPTConfig
from tokenloom.models.rnn import RNNLM, RNNConfig

VOCAB = 65


class PlainLSTM(nn.Module):
    """The reference: an LSTM language model in plain PyTorch (tied embeddings)."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.lstm = nn.LSTM(width, width, num_layers=layers, batch_first=True)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(ids))[0])


def step_times(model: nn.Module, batch: int, length: int, warmup: int, steps: int, seed: int = 0) -> list[float]:
    """Seconds per training step (forward, loss, backward, AdamW) of ``model`` on (batch, length) random ids."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    model.train()
    times = []
    for i in range(warmup + steps):
        ids = torch.randint(0, VOCAB, (batch, length + 1), generator=gen)
        start = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def models(max_len: int) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"GPT 4x256 (tokenloom)": GPT(GPTConfig(vocab_size=VOCAB, num_layers=4, num_heads=4, embed_dim=256,
                                                    max_seq_len=max_len)),
            "LSTM 2x448 (tokenloom)": RNNLM(RNNConfig(vocab_size=VOCAB, num_layers=2, embed_dim=448,
                                                      max_seq_len=max_len)),
            "LSTM 2x448 (plain PyTorch)": PlainLSTM(448, 2)}


def plot(rows: list[dict], path: str) -> None:
    """Tokens/s against T for each model (log-2 x axis), and the GPT / LSTM ratio on a second axis."""
    from tokenloom.cli.plotting import pyplot

    plt = pyplot("throughput plot")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.8))
    lengths = [r["length"] for r in rows]
    for name, style in zip(rows[0]["tokens_per_s"], ("o-", "s-", "^:"), strict=False):
        ax.plot(lengths, [r["tokens_per_s"][name] for r in rows], style, label=name)
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set(xlabel="sequence length T (tokens per step fixed)", ylabel="training tokens/s",
           title="training throughput vs sequence length")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="64,128,256,512,1024", help="comma-separated sequence lengths T")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step (batch = tokens // T)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model and length")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: all cores)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--plot", default=None, help="write a PNG here: tokens/s against T")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    print(machine().describe())
    built = models(max(lengths))
    for name, model in built.items():
        print(f"  {name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    rows = []
    names = list(built)
    print(f"\n| T | batch | {' | '.join(f'{n} tokens/s' for n in names)} | GPT / LSTM | tokenloom LSTM / plain |")
    print("|---:|---:|" + "---:|" * (len(names) + 2))
    for length in lengths:
        batch = max(1, args.tokens // length)
        speed = {}
        for name, model in built.items():
            times = step_times(model, batch, length, args.warmup, args.steps)
            speed[name] = batch * length / statistics.median(times)
        gpt, lstm, plain = (speed[n] for n in names)
        rows.append({"length": length, "batch": batch, "tokens_per_s": speed, "gpt_over_lstm": gpt / lstm,
                     "tokenloom_over_plain": lstm / plain})
        print(f"| {length} | {batch} | " + " | ".join(f"{speed[n]:,.0f}" for n in names)
              + f" | {gpt / lstm:.2f}x | {lstm / plain:.2f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine().as_dict(), "tokens_per_step": args.tokens, "rows": rows}, f, indent=2)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()

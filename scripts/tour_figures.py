"""The figures and numbers of the guided tour (docs/tour.md): one section per idea of the source articles, in their
order, each shown with tokenloom's own code (its CLI through subprocesses, its modules in process) on the bundled
checkpoints and on small runs shrunk to minutes.

    python scripts/tour_figures.py                          # everything (make tour-figures)
    python scripts/tour_figures.py --only causal,kv-cache   # some sections
    python scripts/tour_figures.py --list                   # the section names

PNGs go to ``--out`` (docs/images/tour), the numbers to ``--out``/tour-figures.json (merged with the file's other
sections when ``--only`` runs some) and, one per line, to stdout as ``section.key = value``. Training runs and
command outputs go to ``--work`` (runs/tour, ignored by git); a section starts its runs afresh. The whole script took
13 minutes on 2 cores of an AMD EPYC shared with other work (2026-12-02); every training run is shrunk to 1-3 minutes
with ``--set``. A section's time and the load average around it are recorded in the JSON's ``_meta``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GPT_CKPT = "checkpoints/shakespeare-char"
MT_CKPT = "checkpoints/multi30k-de-en"
SHAKESPEARE = ROOT / "data" / "tinyshakespeare" / "input.txt"
MULTI30K = ROOT / "data" / "multi30k"
ROMEO = "ROMEO:\nBut soft, what light through yonder window breaks?"
SECTIONS: dict[str, Callable[[Tour], None]] = {}


def section(name: str):
    def register(fn: Callable[[Tour], None]) -> Callable[[Tour], None]:
        SECTIONS[name] = fn
        return fn
    return register


class Tour:
    """Where things go, the numbers recorded so far, and the helpers every section uses."""

    def __init__(self, out: Path, work: Path) -> None:
        self.out, self.work = out, work
        self.numbers: dict[str, dict] = {}
        self.section = ""
        self._cache: dict[str, object] = {}

    def record(self, key: str, value):
        """Store ``value`` under the running section and print it."""
        if isinstance(value, float):
            value = float(f"{value:.4g}")
        self.numbers.setdefault(self.section, {})[key] = value
        print(f"  {self.section}.{key} = {value}", flush=True)
        return value

    def fresh(self, name: str) -> Path:
        path = self.work / name
        shutil.rmtree(path, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def cli(self, *args: str, timeout: int = 900) -> str:
        """Run ``tokenloom ARGS`` (this Python's package) and return stdout + stderr; a failure stops the script."""
        command = [sys.executable, "-m", "tokenloom", *map(str, args)]
        print("  $ tokenloom " + " ".join(_quote(a) for a in command[3:]), flush=True)
        start = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        output = result.stdout + result.stderr
        if result.returncode != 0:
            raise RuntimeError(f"tokenloom {' '.join(command[3:])} failed ({result.returncode}):\n{output[-3000:]}")
        print(f"    ({time.perf_counter() - start:.0f} s)", flush=True)
        return output

    def save(self, fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(self.out / name, dpi=110)
        plt.close(fig)
        print(f"  wrote {(self.out / name).relative_to(ROOT) if self.out.is_relative_to(ROOT) else self.out / name}")

    def memo(self, key: str, make: Callable[[], object]):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def gpt(self):
        from tokenloom.checkpoint import load_model, load_tokenizer

        return self.memo("gpt", lambda: (load_model(ROOT / GPT_CKPT)[0], load_tokenizer(ROOT / GPT_CKPT)))

    def mt(self, path: str | Path = MT_CKPT):
        from tokenloom.checkpoint import load_model, load_tokenizer

        return self.memo(f"mt:{path}", lambda: (load_model(ROOT / path)[0], load_tokenizer(ROOT / path)))


def _quote(arg: str) -> str:
    return arg if re.fullmatch(r"[\w./=,:@+-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


def _csv_rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _metrics(run: Path) -> list[dict]:
    """The rows of a run directory's metrics.jsonl."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line]


def _head_check(t: Tour) -> dict:
    """``tokenloom viz check`` on the bundled GPT (once per process): the causal check and the head diagnostics."""
    def run() -> dict:
        out = t.fresh("viz-check")
        t.cli("viz", "check", GPT_CKPT, "--out", out)
        return json.loads((out / "head-diagnostics.json").read_text(encoding="utf-8"))
    return t.memo("check", run)


# --- 1. the causal mask -----------------------------------------------------------------------------------------------

@section("causal")
def causal(t: Tour) -> None:
    from tokenloom.nn.masks import causal_mask
    from tokenloom.viz import capture_attention

    results = _head_check(t)
    t.record("layers_checked", len(results["causal"]))
    t.record("layers_passed", sum(c["passed"] for c in results["causal"]))
    t.record("max_mass_on_later_positions", max(c["max_mass_above_diagonal"] for c in results["causal"]))
    model, tok = t.gpt()
    ids = torch.tensor([tok.encode(ROMEO)])
    T, changed_at = ids.shape[1], ids.shape[1] // 2
    other = ids.clone()
    other[0, changed_at] = (ids[0, changed_at] + 1) % model.config.vocab_size
    with torch.no_grad():
        diff = (model(ids) - model(other)).abs().amax(-1)[0]  # (T,): largest logit change at each position
    t.record("tokens", T)
    t.record("changed_position", changed_at)
    t.record("max_logit_change_before", float(diff[:changed_at].max()))
    t.record("max_logit_change_from", float(diff[changed_at:].max()))
    head = max((h for h in results["heads"] if h["layer"] == 0), key=lambda h: h["previous_token"])["head"]
    short = ids[:, :20]
    with torch.no_grad(), capture_attention(model, [0], ["self"]) as maps:
        model(short)
    probs = maps.get("self", 0)[0, head]  # (T, T)
    labels = [repr(tok.decode([i]))[1:-1] for i in short[0].tolist()]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4))
    axes[0].imshow(causal_mask(20, 20).float(), cmap="Greys", vmin=0, vmax=1.4)
    axes[0].set_title("causal_mask(20, 20): query i may see keys <= i", fontsize=9)
    axes[1].imshow(probs, cmap="viridis")
    axes[1].set_title(f"layer 0 head {head} of the bundled GPT (capture_attention)", fontsize=9)
    for ax in axes[:2]:
        ax.set_xticks(range(20), labels, fontsize=7)
        ax.set_yticks(range(20), labels, fontsize=7)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    colors = ["tab:blue" if i < changed_at else "tab:red" for i in range(T)]
    axes[2].bar(range(T), diff.numpy(), color=colors)
    axes[2].axvline(changed_at - 0.5, color="k", ls="--", lw=0.8)
    axes[2].set_title(f"largest |logit change| at each position when token {changed_at} changes", fontsize=9)
    axes[2].set_xlabel("position")
    t.save(fig, "causal.png")


# --- 2. scaling the scores by 1/sqrt(d_k) -----------------------------------------------------------------------------

@section("sqrt-dk")
def sqrt_dk(t: Tour) -> None:
    from tokenloom.nn.attention import attention_probs

    dims = [4, 8, 16, 32, 64, 128, 256, 512, 1024]
    keys = 64
    g = torch.Generator().manual_seed(0)
    table = {name: {"max_p": [], "saturated": [], "entropy": [], "jacobian": [], "score_std": []}
             for name in ("scaled", "unscaled")}
    for d in dims:
        q = torch.randn(1, 1, 512, d, generator=g)  # (B, H, Tq, D), unit-variance components
        k = torch.randn(1, 1, keys, d, generator=g)
        for name, qq in (("scaled", q), ("unscaled", q * math.sqrt(d))):  # x sqrt(d) cancels the 1/sqrt(d)
            p = attention_probs(qq, k, None, False)[0, 0].double()  # (Tq, keys), the toolkit's scaled softmax
            s2, s3 = (p ** 2).sum(-1), (p ** 3).sum(-1)
            row = table[name]
            row["max_p"].append(float(p.max(-1).values.mean()))
            row["saturated"].append(float((p.max(-1).values > 0.99).double().mean()))  # near one-hot rows
            row["entropy"].append(float(-(p * p.clamp_min(1e-300).log()).sum(-1).mean() / math.log(keys)))
            jacobian = (s2 - 2 * s3 + s2 ** 2).clamp_min(0).sqrt()  # |diag(p) - pp^T|_F of each row
            row["jacobian"].append(float(jacobian.median()))
            row["score_std"].append(float((qq[0, 0] @ k[0, 0].T / math.sqrt(d)).std()))
    for d in (64, 512):
        i = dims.index(d)
        for name in ("scaled", "unscaled"):
            for key in ("score_std", "max_p", "saturated", "entropy", "jacobian"):
                t.record(f"d{d}_{name}_{key}", table[name][key][i])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, title in zip(axes, ("max_p", "saturated", "jacobian"),
                              ("mean max probability of a row (64 keys)", "share of rows with max p > 0.99",
                               "median softmax Jacobian norm |diag(p) - pp^T|"), strict=True):
        for name, style in (("scaled", "o-"), ("unscaled", "s--")):
            ax.plot(dims, table[name][key], style, label=f"{name}: softmax(qk^T{' / sqrt(d_k)' * (name == 'scaled')})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("d_k")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    t.save(fig, "sqrt-dk.png")


# --- 3. multi-head attention maps -------------------------------------------------------------------------------------

@section("heads")
def heads(t: Tour) -> None:
    t.cli("viz", "attention", GPT_CKPT, "--text", "ROMEO: But soft, what light", "--layers", "0", "1",
          "--out", t.out / "heads.png")
    results = _head_check(t)
    shutil.copy(t.work / "viz-check" / "head-entropy-self.png", t.out / "heads-entropy.png")
    for h in results["heads"]:
        if h["flags"]:
            t.record(f"layer{h['layer']}_head{h['head']}",
                     f"{', '.join(h['flags'])}; normalised entropy {h['normalized_entropy']:.3f}, "
                     f"max p {h['max_prob']:.3f}, previous-token mass {h['previous_token']:.3f}")
    by_layer: dict[int, list[float]] = {}
    for h in results["heads"]:
        by_layer.setdefault(h["layer"], []).append(h["normalized_entropy"])
    t.record("mean_normalised_entropy_per_layer", [round(sum(v) / len(v), 3) for _, v in sorted(by_layer.items())])


# --- 4. positions and length extrapolation ----------------------------------------------------------------------------

@section("positions")
def positions(t: Tour) -> None:
    from tokenloom.checkpoint import load_model, load_tokenizer

    out = t.fresh("positions")
    t.cli("sweep", "sweeps/positions-extrapolation.yaml", "--out", out, "--set", "train.eval_every=0")
    lengths = [128, 256, 512, 1024]
    for row in _csv_rows(out / "results.csv"):
        t.record(f"{row['model.position']}_ppl", [round(float(row[f"val_ppl@{n}"]), 2) for n in lengths])
    text = SHAKESPEARE.read_text(encoding="utf-8")
    val = text[int(0.9 * len(text)):]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    for run in sorted(out.glob("position=*")):
        name = run.name.split(",")[0].split("=")[1]
        model, _ = load_model(run / "checkpoint")
        ids = torch.tensor(load_tokenizer(run / "checkpoint").encode(val))
        starts = torch.linspace(0, len(ids) - 1026, 40).long()
        x = torch.stack([ids[s:s + 1025] for s in starts.tolist()])  # (40, 1025)
        with torch.no_grad():
            loss = torch.cat([F.cross_entropy(model(c[:, :-1]).transpose(1, 2), c[:, 1:], reduction="none")
                              for c in x.split(8)]).mean(0)  # (1024,): mean over the 40 windows
        t.record(f"{name}_loss_positions_0_127", float(loss[:128].mean()))
        t.record(f"{name}_loss_positions_896_1023", float(loss[896:].mean()))
        ax.plot(range(32, 1024, 64), loss.view(16, 64).mean(1), marker=".", label=name)
    ax.axvline(128, color="k", ls="--", lw=0.8)
    ax.text(132, ax.get_ylim()[1] * 0.97, "trained length 128", va="top", fontsize=8)
    ax.set_xlabel("position in a window of 1024 tokens (40 windows, 64 positions a point)")
    ax.set_ylabel("validation loss")
    ax.set_title("5 character GPTs trained on windows of 128 (600 steps each)")
    ax.legend(ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=9)
    ax.grid(alpha=0.3)
    t.save(fig, "positions.png")


# --- 5. Post-Norm vs Pre-Norm -----------------------------------------------------------------------------------------

@section("norm")
def norm(t: Tour) -> None:
    from tokenloom import GPT, GPTConfig

    _, tok = t.gpt()
    ids = torch.tensor(tok.encode(SHAKESPEARE.read_text(encoding="utf-8")[:200_000]))
    g = torch.Generator().manual_seed(0)
    x = torch.stack([ids[s:s + 129] for s in torch.randint(0, len(ids) - 129, (16,), generator=g).tolist()])
    grads = {}
    for placement in ("pre", "post"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=65, num_layers=12, num_heads=4, embed_dim=128, max_seq_len=128,
                              norm_placement=placement)).train()
        F.cross_entropy(model(x[:, :-1]).transpose(1, 2), x[:, 1:]).backward()
        grads[placement] = [math.sqrt(sum(float(p.grad.pow(2).sum()) for p in block.parameters()))
                            for block in model.blocks]
        t.record(f"{placement}_grad_norm_layer0", grads[placement][0])
        t.record(f"{placement}_grad_norm_layer11", grads[placement][-1])
        t.record(f"{placement}_grad_norm_last_over_first", grads[placement][-1] / grads[placement][0])
        t.record(f"{placement}_grad_norms", [round(v, 3) for v in grads[placement]])
    sweep = t.fresh("norm")
    spec = t.work / "norm-sweep.yaml"
    spec.write_text(f"""name: tour-norm
recipe: {ROOT / 'configs' / 'shakespeare-char-adamw.yaml'}
set:
  model.embed_dim: 128
  model.num_heads: 4
  model.num_layers: 12
  model.max_seq_len: 128
  train.seq_len: 128
  train.batch_size: 16
  train.lr: 3.0e-3
  train.warmup_steps: 100
  train.max_steps: 200
  train.eval_every: 50
  train.eval_batches: 10
  train.log_every: 10
  train.checkpoint_every: 0
  train.max_minutes: null
grid:
  model.norm_placement: [pre, post]
seeds: [1]
""", encoding="utf-8")
    t.cli("sweep", spec, "--out", sweep)
    runs = {p: sweep / f"norm_placement={p},seed=1" for p in ("pre", "post")}
    t.cli("viz", "curves", runs["pre"], runs["post"], "--out", t.out / "norm-curves.png")
    fig, (ax_grad, ax_loss) = plt.subplots(1, 2, figsize=(12, 4))
    for placement, style in (("pre", "o-"), ("post", "s--")):
        ax_grad.plot(range(12), grads[placement], style, label=f"{placement}-norm")
        evals = [r for r in _metrics(runs[placement]) if "val_loss" in r]
        ax_loss.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], style, label=f"{placement}-norm")
        t.record(f"{placement}_val_loss", [round(r["val_loss"], 3) for r in evals])
    ax_grad.set_yscale("log")
    ax_grad.set_xlabel("block")
    ax_grad.set_title("gradient norm per block at initialisation (12 layers)")
    ax_loss.axhline(3.35, color="grey", ls=":", lw=1)
    ax_loss.text(50, 3.3, "unigram loss (~3.35)", fontsize=8, color="grey")
    ax_loss.set_xlabel("step")
    ax_loss.set_title("validation loss, 12 layers, peak lr 3e-3, warmup 100")
    for ax in (ax_grad, ax_loss):
        ax.legend()
        ax.grid(alpha=0.3)
    t.save(fig, "norm.png")


# --- 6. the KV cache --------------------------------------------------------------------------------------------------

@section("kv-cache")
def kv_cache(t: Tour) -> None:
    from tokenloom import GenerationConfig, generate
    from tokenloom.generation import stream

    model, tok = t.gpt()
    prompt = torch.tensor([tok.encode("ROMEO:")])
    n = model.config.max_seq_len - prompt.shape[1]
    config = GenerationConfig(max_new_tokens=n, do_sample=False)
    generate(model, prompt, GenerationConfig(max_new_tokens=16, do_sample=False))  # warm-up
    cached, tokens = [], []
    last = time.perf_counter()
    for step in stream(model, prompt, config):
        tokens.append(int(step[0]))
        now = time.perf_counter()
        cached.append(now - last)
        last = now
    uncached, seq = [], prompt
    with torch.inference_mode():
        for _ in range(n):  # no cache: the whole sequence through the model for every new token
            start = time.perf_counter()
            nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            uncached.append(time.perf_counter() - start)
    t.record("new_tokens", n)
    t.record("same_tokens", seq[0, prompt.shape[1]:].tolist() == tokens)
    t.record("cached_tokens_per_s", n / sum(cached))
    t.record("uncached_tokens_per_s", n / sum(uncached))
    t.record("speedup", sum(uncached) / sum(cached))
    t.record("cached_ms_last_token", 1000 * cached[-1])
    t.record("uncached_ms_last_token", 1000 * uncached[-1])
    fig, ax = plt.subplots(figsize=(7.5, 4))
    positions = range(prompt.shape[1] + 1, prompt.shape[1] + n + 1)
    ax.plot(positions, [1000 * s for s in uncached], label="no cache: the whole prefix every step")
    ax.plot(positions, [1000 * s for s in cached], label="KV cache (tokenloom.generate)")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("ms per new token")
    ax.set_title("greedy decoding of the bundled GPT (6 x 384), fp32")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    t.save(fig, "kv-cache.png")


# --- 7. greedy, sampling, top-k, top-p, beam --------------------------------------------------------------------------

def _distinct(text: str, n: int) -> float:
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / max(1, len(grams))


def _read_split(split: str, limit: int | None = None) -> tuple[list[str], list[str]]:
    src = (MULTI30K / f"{split}.de").read_text(encoding="utf-8").splitlines()[:limit]
    ref = (MULTI30K / f"{split}.en").read_text(encoding="utf-8").splitlines()[:limit]
    return src, ref


@section("decoding")
def decoding(t: Tour) -> None:
    from tokenloom import GenerationConfig, generate
    from tokenloom.evaluation import compute_metrics
    from tokenloom.tasks.translation import translate

    model, tok = t.gpt()
    prompt = torch.tensor([tok.encode("ROMEO:\n")])
    n = 200
    strategies = {"greedy": dict(do_sample=False), "sampling T=1": dict(), "top-k 10": dict(top_k=10),
                  "top-p 0.8": dict(top_p=0.8), "beam 4": dict(do_sample=False, num_beams=4)}
    rows = {}
    for name, options in strategies.items():
        seeds = [None] if "do_sample" in options else [1, 2, 3, 4]
        texts, logps = [], []
        for seed in seeds:
            out = generate(model, prompt, GenerationConfig(max_new_tokens=n, seed=seed, **options))
            with torch.no_grad():
                logp = model(out[:, :-1]).log_softmax(-1)[0, prompt.shape[1] - 1:]  # (n, V)
            logps.append(float(logp.gather(-1, out[0, prompt.shape[1]:, None]).mean()))
            texts.append(tok.decode(out[0, prompt.shape[1]:].tolist()))
        rows[name] = dict(logp=sum(logps) / len(logps), d1=sum(_distinct(s, 1) for s in texts) / len(texts),
                          d2=sum(_distinct(s, 2) for s in texts) / len(texts))
        key = name.replace(" ", "_").replace("=", "")
        t.record(f"gpt_{key}_logprob_per_token", rows[name]["logp"])
        t.record(f"gpt_{key}_distinct1", rows[name]["d1"])
        t.record(f"gpt_{key}_distinct2", rows[name]["d2"])
        t.record(f"gpt_{key}_sample", texts[0][:110])
    mt, mt_tok = t.mt()
    sources, references = _read_split("test2016")
    bleu, outputs = {}, {}
    for beam in (1, 5):
        start = time.perf_counter()
        outputs[beam] = translate(mt, mt_tok, sources, beam=beam)
        seconds = time.perf_counter() - start
        scores = compute_metrics(["bleu", "chrf"], outputs[beam], references).scores
        bleu[beam] = scores["bleu"]
        t.record(f"mt_beam{beam}_bleu", scores["bleu"])
        t.record(f"mt_beam{beam}_chrf", scores["chrf"])
        t.record(f"mt_beam{beam}_seconds", seconds)
    t.record("mt_sentences", len(sources))
    t.record("mt_sentences_that_differ", sum(a != b for a, b in zip(outputs[1], outputs[5], strict=True)))
    i = next(i for i, (a, b) in enumerate(zip(outputs[1], outputs[5], strict=True)) if a != b)
    t.record("mt_example", {"sentence": i + 1, "source": sources[i], "reference": references[i],
                            "greedy": outputs[1][i], "beam5": outputs[5][i]})
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    names = list(rows)
    axes[0].bar(names, [rows[k]["logp"] for k in names], color="tab:blue")
    axes[0].set_title("bundled GPT, 200 characters: mean log p(character) under the model", fontsize=9)
    axes[1].bar([i - 0.2 for i in range(len(names))], [rows[k]["d1"] for k in names], 0.4, label="distinct-1")
    axes[1].bar([i + 0.2 for i in range(len(names))], [rows[k]["d2"] for k in names], 0.4, label="distinct-2")
    axes[1].set_xticks(range(len(names)), names)
    axes[1].legend(fontsize=8, loc="lower center")
    axes[1].set_title("unique words / word bigrams of the 200 characters", fontsize=9)
    for ax in axes[:2]:
        ax.tick_params(axis="x", labelsize=8)
    axes[2].bar(["greedy", "beam 5"], [bleu[1], bleu[5]], color="tab:green")
    axes[2].set_ylim(min(bleu.values()) - 3, max(bleu.values()) + 1)
    axes[2].set_title(f"bundled de-en model, test2016 ({len(sources)} sentences): BLEU", fontsize=9)
    t.save(fig, "decoding.png")


# --- 8 and 9. exposure bias / scheduled sampling, label smoothing / calibration: fine-tunes of the bundled model ------

FINETUNE = ["train.init_from=" + MT_CKPT, "train.max_steps=40", "train.eval_every=0", "train.eval_batches=1",
            "data.bleu=false", "train.average_last=0", "train.keep_best=null", "train.checkpoint_every=0",
            "train.max_minutes=null", "train.warmup_steps=0", "train.schedule=constant", "train.lr=5e-4",
            "data.max_tokens=2048", "train.log_every=10"]
FINETUNES = {"plain": ["train.label_smoothing=0.1"],
             "no-smoothing": ["train.label_smoothing=0.0"],
             "scheduled-sampling": ["train.label_smoothing=0.1", "train.scheduled_sampling.schedule=linear",
                                    "train.scheduled_sampling.k=1", "train.scheduled_sampling.min_teacher=0.75"]}


def _finetuned(t: Tour, name: str) -> Path:
    """The bundled translation model fine-tuned 40 steps (``FINETUNES[name]``), trained once per process."""
    def run() -> Path:
        out = t.fresh(f"ft-{name}")
        sets = [a for s in FINETUNE + FINETUNES[name] for a in ("--set", s)]
        t.cli("train", "configs/multi30k-de-en.yaml", "--out", out, *sets)
        return out / "checkpoint"
    return t.memo(f"ft:{name}", run)


def _teacher_forced(t: Tour, path: str | Path, replace: float = 0.0, sentences: int = 500) -> dict:
    """Teacher-forced NLL, accuracy and confidences on the first ``sentences`` val pairs; with ``replace`` > 0 that
    share of the decoder inputs (after BOS) is swapped for the model's own argmax predictions first (what scheduled
    sampling trains on: here at evaluation, to see how the model copes with its own mistakes in its history)."""
    from tokenloom.tasks.translation import encode_sources, special_ids

    def run() -> dict:
        model, tok = t.mt(path)
        ids = special_ids(tok)
        pad, bos, eos = ids["pad_id"], ids["bos_id"], ids["eos_id"]
        sources, targets = _read_split("val", sentences)
        src_ids = encode_sources(model, tok, sources)
        tgt_ids = [tok.encode(s)[:model.config.max_target_len - 1] for s in targets]
        g = torch.Generator().manual_seed(0)
        nll, count, confidences, corrects = 0.0, 0, [], []
        for i in range(0, len(sources), 64):
            S = max(len(s) for s in src_ids[i:i + 64])
            T = max(len(y) for y in tgt_ids[i:i + 64]) + 1
            src = torch.full((len(src_ids[i:i + 64]), S), pad)
            tin, tout = torch.full((src.shape[0], T), pad), torch.full((src.shape[0], T), pad)
            for r, (s, y) in enumerate(zip(src_ids[i:i + 64], tgt_ids[i:i + 64], strict=True)):
                src[r, :len(s)] = torch.tensor(s)
                tin[r, :len(y) + 1] = torch.tensor([bos] + y)
                tout[r, :len(y) + 1] = torch.tensor(y + [eos])
            mask = (src != pad).long()
            with torch.no_grad():
                memory = model.encode(src, mask)
                logits = model.decode(tin, memory, mask)
                if replace > 0:
                    mixed = tin.clone()
                    swap = (torch.rand(mixed[:, 1:].shape, generator=g) < replace) & (tin[:, 1:] != pad)
                    mixed[:, 1:] = torch.where(swap, logits.argmax(-1)[:, :-1], mixed[:, 1:])
                    logits = model.decode(mixed, memory, mask)
            real = tout != pad
            nll += float(F.cross_entropy(logits[real], tout[real], reduction="sum"))
            count += int(real.sum())
            confidence, predicted = logits[real].softmax(-1).max(-1)
            confidences.append(confidence)
            corrects.append(predicted == tout[real])
        return dict(nll=nll / count, confidence=torch.cat(confidences), correct=torch.cat(corrects))
    return t.memo(f"tf:{path}:{replace}:{sentences}", run)


def _greedy_bleu(t: Tour, path: str | Path) -> float:
    from tokenloom.evaluation import compute_metrics
    from tokenloom.tasks.translation import translate

    def run() -> float:
        model, tok = t.mt(path)
        sources, references = _read_split("test2016")
        return compute_metrics(["bleu"], translate(model, tok, sources, beam=1), references).scores["bleu"]
    return t.memo(f"bleu:{path}", run)


@section("exposure")
def exposure(t: Tour) -> None:
    from tokenloom.training.config import ScheduledSamplingConfig

    models = {"bundled": MT_CKPT, "fine-tuned": _finetuned(t, "plain"),
              "fine-tuned + scheduled sampling": _finetuned(t, "scheduled-sampling")}
    shares = [0.0, 0.1, 0.25, 0.5]
    fig, (ax_sched, ax_nll) = plt.subplots(1, 2, figsize=(12, 4))
    for name, path in models.items():
        results = [_teacher_forced(t, path, r) for r in shares]
        key = name.replace(" + ", "_").replace(" ", "_").replace("-", "_")
        t.record(f"{key}_nll", [round(r["nll"], 4) for r in results])
        t.record(f"{key}_accuracy", [round(100 * float(r["correct"].float().mean()), 2) for r in results])
        t.record(f"{key}_nll_increase_at_50pct", results[-1]["nll"] - results[0]["nll"])
        if name != "bundled":
            t.record(f"{key}_test2016_greedy_bleu", _greedy_bleu(t, path))
        ax_nll.plot([100 * s for s in shares], [r["nll"] for r in results], "o-", label=name)
    t.record("shares_of_inputs_replaced", shares)
    for schedule, k in (("linear", 2000), ("exponential", 0.999), ("inverse_sigmoid", 300)):
        config = ScheduledSamplingConfig(schedule=schedule, k=k)
        steps = range(0, 3001, 25)
        ax_sched.plot(steps, [config.teacher_probability(s) for s in steps], label=f"{schedule} (k={k})")
    ax_sched.set_xlabel("training step")
    ax_sched.set_ylabel("teacher-forcing probability")
    ax_sched.set_title("ScheduledSamplingConfig.teacher_probability (floor min_teacher 0.75)")
    ax_nll.set_xlabel("% of decoder inputs replaced by the model's own argmax")
    ax_nll.set_ylabel("NLL of the reference (val, 500 sentences)")
    ax_nll.set_title("exposure bias: the model fed its own predictions")
    for ax in (ax_sched, ax_nll):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    t.save(fig, "exposure.png")


@section("smoothing")
def smoothing(t: Tour) -> None:
    from tokenloom.evaluation import expected_calibration_error

    models = {"bundled (smoothing 0.1, 4,250 steps)": MT_CKPT,
              "+40 steps, smoothing 0.1": _finetuned(t, "plain"),
              "+40 steps, smoothing 0.0": _finetuned(t, "no-smoothing")}
    fig, (ax_rel, ax_hist) = plt.subplots(1, 2, figsize=(12, 4.3))
    ax_rel.plot([0, 1], [0, 1], color="grey", ls=":", lw=1)
    edges = torch.linspace(0, 1, 16)
    for (name, path), key in zip(models.items(), ("bundled", "ls01", "ls00"), strict=True):
        r = _teacher_forced(t, path)
        conf, correct = r["confidence"], r["correct"].double()
        t.record(f"{key}_ece_percent", expected_calibration_error(conf, correct))
        t.record(f"{key}_mean_confidence", float(conf.mean()))
        t.record(f"{key}_accuracy", float(correct.mean()))
        t.record(f"{key}_val_nll", r["nll"])
        if path != MT_CKPT:
            t.record(f"{key}_test2016_greedy_bleu", _greedy_bleu(t, path))
        which = (conf.double() * 15).long().clamp(0, 14)
        count = torch.bincount(which, minlength=15)
        acc = torch.bincount(which, weights=correct, minlength=15) / count.clamp_min(1)
        mid = torch.bincount(which, weights=conf.double(), minlength=15) / count.clamp_min(1)
        keep = count > 20
        ax_rel.plot(mid[keep], acc[keep], "o-", label=name)
        ax_hist.hist(conf.numpy(), bins=edges.numpy(), histtype="step", lw=1.5, label=name)
    ax_rel.set_xlabel("confidence (probability of the predicted token)")
    ax_rel.set_ylabel("accuracy")
    ax_rel.set_title("reliability, next-token predictions on val (15 bins)")
    ax_hist.set_yscale("log")
    ax_hist.set_xlabel("confidence")
    ax_hist.set_title("how confident the predictions are")
    for ax in (ax_rel, ax_hist):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    t.save(fig, "smoothing.png")


# --- 10. cross-attention alignment ------------------------------------------------------------------------------------

@section("cross")
def cross(t: Tour) -> None:
    from tokenloom.cli.viz import Loaded, translation_pair
    from tokenloom.viz import capture_attention

    source = "Zwei Hunde spielen im Schnee."
    output = t.cli("viz", "attention", MT_CKPT, "--source", source, "--cross", "--out", t.out / "cross.png")
    t.record("translation", re.search(r"translation: (.*)", output).group(1).strip())
    loaded = Loaded(ROOT / MT_CKPT)
    pair = translation_pair(loaded, source, None, "truncate")
    with torch.no_grad(), capture_attention(loaded.model, [-1], ["cross"]) as maps:
        loaded.model(pair["source"], pair["target_in"])
    probs = maps.get("cross", maps.layers("cross")[-1])[0].mean(0)  # (Tt, Ts), mean of heads
    t.record("strongest_source_token", [f"{tgt.strip()}->{pair['source_labels'][int(j)].strip()}"
                                        for tgt, j in zip(pair["target_labels"], probs.argmax(-1), strict=True)])
    t.record("mean_max_weight", float(probs.max(-1).values.mean()))


# --- 11. ViT: patches and attention rollout ---------------------------------------------------------------------------

@section("vit")
def vit(t: Tour) -> None:
    from PIL import Image

    from tokenloom.checkpoint import load_model
    from tokenloom.data.images import holdout_split, read_digits, read_mnist
    from tokenloom.nn.patch_embed import patchify
    from tokenloom.tasks.image import read_images
    from tokenloom.viz import attention_rollout, capture_attention

    images, labels = read_mnist(ROOT / "data" / "mnist", "test")
    image = images[0:1].float() / 255  # (1, 1, 28, 28)
    patches = patchify(image, 4)  # (1, 49, 16): the mnist-vit recipe's 4x4 patches
    t.record("mnist_tokens", patches.shape[1] + 1)
    t.record("mnist_patch_values", patches.shape[2])
    fig = plt.figure(figsize=(13, 3.6))
    ax = fig.add_axes([0.01, 0.05, 0.22, 0.85])
    ax.imshow(image[0, 0], cmap="gray")
    for i in range(1, 7):
        ax.axhline(4 * i - 0.5, color="tab:orange", lw=0.8)
        ax.axvline(4 * i - 0.5, color="tab:orange", lw=0.8)
    ax.set_title(f"MNIST test image 0 (a {int(labels[0])}): 7x7 patches of 4x4", fontsize=9)
    ax.axis("off")
    strip = torch.ones(2 * 5, 25 * 5)  # the sequence: [cls] + 49 patches, in two rows of 25 tiles
    for i in range(50):
        r, c = divmod(i, 25)
        tile = torch.full((4, 4), 0.5) if i == 0 else patches[0, i - 1].view(4, 4)
        strip[r * 5:r * 5 + 4, c * 5:c * 5 + 4] = tile
    ax = fig.add_axes([0.26, 0.05, 0.73, 0.85])
    ax.imshow(strip, cmap="gray", vmin=0, vmax=1)
    ax.set_title("patchify(image, 4): the 50 tokens a ViT reads, row-major (grey: the class token)", fontsize=9)
    ax.axis("off")
    fig.savefig(t.out / "vit-patches.png", dpi=110)
    plt.close(fig)
    run = t.fresh("vit")
    t.cli("train", "configs/digits-vit.yaml", "--out", run, "--set", "train.max_steps=3000", "--set",
          "train.eval_every=0", "--set", "train.checkpoint_every=0", "--set", "train.keep_best=null",
          "--set", "train.max_minutes=3", "--set", "train.log_every=500")
    output = t.cli("evaluate", run, "--split", "test", "--json", "--no-plot")
    metrics = json.loads(next(line for line in output.splitlines()[::-1] if line.startswith("{")))
    t.record("digits_test_accuracy", metrics.get("accuracy", metrics.get("acc")))
    steps = [r for r in _metrics(run) if "elapsed_s" in r]
    t.record("digits_steps", steps[-1]["step"])
    t.record("digits_train_seconds", steps[-1]["elapsed_s"])
    x, y = read_digits(ROOT / "data" / "digits" / "digits.csv.gz")
    test, _, _ = holdout_split(len(y), [360, 180], 0)
    paths = []
    for k in range(100):  # the first 100 test digits as 8x8 PNGs: what `tokenloom classify` / `viz` read
        paths.append(t.work / f"digit-{k}.png")
        Image.fromarray(x[test[k], 0].numpy()).save(paths[-1])
    t.cli("viz", "attention", run, "--image", paths[0], "--rollout", "--out", t.out / "vit-rollout-cli.png")
    model, config = load_model(run / "checkpoint")
    images = read_images(paths, config["data"])  # (100, 1, 8, 8), normalised as the model was trained
    with torch.no_grad(), capture_attention(model, None, ["self"]) as maps:
        model.forward_features(images)
    rollout = attention_rollout([maps.get("self", i) for i in maps.layers("self")])  # (100, 17, 17)
    heat = rollout[:, 0, 1:]  # (100, 16): what the class token draws from each 2x2 patch
    ink = patchify(x[test[:100]].float() / 255, 2).mean(-1) > 0.25  # (100, 16): patches with some ink
    t.record("rollout_mass_on_ink_patches", float(((heat * ink).sum(-1) / heat.sum(-1)).mean()))
    t.record("ink_patch_share", float(ink.float().mean()))
    fig, axes = plt.subplots(2, 6, figsize=(11, 4))
    for k in range(6):
        axes[0, k].imshow(x[test[k], 0], cmap="gray")
        axes[0, k].set_title(f"test digit {k}: a {int(y[test[k]])}", fontsize=9)
        axes[1, k].imshow(heat[k].view(4, 4), cmap="magma")
        axes[1, k].set_title("class-token rollout", fontsize=9)
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    t.save(fig, "vit-rollout.png")


# --- 12. Swin windows -------------------------------------------------------------------------------------------------

@section("swin")
def swin(t: Tour) -> None:
    from tokenloom.data.images import read_mnist
    from tokenloom.models.swin import stage_window
    from tokenloom.nn.windows import shift_regions, shifted_window_mask, window_order

    images, _ = read_mnist(ROOT / "data" / "mnist", "test")
    image = images[0, 0].float() / 255
    G = 28 // 2  # configs/mnist-swin.yaml: 2x2 patches -> a 14x14 map, 7x7 windows
    window, shift = stage_window((G, G), 7)
    t.record("grid", f"{G}x{G}")
    t.record("window", window)
    t.record("shift", shift)
    ids = {}
    for s in (0, shift):
        order = window_order(G, G, window, s)  # slot -> token; slot // N = the window
        wid = torch.empty(G * G, dtype=torch.long)
        wid[order] = torch.arange(G * G) // (window * window)
        ids[s] = wid.view(G, G)
    mask = shifted_window_mask(G, G, window, shift)  # (nW, N, N) True = may attend
    N = window * window
    t.record("windows", int(mask.shape[0]))
    t.record("tokens_per_window", N)
    t.record("pairs_global_attention", (G * G) ** 2)
    t.record("pairs_window_attention", int(mask.shape[0]) * N * N)
    t.record("masked_share_per_shifted_window", [round(1 - float(m.float().mean()), 3) for m in mask])
    regions = shift_regions(G, G, window, shift)  # labels on the rolled map

    def up(x):  # a (G, G) map of patches -> (28, 28) pixels
        return x.repeat_interleave(2, 0).repeat_interleave(2, 1)

    fig, axes = plt.subplots(1, 4, figsize=(16, 4.4))
    for ax, s, title in ((axes[0], 0, f"window_order: 4 windows of {window}x{window} patches"),
                         (axes[1], shift, f"shift {shift}: the windows after the roll, in place")):
        ax.imshow(image, cmap="gray")
        ax.imshow(up(ids[s]), cmap="Pastel1", alpha=0.45, vmin=0, vmax=8)
        for edge in ((window,) if s == 0 else (s, s + window)):
            ax.axhline(2 * edge - 0.5, color="tab:orange", lw=1.5)
            ax.axvline(2 * edge - 0.5, color="tab:orange", lw=1.5)
        ax.set_title(title, fontsize=9)
    axes[2].imshow(torch.roll(image, shifts=(-2 * shift, -2 * shift), dims=(0, 1)), cmap="gray")
    axes[2].imshow(up(regions), cmap="Pastel1", alpha=0.45, vmin=0, vmax=8)
    axes[2].axhline(2 * window - 0.5, color="tab:orange", lw=1.5)
    axes[2].axvline(2 * window - 0.5, color="tab:orange", lw=1.5)
    axes[2].set_title("the rolled map: shift_regions (colours), windows (lines)", fontsize=9)
    axes[3].imshow(mask[-1], cmap="Greys_r")
    axes[3].set_title(f"shifted_window_mask, window {mask.shape[0] - 1} ({N}x{N}): white = allowed", fontsize=9)
    for ax in axes[:3]:
        ax.set_xticks([])
        ax.set_yticks([])
    t.save(fig, "swin-windows.png")


# --- 13. linear attention's memory ------------------------------------------------------------------------------------

@section("linear")
def linear(t: Tour) -> None:
    out = t.fresh("bench-attention")
    t.cli("bench", "attention", "--lengths", "512", "1024", "2048", "4096", "8192", "--mode", "both",
          "--repeats", "2", "--math-max-length", "4096", "--error-max-length", "2048", "--out", out)
    shutil.copy(out / "attention-bench.png", t.out / "linear-attention.png")
    for line in (out / "attention-bench.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) < 8 or not cells[2].isdigit() or "skipped" in cells[3]:
            continue
        mode, backend, length = cells[0], cells[1], int(cells[2])
        if length in (2048, 4096, 8192):
            key = f"{mode}_{backend}_{length}"
            t.record(f"{key}_ms", float(cells[3]))
            t.record(f"{key}_extra_mib", float(cells[4]))
            if cells[7] != "-":
                t.record(f"{key}_rel_error", float(cells[7]))


# --- 14. non-autoregressive vs autoregressive -------------------------------------------------------------------------

@section("nat")
def nat(t: Tour) -> None:
    run = t.fresh("ctc")
    t.cli("train", "configs/multi30k-de-en-ctc.yaml", "--out", run, "--set", "data.dir=data/multi30k",
          "--set", "train.max_steps=250", "--set", "train.max_minutes=4", "--set", "train.eval_every=0",
          "--set", "train.eval_batches=1", "--set", "data.bleu=false", "--set", "train.average_last=0",
          "--set", "train.keep_best=null", "--set", "train.checkpoint_every=0", "--set", "train.log_every=20")
    steps = [r for r in _metrics(run) if "elapsed_s" in r]
    t.record("ctc_steps", steps[-1]["step"])
    t.record("ctc_train_seconds", steps[-1]["elapsed_s"])
    out = t.fresh("bench-translate")
    t.cli("bench", "translate", MT_CKPT, run, "--split", "test2016", "--limit", "300", "--latency-sentences", "60",
          "--precision", "fp32", "--out", out)
    shutil.copy(out / "translate-bench.png", t.out / "nat-bench.png")
    for row in _csv_rows(out / "translate-bench.csv"):
        key = row["model"].replace(" ", "_").replace(",", "")
        for field in ("bleu", "latency_ms", "throughput", "speedup_vs_ar_beam5"):
            if row[field] not in ("", "None"):
                t.record(f"{key}_{field}", float(row[field]))


# --- 15. scaling laws -------------------------------------------------------------------------------------------------

@section("scaling")
def scaling(t: Tour) -> None:
    sweep = t.fresh("scaling")
    t.cli("sweep", "sweeps/scaling-shakespeare.yaml", "--out", sweep, "--set", "train.max_steps=300")
    t.cli("fit-scaling", sweep)
    report = json.loads((sweep / "scaling.json").read_text(encoding="utf-8"))
    for p in report["points"]:
        t.record(f"N{p['non_embedding_params']:.3g}_val_loss", p["val_loss"])
    t.record("tokens_per_run", report["points"][0]["tokens"])
    fit = report["fits"]["N"]
    t.record("alpha", fit["alpha"])
    t.record("alpha_ci", [round(v, 3) for v in fit["ci"].get("alpha", [])])
    t.record("fit", fit["summary"])
    shutil.copy(sweep / "scaling-params.png", t.out / "scaling-shrunk.png")


# --- the run ----------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="comma-separated section names (default: all)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "images" / "tour"), help="folder for the PNGs and JSON")
    parser.add_argument("--work", default=str(ROOT / "runs" / "tour"), help="folder for runs and command outputs")
    parser.add_argument("--list", action="store_true", help="print the section names and stop")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(SECTIONS))
        return 0
    names = list(SECTIONS) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {unknown[0]!r}; known: {', '.join(SECTIONS)}")
    tour = Tour(Path(args.out).resolve(), Path(args.work).resolve())
    tour.out.mkdir(parents=True, exist_ok=True)
    tour.work.mkdir(parents=True, exist_ok=True)
    from tokenloom.hardware import machine

    json_path = tour.out / "tour-figures.json"
    previous = json.loads(json_path.read_text(encoding="utf-8")) if json_path.is_file() and args.only else {}
    meta = previous.get("_meta", {})
    meta.update(machine=machine().describe(), torch=torch.__version__)
    seconds = meta.setdefault("section_seconds", {})
    loads = meta.setdefault("load_average_before_after", {})
    begin = time.perf_counter()
    for name in names:
        print(f"== {name}", flush=True)
        tour.section = name
        start, load = time.perf_counter(), os.getloadavg()[0]
        SECTIONS[name](tour)
        seconds[name] = round(time.perf_counter() - start, 1)
        loads[name] = [round(load, 2), round(os.getloadavg()[0], 2)]  # the machine is shared: timings depend on it
        print(f"   {name}: {seconds[name]:.0f} s (load average {loads[name][0]} -> {loads[name][1]})", flush=True)
    total = time.perf_counter() - begin
    if args.only is None:
        meta["total_seconds"] = round(total, 1)
    meta["date"] = datetime.date.today().isoformat()
    numbers = {k: v for k, v in previous.items() if k != "_meta"}
    numbers.update(tour.numbers)
    ordered = {"_meta": meta, **{k: numbers[k] for k in SECTIONS if k in numbers}}
    json_path.write_text(json.dumps(ordered, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {json_path}; {len(names)} section(s) in {total:.0f} s on {meta['machine']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``tokenloom distill`` (sequence-level knowledge distillation) and ``tokenloom bench translate`` (autoregressive
and non-autoregressive models measured side by side in one run)."""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..checkpoint import read_config
from ..config import from_dict
from ..errors import ConfigError
from ..files import write_atomic
from ..models.nat_kinds import NAT_KINDS
from ..models.registry import MODELS, decoding_of
from .commands import describe_decoding
from .loading import translation_model


def _data_config(config: dict):
    from ..tasks.nat import NATDataConfig
    from ..tasks.translation import TranslationDataConfig

    cls = NATDataConfig if config.get("task") == "nat_translation" else TranslationDataConfig
    return from_dict(cls, config.get("data") or {}, prefix="data")


def _write_lines(path: Path, lines: list[str]) -> None:
    write_atomic(path, lambda tmp: tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8"))


def _check_out(out: Path, data_dir: Path, force: bool) -> None:
    """``--out`` before any work: never the teacher's own data folder (its targets would be replaced), and a
    folder that already holds files only with ``--force``."""
    blocking = next((p for p in (out, *out.parents) if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise ConfigError(f"cannot write --out {out}: {blocking} is a file, not a folder")
    if out.resolve() == data_dir.resolve():
        raise ConfigError(f"--out {out} is the teacher's own data folder: distilling into it would replace its "
                          "reference translations; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"--out {out} already holds files (distill does not overwrite them): choose another "
                          "--out, e.g. under runs/, or add --force to replace the files it writes there")


def distill(args: argparse.Namespace) -> int:
    """Translate a split's sources with the teacher and write them with its translations as a new data folder
    (the other splits copied unchanged), line-aligned; an empty translation keeps the original target. An ``--out``
    that holds files is refused without ``--force``; the teacher's own data folder always."""
    from ..checkpoint import resolve_checkpoint
    from ..tasks.translation import translate
    from .progress import progress

    for name in ("beam", "chunk"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(args, name)}")
    data = _data_config(read_config(resolve_checkpoint(args.checkpoint)))
    out = Path(args.out)
    _check_out(out, Path(data.dir), args.force)  # before the teacher is loaded or a sentence translated
    ckpt, model, tokenizer = translation_model(args.checkpoint, args.precision, args.device)
    if decoding_of(model) == "parallel":
        raise ConfigError(f"{ckpt} is a non-autoregressive model; distill from an autoregressive teacher")
    pairs = data.read_pairs(args.split)  # (its files, or with data.format hf its table)
    if args.limit is not None:
        pairs = pairs[:args.limit]
    sources = [source for source, _ in pairs]
    start = time.perf_counter()
    hypotheses: list[str] = []
    with torch.inference_mode(), progress("distill", len(sources), "translated", "sentence") as done:
        for i in range(0, len(sources), args.chunk):
            hypotheses += translate(model, tokenizer, sources[i:i + args.chunk], beam=args.beam,
                                    max_tokens=args.max_tokens, progress=done)
    seconds = time.perf_counter() - start
    hypotheses = [" ".join(h.split()) for h in hypotheses]  # a line break inside one would break the alignment
    empty = [i for i, h in enumerate(hypotheses) if not h]
    for i in empty:
        hypotheses[i] = pairs[i][1]
    out.mkdir(parents=True, exist_ok=True)
    src_name, tgt_name = (Path(p).name for p in data.files(args.split))
    for name, lines in ((src_name, sources), (tgt_name, hypotheses)):
        _write_lines(out / name, lines)
    copied = []
    for split in data.splits:
        if split == args.split:
            continue
        if data.format == "hf":  # the teacher's tables: each other split written out as line-aligned files
            with tempfile.TemporaryDirectory(prefix="tokenloom-distill-") as folder:
                for path in data.aligned_files(split, Path(folder)):
                    write_atomic(out / path.name, lambda tmp, path=path: shutil.copyfile(path, tmp))
                    copied.append(path.name)
            continue
        for path in data.files(split):
            if Path(path).is_file():
                write_atomic(out / Path(path).name, lambda tmp, path=path: shutil.copyfile(path, tmp))
                copied.append(Path(path).name)
    notes = Path(data.dir) / "README.md"
    (out / "README.md").write_text(
        f"# Distilled {Path(data.dir).name} ({data.source_lang} -> {data.target_lang})\n\n"
        f"`{args.split}.{data.target_lang}` holds the translations of `{args.split}.{data.source_lang}` by the "
        f"teacher `{ckpt}` (beam {args.beam}), written by `tokenloom distill` on "
        f"{datetime.date.today().isoformat()}: {len(sources)} sentences in {seconds:.0f} s; {len(empty)} empty "
        f"translation(s) replaced by the original target. Other files are copies of `{data.dir}`: "
        f"{', '.join(copied) or 'none'}.\n\n"
        "Origin and licence of the source sentences and references: as for the original corpus"
        + (f" (its notes follow).\n\n---\n\n{notes.read_text(encoding='utf-8')}" if notes.is_file() else ".\n"),
        encoding="utf-8")
    print(f"distilled {len(sources)} {args.split} sentences with {ckpt} (beam {args.beam}) in {seconds:.0f} s -> "
          f"{out}; {len(empty)} empty translation(s) kept the original target", file=sys.stderr)
    return 0


# ---- bench translate --------------------------------------------------------------------------------

def _parallel_name(model) -> str:
    kind = NAT_KINDS.get(model.config.kind).name
    return f"GLAT {kind}" if model.config.glancing_ratio else kind


def _parallel_gap(model) -> str:
    kind = NAT_KINDS.get(model.config.kind)
    return kind.glancing_gap if model.config.glancing_ratio else kind.paper_gap


def _autoregressive_gap(model) -> str:
    """A Transformer with a deeper encoder than its one-layer decoder: deep-shallow's reported gap."""
    if type(model) is not MODELS.get("seq2seq")[1]:
        return ""
    deep_shallow = model.config.encoder_layers > model.config.decoder_layers == 1
    return "~0 against 6+6 (deep-shallow, Kasai et al. 2021)" if deep_shallow else ""


# an autoregressive family's name in the table (by its MODELS name; the Transformer, and any family not listed: AR)
AUTOREGRESSIVE_NAMES = {"rnn_seq2seq": lambda model: model.config.cell.upper()}  # LSTM, GRU


def _autoregressive_name(model) -> str:
    family = next((name for name in MODELS.names() if type(model) is MODELS.get(name)[1]), None)
    return AUTOREGRESSIVE_NAMES[family](model) if family in AUTOREGRESSIVE_NAMES else "AR"


# per decoding kind: the model's name in the table, and the decodings it contributes (translate's keyword arguments;
# rescore=True: with the autoregressive teacher as rescorer, offered when it shares the vocabulary)
BENCH_NAMES = {"encoder_decoder": _autoregressive_name, "parallel": _parallel_name,
               "semi_autoregressive": lambda model: f"SAT K={model.config.group_size}"}
# per decoding kind: the gap to the autoregressive model its paper reports, shown beside the measured one
PAPER_GAPS = {"encoder_decoder": _autoregressive_gap, "parallel": _parallel_gap,
              "semi_autoregressive": lambda model: "~1% of BLEU at K=2 (Wang et al. 2018)"}
BENCH_VARIANTS = {
    "encoder_decoder": lambda model, can_rescore: [dict(beam=1), dict(beam=5)],
    "parallel": lambda model, can_rescore: NAT_KINDS.get(model.config.kind).bench_variants(can_rescore),
    "semi_autoregressive": lambda model, can_rescore: [dict(beam=1)],  # greedy within groups
}


def _variants(model, can_rescore: bool) -> list[dict]:
    """The decodings a model contributes to the table: greedy and beam 5 for an autoregressive one, its kind's
    (``NATKind.bench_variants``) for a non-autoregressive one, greedy (within groups) for a semi-autoregressive
    one."""
    return BENCH_VARIANTS[decoding_of(model)](model, can_rescore)


def _model_names(models: list) -> list[str]:
    """Each model's name in the table (``BENCH_NAMES``: AR, NAT, GLAT NAT, CMLM, SAT K=2, ...); names that more
    than one model of the run would share get the layers (``AR 6+1``), then the run's folder."""
    names = [BENCH_NAMES[decoding_of(model)](model) for _, model, _ in models]
    for add in (lambda ckpt, m: f"{m.config.encoder_layers}+{m.config.decoder_layers}",
                lambda ckpt, m: Path(ckpt).name):
        shared = {n for n in names if names.count(n) > 1}
        names = [f"{n} {add(ckpt, m)}" if n in shared else n for n, (ckpt, m, _) in zip(names, models, strict=True)]
    return names


def _label(model, options: dict, name: str | None = None) -> str:
    return f"{name or BENCH_NAMES[decoding_of(model)](model)} {describe_decoding(options)}"


def _pareto(rows: list[dict]) -> list[bool]:
    """Which rows are on the speed/quality Pareto frontier: no other row is as fast (batch-1 latency) and better
    (BLEU), or faster and as good."""
    return [not any(o is not r and o["latency_ms"] <= r["latency_ms"] and o["bleu"] >= r["bleu"]
                    and (o["latency_ms"] < r["latency_ms"] or o["bleu"] > r["bleu"]) for o in rows) for r in rows]


LATENCY_ROUNDS = 5  # bench translate: the latency sentences are split into this many blocks, timed in turns


def bench_translate(args: argparse.Namespace) -> int:
    """BLEU / chrF on a split, latency per sentence at batch 1, throughput at batch ``--batch``, speedup over AR
    beam 5; every model and decoding measured in this one run (the latencies in turns: ``LATENCY_ROUNDS`` blocks of
    sentences, each block by every decoding). Markdown and CSV (and a PNG) under --out."""
    for name in ("batch", "latency_sentences"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    models = [translation_model(path, args.precision, args.device) for path in args.runs]
    sources, references = _bench_split(models, args.split, args.limit)
    teacher, teacher_tokenizer = next(((m, t) for _, m, t in models if decoding_of(m) == "encoder_decoder"),
                                      (None, None))
    runs = []  # (checkpoint, model, tokenizer, options, label) per decoding measured
    reference = {}  # "beam5" / "greedy": the index in runs of the first autoregressive model's decodings
    for (ckpt, model, tokenizer), name in zip(models, _model_names(models), strict=True):
        shares_vocabulary = teacher is not None and tokenizer.fingerprint == teacher_tokenizer.fingerprint
        for variant in _variants(model, shares_vocabulary):
            options = {k: v for k, v in variant.items() if k != "rescore"}
            if variant.get("rescore"):
                options["rescorer"] = teacher
            if model is teacher:
                reference.setdefault({5: "beam5", 1: "greedy"}.get(options.get("beam"), "other"), len(runs))
            runs.append((ckpt, model, tokenizer, options, _label(model, options, name)))
    latency_set = sources[:args.latency_sentences]
    torch.manual_seed(0)
    with torch.inference_mode():
        rows = [_bench_quality(run, sources, references, latency_set, args.batch) for run in runs]
        latencies = _bench_latencies(runs, latency_set)
    for row, seconds in zip(rows, latencies, strict=True):
        row["latency_ms"] = round(1000 * statistics.mean(seconds), 2)
        print(f"  {row['model']:<38} {row['latency_ms']:8.1f} ms/sentence (batch 1)", file=sys.stderr, flush=True)
    beam5, greedy = (rows[reference[k]] if k in reference else None for k in ("beam5", "greedy"))
    for r in rows:
        r["bleu_vs_ar_beam5"] = round(r["bleu"] - beam5["bleu"], 2) if beam5 else None
        r["speedup_vs_ar_beam5"] = round(beam5["latency_ms"] / r["latency_ms"], 2) if beam5 else None
        r["speedup_vs_ar_greedy"] = round(greedy["latency_ms"] / r["latency_ms"], 2) if greedy else None
    for r, front in zip(rows, _pareto(rows), strict=True):
        r["pareto"] = "yes" if front else ""
    _bench_report(rows, args, len(sources), len(latency_set))
    return 0


def _bench_split(models: list, split: str, limit: int | None) -> tuple[list[str], list[str]]:
    """The (sources, references) of ``split`` in the first model's data (each model's data must have the split)."""
    sources = references = None
    for ckpt, _, _ in models:
        data = _data_config(read_config(ckpt))
        if data.format != "hf" and not Path(data.files(split)[0]).is_file():  # (a table: its reader names it)
            raise ConfigError(f"{ckpt}: its data has no {split!r} split ({data.files(split)[0]})")
        if sources is None:
            pairs = data.read_pairs(split)
            if limit is not None:
                pairs = pairs[:limit]
            sources, references = [p[0] for p in pairs], [p[1] for p in pairs]
    return sources, references


def _bench_quality(run: tuple, sources: list[str], references: list[str], warm: list[str], batch: int) -> dict:
    """One decoding's BLEU, chrF and throughput over the whole split at ``batch`` sentences (shortest first)."""
    from ..evaluation import compute_metrics
    from ..tasks.translation import translate

    ckpt, model, tokenizer, options, label = run
    translate(model, tokenizer, warm[:2], **options)  # warm-up
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    start = time.perf_counter()
    hypotheses = [""] * len(sources)
    rounds: list[int] = []  # decoder passes per sentence (translate's rounds)
    for i in range(0, len(order), batch):
        chunk = order[i:i + batch]
        for j, h in zip(chunk, translate(model, tokenizer, [sources[k] for k in chunk], **options,
                                         max_tokens=1 << 30, rounds=rounds), strict=True):
            hypotheses[j] = h
    seconds = time.perf_counter() - start
    scores = compute_metrics(["bleu", "chrf"], hypotheses, references).scores
    row = dict(run=str(ckpt), model=label, bleu=round(scores["bleu"], 2), chrf=round(scores["chrf"], 2),
               throughput=round(len(sources) / seconds, 1),
               rounds=round(statistics.mean(rounds), 2) if rounds else None,
               tokens=round(statistics.mean(len(tokenizer.encode(h)) for h in hypotheses), 2),
               paper_gap=PAPER_GAPS[decoding_of(model)](model) or None)
    print(f"  {label:<38} BLEU {row['bleu']:6.2f}  chrF {row['chrf']:6.2f}  "
          f"{row['throughput']:8.1f} sentences/s (batch {batch})", file=sys.stderr, flush=True)
    return row


def _bench_latencies(runs: list[tuple], latency_set: list[str]) -> list[list[float]]:
    """Batch-1 seconds per sentence of every decoding, in ``LATENCY_ROUNDS`` rounds: each decoding translates a
    block of the sentences one at a time in turn (after one untimed sentence that brings its weights back into the
    caches), so that drifts in the machine's speed (other load, clock) fall on all of them alike and the speedups
    compare like with like, while each is timed as it runs when serving: warm."""
    from ..tasks.translation import translate

    latencies: list[list[float]] = [[] for _ in runs]
    size = -(-len(latency_set) // LATENCY_ROUNDS)
    for start in range(0, len(latency_set), size):
        block = latency_set[start:start + size]
        for n, (_, model, tokenizer, options, _) in enumerate(runs):
            translate(model, tokenizer, block[:1], **options)
            for sentence in block:
                t0 = time.perf_counter()
                translate(model, tokenizer, [sentence], **options)
                latencies[n].append(time.perf_counter() - t0)
    return latencies


def _bench_report(rows: list[dict], args: argparse.Namespace, sentences: int, latency_sentences: int) -> None:
    """The table on stdout; with ``--out``, translate-bench.md, .csv and .png there."""
    from ..hardware import machine

    header = ["model", "bleu", "bleu_vs_ar_beam5", "paper_gap", "chrf", "latency_ms", "throughput",
              "speedup_vs_ar_beam5", "speedup_vs_ar_greedy", "rounds", "tokens", "pareto", "run"]
    titles = ["model / decoding", "BLEU", "BLEU vs AR beam 5", "the paper's gap (WMT14, distilled)", "chrF",
              f"ms/sentence (batch 1, {latency_sentences} sent.)",
              f"sentences/s (batch {args.batch})", "speedup vs AR beam 5 (batch 1)", "speedup vs AR greedy (batch 1)",
              "decoder passes/sentence", "tokens/sentence", "Pareto", "run"]
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    lines += ["| " + " | ".join(str(r[k]) if r[k] is not None else "-" for k in header) + " |" for r in rows]
    table = "\n".join(lines)
    described, date = machine().describe(), datetime.date.today().isoformat()
    print(f"{args.split}: {sentences} sentences, {args.precision}\n{described}\n\n{table}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "translate-bench.md").write_text(f"{table}\n\nMeasured on: {described}, {date}\n", encoding="utf-8")
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=[*header, "machine", "date"])
        writer.writeheader()
        writer.writerows({**r, "machine": described, "date": date} for r in rows)
        (out / "translate-bench.csv").write_text(buffer.getvalue(), encoding="utf-8")
        _scatter(rows, out / "translate-bench.png")


def _scatter(rows: list[dict], path: Path) -> None:
    from .plotting import pyplot

    plt = pyplot("speed/quality plot")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        front = r["pareto"] == "yes"
        ax.scatter(r["latency_ms"], r["bleu"], marker="*" if front else "o", s=90 if front else 30)
        ax.annotate(r["model"], (r["latency_ms"], r["bleu"]), textcoords="offset points", xytext=(4, 4),
                    fontsize=7)
    front = sorted((r["latency_ms"], r["bleu"]) for r in rows if r["pareto"] == "yes")
    if front:
        ax.step([x for x, _ in front], [y for _, y in front], where="post", color="black", alpha=0.4, linewidth=1,
                label="Pareto frontier (no row faster and better)")
        ax.legend(fontsize=7, loc="lower right")
    ax.set_xscale("log")
    ax.set_xlabel("latency per sentence at batch 1 (ms, log scale)")
    ax.set_ylabel("BLEU")
    ax.set_title("speed / quality (stars: the Pareto frontier)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

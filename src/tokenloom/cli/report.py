"""``tokenloom report RUN``: one self-contained ``report.html`` of a run — summary and final metrics, training
curves, samples, the causal check and head diagnostics, attention maps, the config (:mod:`tokenloom.viz.report`).
A part that cannot be made (no metrics file, no image given to an image model) says so on the page."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import yaml

from ..errors import ConfigError, TokenloomError
from ..metric_scope import scoped_name
from ..viz import capture_attention, plots
from ..viz.report import Section, image, note, pre, render, table
from .viz import Loaded, entropy_tables, lm_ids, read_metrics, run_checks, token_labels, translation_pair, vit_image

DEFAULT_SOURCE = "Ein Hund rennt durch das Gras."


def report(args: argparse.Namespace) -> int:
    run = Path(args.run)
    loaded = Loaded(run, args.device)
    run_dir = loaded.ckpt.parent if loaded.ckpt.name == "checkpoint" else run
    out = Path(args.out) if args.out else run_dir / "report.html"
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        sections = [summary(loaded, run_dir), curves(run_dir, tmp_dir)]
        sections += samples_and_attention(loaded, args, tmp_dir)
        sections.append(Section("Config", pre(yaml.safe_dump(loaded.config, sort_keys=False))))
        page = render(f"tokenloom run: {loaded.name}", sections, subtitle=str(loaded.ckpt))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(out.name + ".tmp")
    tmp_out.write_text(page, encoding="utf-8")
    tmp_out.replace(out)  # never a half-written report
    print(f"wrote {out} ({len(page) / 1e6:.1f} MB, {page.count('<img ')} images)")
    return 0


def summary(loaded: Loaded, run_dir: Path) -> Section:
    params = sum(p.numel() for p in loaded.model.parameters())
    rows = [["task", loaded.config.get("task", "lm")], ["model family", loaded.family],
            ["parameters", f"{params:,}"]]
    try:
        metrics = read_metrics(run_dir)
    except ConfigError:
        metrics = []
    train = [r for r in metrics if "loss" in r]
    evals = [r for r in metrics if any(k.startswith("val_") for k in r)]
    if train:
        # the run's final step: validation runs at the last step, while the training lines come every log_every
        # steps (a run of 574 steps logs its last loss at step 570)
        last, final = train[-1], final_step(metrics)
        loss_name = "last training loss" + ("" if last.get("step") == final else f" (step {last.get('step')})")
        rows += [["steps", final if final is not None else ""], [loss_name, last["loss"]]]
        seconds = training_seconds(train)
        if seconds is not None:
            rows.append(["training time (s)", seconds])
    if evals:  # named by the part of the validation split training evaluated (val_loss[20 of 28 batches])
        for key, value in evals[-1].items():
            if key.startswith("val_"):
                rows.append([f"{scoped_name(key, evals[-1])} (step {evals[-1].get('step', '?')})", value])
    return Section("Summary", table(["", ""], rows, text_columns=(0, 1)))


def final_step(records: list[dict]) -> int | None:
    """The last step any record of ``metrics.jsonl`` names (a training line or an evaluation)."""
    steps = [r["step"] for r in records if isinstance(r.get("step"), int) and not isinstance(r.get("step"), bool)]
    return max(steps) if steps else None


def training_seconds(records: list[dict]) -> float | None:
    """The training time of a run over every segment it was resumed in: each segment's ``elapsed_s`` counts from
    its own start, so a drop marks a resume and the segments' last values are summed. None without the field."""
    total, previous = 0.0, None
    for record in records:
        elapsed = record.get("elapsed_s")
        if not isinstance(elapsed, int | float):
            continue
        if previous is not None and elapsed < previous:  # a resumed segment starts its clock again
            total += previous
        previous = elapsed
    return None if previous is None else round(total + previous, 2)


def curves(run_dir: Path, tmp: Path) -> Section:
    try:
        rows = read_metrics(run_dir)
        path = plots.plot_curves({run_dir.name: rows}, tmp / "curves.png")
    except ConfigError as err:
        return Section("Training curves", note(f"no curves: {err}"))
    return Section("Training curves", image(path, "training curves"))


def samples_and_attention(loaded: Loaded, args: argparse.Namespace, tmp: Path) -> list[Section]:
    try:
        if loaded.family == "gpt":
            return _gpt(loaded, args, tmp)
        if loaded.family == "seq2seq":
            return _seq2seq(loaded, args, tmp)
        return _vit(loaded, args, tmp)
    except TokenloomError as err:
        return [Section("Samples and attention", note(f"not available: {err}", "bad"))]


def _checks(loaded: Loaded, tmp: Path, **inputs) -> Section:
    results = run_checks(loaded, **inputs)
    parts = []
    if results["causal"]:
        bad = [c for c in results["causal"] if not c["passed"]]
        parts.append(note("causal check: every layer puts exactly zero mass on later positions (padding included)",
                          "ok") if not bad else note(f"causal check FAILED in {len(bad)} layer(s)", "bad"))
        parts.append(table(["kind", "layer", "mass above diagonal", "leaking heads"],
                           [[c["kind"], c["layer"], c["max_mass_above_diagonal"], str(c["leaking_heads"])]
                            for c in results["causal"]]))
    flagged = [h for h in results["heads"] if h["flags"]]
    parts.append(note(f"{len(flagged)} of {len(results['heads'])} heads flagged (near-uniform: normalised entropy "
                      ">= 0.9; collapsed: mean top probability >= 0.9)"))
    parts.append(table(["kind", "layer", "head", "entropy", "normalised", "max p", "previous", "first", "diagonal",
                        "flags"],
                       [[h["kind"], h["layer"], h["head"], h["entropy"], h["normalized_entropy"], h["max_prob"],
                         h["previous_token"], h["first_token"], h["diagonal"], ", ".join(h["flags"])]
                        for h in results["heads"]], text_columns=(0, 9)))
    for kind, values in entropy_tables(results).items():
        parts.append(image(plots.plot_diagnostics(values, tmp / f"entropy-{kind}.png",
                                                  title=f"{kind}: normalised entropy per head"),
                           f"{kind} head entropy"))
    return Section("Causal check and head diagnostics", "".join(parts))


def _gpt(loaded: Loaded, args: argparse.Namespace, tmp: Path) -> list[Section]:
    from ..generation import GenerationConfig, generate

    prompt = args.text if args.text is not None else "\n"
    ids = lm_ids(loaded, prompt, "truncate")
    room = loaded.model.config.max_seq_len - ids.shape[1]
    texts = []
    for i in range(2):
        config = GenerationConfig(max_new_tokens=max(1, min(200, room)), temperature=0.8, top_k=40,
                                  seed=args.seed + i)
        out = generate(loaded.model, ids, config)[0].tolist()
        texts.append(loaded.tokenizer.decode(out))
    samples = Section("Samples", note(f"prompt {prompt!r}; temperature 0.8, top-k 40, seeds {args.seed} and "
                                      f"{args.seed + 1}") + "".join(pre(t) for t in texts))
    look = lm_ids(loaded, texts[0], "truncate")[:, :48]  # the first sample's start, as tokens
    layers = sorted({0, len(loaded.model.blocks) - 1})
    with torch.no_grad(), capture_attention(loaded.model, layers, ["self"]) as maps:
        loaded.model(look)
    labels = token_labels(loaded.tokenizer, look[0].tolist())
    grid = plots.plot_head_grid({i: maps.get("self", i)[0] for i in layers}, tmp / "attention.png", labels, labels,
                                title="self-attention on the first sample's start")
    attention = Section("Attention maps", note(f"layers {', '.join(map(str, layers))}, every head; rows: queries, "
                                               "columns: keys") + image(grid, "self-attention heads"))
    return [samples, attention, _checks(loaded, tmp, text=texts[0])]


def _seq2seq(loaded: Loaded, args: argparse.Namespace, tmp: Path) -> list[Section]:
    source = args.source or DEFAULT_SOURCE
    pair = translation_pair(loaded, source, None, "truncate")
    with torch.no_grad(), capture_attention(loaded.model, [-1], ["cross"]) as maps:
        loaded.model(pair["source"], pair["target_in"])
    layer = maps.layers("cross")[0]
    path = plots.plot_alignment(maps.get("cross", layer)[0].mean(0), tmp / "alignment.png", pair["source_labels"],
                                pair["target_labels"], title=f"cross-attention, layer {layer}, mean of heads")
    samples = Section("Samples", table(["source", "greedy translation"], [[source, pair["translation"]]],
                                       text_columns=(0, 1)))
    attention = Section("Attention maps", image(path, "cross-attention alignment"))
    return [samples, attention, _checks(loaded, tmp, source=source)]


def _vit(loaded: Loaded, args: argparse.Namespace, tmp: Path) -> list[Section]:
    from ..viz import attention_rollout

    if args.image is None:
        return [Section("Attention maps", note("pass --image to add an attention rollout and head diagnostics"))]
    x = vit_image(loaded, args.image, False)
    with torch.no_grad(), capture_attention(loaded.model, kinds=["self"]) as maps:
        logits = loaded.model.forward_head(loaded.model.forward_features(x))
    probs = logits.float().softmax(-1)[0]
    classes = (loaded.config.get("data") or {}).get("classes") or [str(i) for i in range(probs.numel())]
    top = probs.topk(min(3, probs.numel()))
    samples = Section("Samples", table(["image", "class", "probability"],
                                       [[Path(args.image).name, classes[i], p] for p, i in
                                        zip(top.values.tolist(), top.indices.tolist(), strict=True)],
                                       text_columns=(0, 1)))
    rollout = attention_rollout([maps.get("self", i) for i in maps.layers("self")])[0]
    gh, gw = loaded.model.patch_embed.grid_size(*x.shape[-2:])
    heat = rollout[0, 1:] if loaded.model.cls_token is not None else rollout.mean(0)
    path = plots.plot_rollout(x[0], heat.reshape(gh, gw), tmp / "rollout.png")
    return [samples, Section("Attention maps", image(path, "attention rollout")),
            _checks(loaded, tmp, image=args.image)]


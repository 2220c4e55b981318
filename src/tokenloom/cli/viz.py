"""``tokenloom viz attention | check | curves | ponder`` and ``tokenloom report``: attention maps, the causal check
and head diagnostics, training curves, ponder maps, and the run report, from checkpoints and run directories."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..checkpoint import load_model, load_tokenizer, read_config, resolve_checkpoint
from ..errors import ConfigError, GenerationError
from ..viz import attention_rollout, capture_attention, causal_check, head_diagnostics, plots

METRICS_FILE = "metrics.jsonl"


# --- loading ----------------------------------------------------------------------------------------------------------

ATTENTION_FAMILIES = ("gpt", "seq2seq", "vit")  # the families viz attention and viz check capture


class Loaded:
    """A checkpoint's model (eval, float32), config, family and tokenizer (None for models that do not decode text:
    image models). ``families``: the families accepted (None: any)."""

    def __init__(self, run: str | Path, device: str = "cpu",
                 families: tuple[str, ...] | None = ATTENTION_FAMILIES) -> None:
        from ..models.registry import decoding_of
        from .loading import command_device

        self.device = command_device(device).device  # an unknown device fails before the checkpoint is read
        self.ckpt = resolve_checkpoint(run)
        self.config = read_config(self.ckpt)
        self.family = (self.config.get("model") or {}).get("family", "gpt")
        if families is not None and self.family not in families:
            raise ConfigError(f"{self.ckpt} holds a {self.family!r} model; viz supports gpt, seq2seq and vit "
                              "checkpoints (Swin's window attention and NAT decoding are not captured)")
        self.model, _ = load_model(self.ckpt, device=self.device)
        self.tokenizer = load_tokenizer(self.ckpt) if decoding_of(self.model) is not None else None
        # a run directory's checkpoint is RUN/checkpoint: name the run
        self.name = self.ckpt.parent.name if self.ckpt.name == "checkpoint" else self.ckpt.name


def token_labels(tokenizer, ids: list[int]) -> list[str]:
    """Each id's own text (special tokens by name)."""
    labels = []
    for i in ids:
        text = tokenizer.decode([i])
        labels.append(text if text else (tokenizer.backend.id_to_token(i) or str(i)))
    return labels


def lm_ids(loaded: Loaded, text: str, too_long: str) -> Tensor:
    """(1, T) ids of ``text`` for a GPT; longer than the context: truncated (with a note) or refused."""
    ids = loaded.tokenizer.encode(text)
    if not ids:
        raise ConfigError("--text is empty after tokenization; give some text")
    context = loaded.model.config.max_seq_len
    if len(ids) > context:
        if too_long == "error":
            raise GenerationError(f"--text is {len(ids)} tokens, longer than the model's context of {context}; "
                                  f"shorten it or pass --too-long truncate (keeps the first {context})")
        print(f"note: --text is {len(ids)} tokens; kept the first {context} (the model's context)", file=sys.stderr)
        ids = ids[:context]
    return torch.tensor([ids], device=loaded.device)


def translation_pair(loaded: Loaded, source: str, target: str | None, too_long: str) -> dict[str, Any]:
    """Source ids (with EOS), decoder input (BOS + target; the greedy translation when ``target`` is None) and
    their token labels."""
    from ..generation import GenerationConfig, generate
    from ..tasks.translation import encode_sources, special_ids

    tok, model = loaded.tokenizer, loaded.model
    ids = special_ids(tok)
    src = encode_sources(model, tok, [source], truncate=too_long == "truncate")[0]
    if target is None:
        decoder = model.decoder_for(torch.tensor([src], device=loaded.device))
        limit = min(model.config.max_target_len - 1, int(1.5 * len(src)) + 10)
        config = GenerationConfig(max_new_tokens=limit, do_sample=False, eos_token_id=ids["eos_id"],
                                  pad_token_id=ids["pad_id"])
        with torch.inference_mode():
            out = generate(decoder, torch.tensor([[ids["bos_id"]]], device=loaded.device), config)[0, 1:].tolist()
        tgt = [t for t in out if t != ids["pad_id"]]
    else:
        tgt = tok.encode(target)[:model.config.max_target_len - 1] + [ids["eos_id"]]
    tgt_in = [ids["bos_id"]] + tgt[:-1] if tgt and tgt[-1] == ids["eos_id"] else [ids["bos_id"]] + tgt
    on = loaded.device
    return dict(source=torch.tensor([src], device=on), target_in=torch.tensor([tgt_in], device=on),
                source_labels=token_labels(tok, src), target_labels=token_labels(tok, tgt_in[1:] + tgt[-1:]),
                translation=tok.decode([t for t in tgt if t != ids["eos_id"]]))


def vit_image(loaded: Loaded, image: str, invert: bool) -> Tensor:
    from ..tasks.image import read_images

    return read_images([image], loaded.config.get("data") or {}, invert=invert).to(loaded.device)  # (1, C, H, W)


def _vit_labels(model, images: Tensor) -> list[str]:
    """Token labels of a ViT's sequence: ``cls`` (if any) and ``r,c`` per patch."""
    gh, gw = model.patch_embed.grid_size(*images.shape[-2:])
    labels = [f"{r},{c}" for r in range(gh) for c in range(gw)]
    return (["cls"] + labels) if model.cls_token is not None else labels


# --- viz attention ----------------------------------------------------------------------------------------------------

def attention(args: argparse.Namespace) -> int:
    loaded = Loaded(args.checkpoint, args.device)
    out = Path(args.out)
    layers = args.layers
    if loaded.family == "gpt":
        if args.text is None:
            raise ConfigError("a language model needs --text to look at")
        ids = lm_ids(loaded, args.text, args.too_long)
        with torch.no_grad(), capture_attention(loaded.model, layers, ["self"]) as maps:
            loaded.model(ids)
        labels = token_labels(loaded.tokenizer, ids[0].tolist())
        grid = {i: maps.get("self", i)[0] for i in maps.layers("self")}
        plots.plot_head_grid(grid, out, labels, labels, title=f"{loaded.name}: self-attention",
                             heads=_heads(args.heads, grid))
    elif loaded.family == "seq2seq":
        if args.source is None:
            raise ConfigError("a translation model needs --source (the sentence to translate)")
        pair = translation_pair(loaded, args.source, args.target, args.too_long)
        kind = "cross" if args.cross else args.kind or "encoder"
        with torch.no_grad(), capture_attention(loaded.model, layers if layers is not None else
                                                ([-1] if kind == "cross" else None), [kind]) as maps:
            loaded.model(pair["source"], pair["target_in"])
        if kind == "cross":
            chosen = maps.layers("cross")
            probs = torch.stack([maps.get("cross", i)[0].mean(0) for i in chosen]).mean(0)  # (Tt, Ts)
            plots.plot_alignment(probs, out, pair["source_labels"], pair["target_labels"],
                                 title=f"cross-attention, layer{'s' if len(chosen) > 1 else ''} "
                                       f"{', '.join(map(str, chosen))}, mean of heads")
        else:
            q_labels = pair["source_labels"] if kind == "encoder" else ["<s>"] + pair["target_labels"][:-1]
            grid = {i: maps.get(kind, i)[0] for i in maps.layers(kind)}
            plots.plot_head_grid(grid, out, q_labels, q_labels, title=f"{kind} self-attention",
                                 heads=_heads(args.heads, grid))
        print(f"translation: {pair['translation']}")
    else:  # vit
        if args.image is None:
            raise ConfigError("an image model needs --image")
        x = vit_image(loaded, args.image, args.invert)
        with torch.no_grad(), capture_attention(loaded.model, None if args.rollout else layers, ["self"]) as maps:
            loaded.model.forward_features(x)
        if args.rollout:
            rollout = attention_rollout([maps.get("self", i) for i in maps.layers("self")])[0]  # (T, T)
            grid_hw = loaded.model.patch_embed.grid_size(*x.shape[-2:])  # (Gh, Gw)
            heat = rollout[0, 1:] if loaded.model.cls_token is not None else rollout.mean(0)
            plots.plot_rollout(x[0], heat.reshape(grid_hw), out)
        else:
            grid = {i: maps.get("self", i)[0] for i in maps.layers("self")}
            labels = _vit_labels(loaded.model, x)
            plots.plot_head_grid(grid, out, labels, labels, title="ViT self-attention", heads=_heads(args.heads, grid))
    print(f"wrote {out}")
    return 0


def _heads(heads: list[int] | None, grid: dict[int, Tensor]) -> list[int] | None:
    if heads is None:
        return None
    H = next(iter(grid.values())).shape[0]
    for h in heads:
        if not 0 <= h < H:
            raise ConfigError(f"head {h} is out of range: the model has {H} heads (0..{H - 1})")
    return heads


# --- viz check --------------------------------------------------------------------------------------------------------

DEFAULT_TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun."


def check_maps(loaded: Loaded, text: str | None, source: str | None, image: str | None,
               too_long: str = "truncate") -> list[tuple[str, int, Tensor, Tensor | None, Tensor | None, bool]]:
    """(kind, layer, probs (B, H, Tq, Tk), query mask, key mask, causal) for every attention layer: for a GPT
    on a padded batch of two rows (the text, and its first half left-padded), so padding is checked too."""
    model = loaded.model
    out = []
    if loaded.family == "gpt":
        ids = lm_ids(loaded, text or DEFAULT_TEXT, too_long)[0]
        half = ids[: max(1, len(ids) // 2)]
        batch = torch.zeros(2, len(ids), dtype=torch.long, device=ids.device)
        mask = torch.zeros(2, len(ids), dtype=torch.long, device=ids.device)
        batch[0], mask[0] = ids, 1
        batch[1, len(ids) - len(half):], mask[1, len(ids) - len(half):] = half, 1
        with torch.no_grad(), capture_attention(model, kinds=["self"]) as maps:
            model(batch, attention_mask=mask)
        for i in maps.layers("self"):
            out.append(("self", i, maps.get("self", i), mask, mask, True))
    elif loaded.family == "seq2seq":
        pair = translation_pair(loaded, source or "Ein Hund rennt durch das Gras.", None, too_long)
        with torch.no_grad(), capture_attention(model) as maps:
            model(pair["source"], pair["target_in"])
        for kind in maps.kinds():
            for i in maps.layers(kind):
                out.append((kind, i, maps.get(kind, i), None, None, kind == "decoder"))
    else:
        if image is None:
            raise ConfigError("viz check on an image model needs --image")
        with torch.no_grad(), capture_attention(model) as maps:
            model.forward_features(vit_image(loaded, image, False))
        for i in maps.layers("self"):
            out.append(("self", i, maps.get("self", i), None, None, False))
    return out


def check(args: argparse.Namespace) -> int:
    loaded = Loaded(args.checkpoint, args.device)
    results = run_checks(loaded, args.text, args.source, args.image, args.too_long)
    print_checks(results)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "head-diagnostics.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
        for kind, values in entropy_tables(results).items():
            plots.plot_diagnostics(values, out / f"head-entropy-{kind}.png",
                                   title=f"{kind}: normalised entropy per head")
        print(f"wrote {out / 'head-diagnostics.json'} and the entropy PNGs")
    return 0 if all(c["passed"] for c in results["causal"]) else 1


def run_checks(loaded: Loaded, text=None, source=None, image=None, too_long: str = "truncate") -> dict:
    """The causal check of every causal layer and the diagnostics of every head, as JSON-ready data."""
    causal, heads = [], []
    for kind, layer, probs, query_mask, key_mask, is_causal in check_maps(loaded, text, source, image, too_long):
        if is_causal:
            result = causal_check(probs, layer, query_mask=query_mask)
            causal.append(dict(kind=kind, layer=layer, max_mass_above_diagonal=result.max_mass,
                               leaking_heads=result.heads, passed=result.passed))
        for stats in head_diagnostics(probs, layer, query_mask=query_mask, key_mask=key_mask, causal=is_causal):
            heads.append(dict(kind=kind, **stats.as_dict()))
    return dict(checkpoint=str(loaded.ckpt), causal=causal, heads=heads)


def entropy_tables(results: dict) -> dict[str, Tensor]:
    tables: dict[str, dict[int, dict[int, float]]] = {}
    for h in results["heads"]:
        tables.setdefault(h["kind"], {}).setdefault(h["layer"], {})[h["head"]] = h["normalized_entropy"]
    return {kind: torch.tensor([[row[h] for h in sorted(row)] for _, row in sorted(layers.items())])
            for kind, layers in tables.items()}


def print_checks(results: dict) -> None:
    if results["causal"]:
        print("causal check (mass any real query puts on later positions; must be exactly 0):")
        for c in results["causal"]:
            verdict = "ok" if c["passed"] else f"LEAKS (heads {c['leaking_heads']})"
            print(f"  {c['kind']} layer {c['layer']}: {c['max_mass_above_diagonal']:.3g}  {verdict}")
    else:
        print("causal check: no causal layers (bidirectional model)")
    print(f"\n{'kind':<8} {'layer':>5} {'head':>4} {'entropy':>8} {'norm.':>6} {'max p':>6} {'prev':>6} {'first':>6} "
          f"{'diag':>6}  flags")
    for h in results["heads"]:
        print(f"{h['kind']:<8} {h['layer']:>5} {h['head']:>4} {h['entropy']:>8.3f} {h['normalized_entropy']:>6.3f} "
              f"{h['max_prob']:>6.3f} {h['previous_token']:>6.3f} {h['first_token']:>6.3f} {h['diagonal']:>6.3f}  "
              f"{', '.join(h['flags'])}")


# --- viz curves -------------------------------------------------------------------------------------------------------

def read_metrics(run: str | Path) -> list[dict]:
    """The rows of a run directory's ``metrics.jsonl``; a missing or empty file is a one-line error."""
    run = Path(run)
    path = run / METRICS_FILE
    if not run.is_dir():
        raise ConfigError(f"{run} is not a run directory")
    if not path.is_file():
        raise ConfigError(f"{run} has no {METRICS_FILE} (tokenloom train writes one into its run directory); "
                          "nothing to plot")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                print(f"note: {path}:{n} is not JSON (a line cut off by an interrupted run?); skipped", file=sys.stderr)
    if not rows:
        raise ConfigError(f"{path} is empty: the run logged no steps yet")
    return rows


def curves(args: argparse.Namespace) -> int:
    runs = {_run_name(r, args.runs): read_metrics(r) for r in args.runs}
    path = plots.plot_curves(runs, args.out)
    print(f"wrote {path}")
    return 0


def _run_name(run: str, all_runs: list[str]) -> str:
    names = [Path(r).resolve().name for r in all_runs]
    name = Path(run).resolve().name
    return name if names.count(name) == 1 else str(run)


# --- viz ponder -------------------------------------------------------------------------------------------------------

PONDER_FORMATS = (".png", ".html")


def ponder(args: argparse.Namespace) -> int:
    from ..models.registry import ponders
    from ..viz.ponder import check_ponders, format_summary, ponder_summary, render_html, tokens_ponder

    out = Path(args.out)
    if out.suffix.lower() not in PONDER_FORMATS:
        raise ConfigError(f"--out {out}: write a .png or an .html file (the format follows the extension)")
    text = ponder_text(args.text, args.text_file)
    loaded = Loaded(args.checkpoint, args.device, families=None)
    if not ponders(loaded.model):
        raise ConfigError(f"{loaded.ckpt} holds a {loaded.family!r} model, which does not ponder (no adaptive "
                          "computation time); viz ponder needs a model declared with ACT (family universal)")
    check_ponders(loaded.model)  # (a language model)
    if args.too_long == "chunk":
        ids = loaded.tokenizer.encode(text)
        if not ids:
            raise ConfigError("the text is empty after tokenization; give some text")
        context = loaded.model.config.max_seq_len
        if len(ids) > context:
            print(f"note: the text is {len(ids)} tokens, longer than the model's context of {context}: run in windows "
                  f"of {context} advancing by {context // 2}, each token scored in the first window that holds it",
                  file=sys.stderr)
        ids = torch.tensor(ids, device=loaded.device)
    else:
        ids = lm_ids(loaded, text, args.too_long)[0]
    pieces, values, unit = tokens_ponder(loaded.model, loaded.tokenizer, ids)  # values: (T,)
    summary = ponder_summary(pieces, values)
    steps = loaded.model.config.max_steps
    print(f"{loaded.name}: ponder count N + R of {len(pieces)} {unit}s (max_steps {steps}: N + R lies in "
          f"(1, {steps + 1}])")
    print(format_summary(summary, unit))
    title = f"{loaded.name}: ponder count N + R per {unit}"
    if out.suffix.lower() == ".html":
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render_html(pieces, values, title, summary), encoding="utf-8")
    else:
        plots.plot_ponder(pieces, values, out, title=title, width=args.width)
    print(f"wrote {out}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"checkpoint": str(loaded.ckpt), "unit": unit, **summary,
                  "pieces": pieces, "ponder": [round(v, 6) for v in values.tolist()]}
        path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path}")
    return 0


def ponder_text(text: str | None, text_file: str | None) -> str:
    """The text to look at: ``--text`` or the contents of ``--text-file`` (exactly one of them)."""
    if (text is None) == (text_file is None):
        raise ConfigError("give the text to look at: --text TEXT or --text-file FILE (one of them)")
    if text is not None:
        return text
    path = Path(text_file)
    if not path.is_file():
        raise ConfigError(f"--text-file {path}: no such file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"--text-file {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None

"""Where a pondering model thinks longer: the ponder count N + R (adaptive computation time) of every token of a
text, a summary by character class, and the text as HTML coloured by it (the PNG: :func:`tokenloom.viz.plots.
plot_ponder`). ``tokenloom viz ponder`` is the command line over these; experiments call them directly::

    result = text_ponder(model, tokenizer, text)  # a causal LM declared to ponder (models.registry.ponders)
    summary = ponder_summary(result.pieces, result.ponder)
    summary["classes"]["space"]["ratio_to_letter"]

Classes (:data:`CLASSES`), one per token, in this order of precedence: ``newline`` (``\\n``), ``line start`` (the
first character after a newline), ``space`` (other white space), ``letter``, ``digit``, ``punctuation`` (Unicode
punctuation and the ASCII symbols of :data:`string.punctuation`) and ``other``. A token of several characters (a
BPE tokenizer) is classified by its first character.
"""

from __future__ import annotations

import html
import string
import unicodedata
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..errors import ConfigError
from ..models.registry import decoding_of, ponders

CLASSES = ("space", "punctuation", "letter", "digit", "line start", "newline", "other")


class TextPonder(NamedTuple):
    """:func:`text_ponder`'s result: the text as token pieces and each token's ponder count."""

    pieces: list[str]  # each token's text (one character each for a character tokenizer)
    ponder: Tensor  # (T,) float32 ponder counts N + R
    unit: str  # "character" (a character tokenizer) or "token"


def char_class(ch: str, previous: str | None) -> str:
    """The class of character ``ch`` after ``previous`` (None at the start of the text); see the module docstring."""
    if ch == "\n":
        return "newline"
    if previous == "\n":
        return "line start"
    if ch.isspace():
        return "space"
    if ch.isalpha():
        return "letter"
    if ch.isdigit():
        return "digit"
    if ch in string.punctuation or unicodedata.category(ch).startswith("P"):
        return "punctuation"
    return "other"


def token_classes(pieces: Sequence[str]) -> list[str]:
    """The class of each token: of its first character, after the last character of the token before it (an
    empty piece is ``other``)."""
    out, previous = [], None
    for piece in pieces:
        out.append(char_class(piece[0], previous) if piece else "other")
        previous = piece[-1] if piece else previous
    return out


def windows(length: int, context: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """(start, end, first scored) of the windows that cover ``length`` tokens with a model of ``context`` positions:
    windows of ``context`` advancing by ``stride`` (default ``context // 2``), the last one ending at ``length``;
    each token is scored in the first window that holds it, so every token after the first window is scored with
    at least ``context - stride`` tokens before it."""
    if length <= context:
        return [(0, length, 0)]
    stride = max(1, stride or context // 2)
    starts = list(range(0, length - context, stride)) + [length - context]
    out, scored = [], 0
    for start in starts:
        end = start + context
        if end > scored:
            out.append((start, end, scored))
            scored = end
    return out


@torch.no_grad()
def ponder_per_token(model: nn.Module, ids: Tensor, *, stride: int | None = None) -> Tensor:
    """(T,) token ids -> (T,) float32 ponder counts N + R of a causal language model declared to ponder; a text
    longer than the model's context (``config.max_seq_len``) runs in :func:`windows`. The model runs as it is
    (put it in eval mode)."""
    check_ponders(model)
    ids = ids.reshape(-1)
    out = torch.empty(ids.numel(), dtype=torch.float32)
    for start, end, scored in windows(ids.numel(), model.config.max_seq_len, stride):
        ponder = model.forward_ponder(ids[None, start:end]).ponder[0]  # (end - start,)
        out[scored:end] = ponder[scored - start:].float().cpu()
    return out


def check_ponders(model: nn.Module) -> None:
    """A one-line ConfigError unless ``model`` is a causal language model declared to ponder."""
    if not ponders(model):
        raise ConfigError(f"{type(model).__name__} does not ponder (no adaptive computation time); a ponder map needs "
                          "a model declared with ACT (family universal)")
    if decoding_of(model) != "causal_lm":
        raise ConfigError(f"{type(model).__name__} ponders over source sentences (an encoder-decoder); a ponder map "
                          "of a text needs a language model (family universal)")


def text_ponder(model: nn.Module, tokenizer: Any, text: str, *, stride: int | None = None) -> TextPonder:
    """The tokens of ``text`` (``tokenizer.encode``) with their ponder counts (:func:`ponder_per_token`)."""
    ids = tokenizer.encode(text)
    if not ids:
        raise ConfigError("the text is empty after tokenization; give some text")
    return tokens_ponder(model, tokenizer, torch.tensor(ids, device=next(model.parameters()).device), stride=stride)


def tokens_ponder(model: nn.Module, tokenizer: Any, ids: Tensor, *, stride: int | None = None) -> TextPonder:
    """(T,) token ids with their pieces of text and ponder counts (:func:`ponder_per_token`)."""
    unit = "character" if tokenizer.kind == "char" else "token"
    return TextPonder(token_pieces(tokenizer, ids.tolist()), ponder_per_token(model, ids, stride=stride), unit)


def token_pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each id's own text (a special token by its name)."""
    pieces = []
    for i in ids:
        text = tokenizer.decode([i])
        pieces.append(text if text else (tokenizer.backend.id_to_token(i) or str(i)))
    return pieces


def ponder_summary(pieces: Sequence[str], ponder: Tensor | Sequence[float]) -> dict[str, Any]:
    """Per class (:data:`CLASSES`, by :func:`token_classes`): ``count``, ``mean_ponder`` (None when the class is
    empty) and ``ratio_to_letter`` (mean / the letters' mean; None without letters); with ``tokens`` (the count)
    and the overall ``mean_ponder``."""
    values = [float(v) for v in (ponder.tolist() if isinstance(ponder, Tensor) else ponder)]
    if len(values) != len(pieces):
        raise ValueError(f"{len(pieces)} pieces but {len(values)} ponder counts")
    groups: dict[str, list[float]] = {name: [] for name in CLASSES}
    for cls, value in zip(token_classes(pieces), values, strict=True):
        groups[cls].append(value)
    means = {name: sum(v) / len(v) if v else None for name, v in groups.items()}
    letter = means["letter"]
    classes = {name: {"count": len(groups[name]), "mean_ponder": means[name],
                      "ratio_to_letter": None if means[name] is None or not letter else means[name] / letter}
               for name in CLASSES}
    return {"tokens": len(values), "mean_ponder": sum(values) / len(values) if values else None, "classes": classes}


def format_summary(summary: dict[str, Any], unit: str = "character") -> str:
    """The summary as a plain-text table (one line per class)."""
    def number(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [f"{'class':<12} {'count':>6} {'mean ponder':>12} {'/ letter':>9}"]
    for name, row in summary["classes"].items():
        lines.append(f"{name:<12} {row['count']:>6} {number(row['mean_ponder'], '.4f'):>12} "
                     f"{number(row['ratio_to_letter'], '.3f'):>9}")
    lines.append(f"{'all':<12} {summary['tokens']:>6} {number(summary['mean_ponder'], '.4f'):>12}")
    if unit != "character":
        lines.append("(a token-level tokenizer: each token is classified by its first character)")
    return "\n".join(lines)


# --- colours and HTML ---------------------------------------------------------------------------------------------

_VIRIDIS = ((0x44, 0x01, 0x54), (0x3B, 0x52, 0x8B), (0x21, 0x91, 0x8C), (0x5E, 0xC9, 0x62), (0xFD, 0xE7, 0x25))


def value_range(values: Sequence[float]) -> tuple[float, float]:
    """(low, high) of the colour scale: the values' range, widened to 1 around a single value."""
    low, high = min(values), max(values)
    return (low - 0.5, high + 0.5) if high - low < 1e-6 else (low, high)


def viridis(t: float) -> tuple[int, int, int]:
    """An RGB colour for ``t`` in [0, 1]: matplotlib's viridis through five of its stops (no matplotlib needed)."""
    t = min(max(t, 0.0), 1.0) * (len(_VIRIDIS) - 1)
    i = min(int(t), len(_VIRIDIS) - 2)
    f = t - i
    a, b = _VIRIDIS[i], _VIRIDIS[i + 1]
    return tuple(round(x + (y - x) * f) for x, y in zip(a, b, strict=True))


def render_html(pieces: Sequence[str], ponder: Tensor | Sequence[float], title: str = "ponder",
                summary: dict[str, Any] | None = None) -> str:
    """A self-contained HTML page: every token a ``<span>`` (its text HTML-escaped; a newline shown as an arrow and a
    line break) with a background coloured by its ponder count and a ``title`` tooltip naming it; a colour legend and,
    when given, the class summary as a table."""
    values = [float(v) for v in (ponder.tolist() if isinstance(ponder, Tensor) else ponder)]
    low, high = value_range(values)
    spans = []
    for piece, value, cls in zip(pieces, values, token_classes(pieces), strict=True):
        t = (value - low) / (high - low)
        r, g, b = viridis(t)
        ink = "#000" if t > 0.6 else "#fff"
        tip = html.escape(f"{piece!r} ({cls}): ponder {value:.3f}", quote=True)
        newline = ' class="nl"' if "\n" in piece else ""
        spans.append(f'<span{newline} style="background:#{r:02x}{g:02x}{b:02x};color:{ink}" title="{tip}">'
                     f"{html.escape(piece, quote=False)}</span>")
    stops = ", ".join(f"rgb{viridis(i / 4)}" for i in range(5))
    table = ""
    if summary is not None:
        rows = "".join(f"<tr><td>{html.escape(name)}</td><td>{row['count']}</td><td>{_cell(row['mean_ponder'], 4)}"
                       f"</td><td>{_cell(row['ratio_to_letter'], 3)}</td></tr>"
                       for name, row in summary["classes"].items())
        table = ("<table><tr><th>class</th><th>count</th><th>mean ponder</th><th>/ letter</th></tr>"
                 f"{rows}</table>")
    return ("<!doctype html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>"
            "body{font-family:sans-serif;margin:1.5em}"
            ".text{font-family:monospace;white-space:pre-wrap;line-height:1.6;font-size:14px}"
            ".nl::before{content:'\\21B5';opacity:.7}"
            f".bar{{display:inline-block;width:240px;height:12px;vertical-align:middle;"
            f"background:linear-gradient(to right, {stops})}}"
            "table{border-collapse:collapse;margin-top:1em}td,th{border:1px solid #ccc;padding:2px 8px;"
            "text-align:right}td:first-child{text-align:left}"
            f"</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p>ponder count N + R: {low:.3f} <span class=\"bar\"></span> {high:.3f} (hover a character for its "
            "value)</p>"
            f"<div class=\"text\">{''.join(spans)}</div>{table}</body></html>\n")


def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"

"""A self-contained HTML page: every image inlined as a ``data:`` URI, the styles inline, no scripts or fonts
from elsewhere, so the file reads offline and can be mailed or archived as one file.

The page checks itself when it loads: every ``<img>`` that decoded counts, the count lands on
``<body data-images-ok="N" data-images-total="M">`` and a broken image logs a console error (what the browser
test reads).
"""

from __future__ import annotations

import base64
import datetime
import html
from dataclasses import dataclass
from pathlib import Path

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 70rem; color: #222; padding: 0 1rem; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.25rem; border-bottom: 1px solid #ddd; padding-bottom: .2rem; }
table { border-collapse: collapse; font-size: .85rem; margin: .5rem 0; }
th, td { border: 1px solid #ccc; padding: .2rem .5rem; text-align: right; }
th { background: #f4f4f4; } td.text { text-align: left; }
pre { background: #f7f7f7; padding: .6rem; overflow-x: auto; font-size: .8rem; white-space: pre-wrap; }
img { max-width: 100%; border: 1px solid #eee; margin: .3rem 0; }
.note { color: #666; font-size: .85rem; } .bad { color: #b00; font-weight: bold; } .ok { color: #070; }
nav a { margin-right: 1rem; }
"""

SELF_CHECK = """
window.addEventListener("load", function () {
  var images = document.images, ok = 0;
  for (var i = 0; i < images.length; i++) {
    if (images[i].complete && images[i].naturalWidth > 0) { ok++; }
    else { console.error("image did not load: " + images[i].alt); }
  }
  document.body.setAttribute("data-images-ok", String(ok));
  document.body.setAttribute("data-images-total", String(images.length));
});
"""


@dataclass
class Section:
    """One part of the page: a heading (also its anchor) and its HTML body."""

    heading: str
    body: str

    @property
    def anchor(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.heading.lower())


def image(png: str | Path | bytes, alt: str) -> str:
    """An ``<img>`` with the PNG inlined."""
    data = png if isinstance(png, bytes) else Path(png).read_bytes()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode("ascii")}">'


def table(headers: list[str], rows: list[list[object]], text_columns: tuple[int, ...] = ()) -> str:
    """A table; numbers right-aligned, ``text_columns`` left-aligned; floats to 4 significant digits."""
    def cell(i: int, value: object) -> str:
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        cls = ' class="text"' if i in text_columns else ""
        return f"<td{cls}>{html.escape(shown)}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(cell(i, v) for i, v in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def pre(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def note(text: str, kind: str = "note") -> str:
    return f'<p class="{kind}">{html.escape(text)}</p>'


def render(title: str, sections: list[Section], subtitle: str = "") -> str:
    """The whole page."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    nav = " ".join(f'<a href="#{s.anchor}">{html.escape(s.heading)}</a>' for s in sections)
    parts = [f'<section id="{s.anchor}"><h2>{html.escape(s.heading)}</h2>{s.body}</section>' for s in sections]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(title)}</title><style>{STYLE}</style><script>{SELF_CHECK}</script></head>"
            f"<body><h1>{html.escape(title)}</h1>"
            f'<p class="note">{html.escape(subtitle)} written by tokenloom report, {stamp}</p>'
            f"<nav>{nav}</nav>{''.join(parts)}</body></html>\n")

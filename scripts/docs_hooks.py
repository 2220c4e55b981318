"""MkDocs hook (mkdocs.yml ``hooks:``): the pages of the site that are generated or folded in at build time.

* ``reference/recipes.md`` and ``reference/cli.md``: generated from the config dataclasses and the argparse parser
  (:mod:`tokenloom.cli.reference`), so they cannot drift from the code.
* ``guide/*.md``: the README's sections, one or more per page (:data:`GUIDE`). The README stays the one source;
  every section of it must be on some page (a new section that is not is a build error).
* ``benchmarks.md`` and ``data-sources.md``: ``benchmarks/README.md`` and ``data/SOURCES.md``.

Links are written relative to the repository (the README's ``docs/interop.md``, a page's ``../README.md#speed``);
:func:`on_page_markdown` points them at the pages of the site, and turns links to files that are not on the site
(a recipe, a source file) into their path in code, so ``mkdocs build --strict`` finds no broken link.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

from tokenloom.cli.reference import cli_reference, recipe_reference

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("mkdocs.hooks.tokenloom")

# guide page -> (title, the README sections on it); "Quick start" is the home page's
GUIDE: dict[str, tuple[str, list[str]]] = {
    "guide/language-models.md": ("Language models", ["Using it", "The bundled checkpoint"]),
    "guide/recipes.md": ("Recipes, precision and experiments", ["Recipes and precision"]),
    "guide/long-sequences.md": ("Long sequences", ["Long sequences (sliding window, Transformer-XL, chunks)"]),
    "guide/adaptive.md": ("Adaptive computation and RNNs", ["Adaptive computation and the recurrent baseline"]),
    "guide/translation.md": ("Translation", ["Translation (encoder-decoder)"]),
    "guide/nat.md": ("Non-autoregressive translation", ["Non-autoregressive translation (NAT, Mask-Predict, CTC)"]),
    "guide/vision.md": ("Vision", ["Vision (ViT and Swin)"]),
    "guide/huggingface.md": ("Hugging Face models", ["Hugging Face models in and out"]),
    "guide/alignment.md": ("Alignment and retrieval", ["Alignment: instruction tuning, LoRA, preferences, retrieval"]),
    "guide/viz.md": ("Seeing inside", ["Seeing inside (viz and report)"]),
    "guide/serving.md": ("Serving", ["Serving (OpenAI-compatible)"]),
    "guide/speed.md": ("Speed", ["Speed"]),
    "guide/development.md": ("Developing tokenloom", ["What is inside", "Tests"]),
    "guide/data.md": ("Data", ["Data"]),
}
HOME_SECTIONS = {"Quick start"}
INCLUDE = re.compile(r"^<!-- README: (.+?) -->$", re.M)  # a docs page that holds a README section in its text
COPIED = {"benchmarks.md": "benchmarks/README.md", "data-sources.md": "data/SOURCES.md"}
GENERATED = {"reference/recipes.md": recipe_reference, "reference/cli.md": cli_reference}

_origin: dict[str, str] = {}  # site page -> the repository file its text comes from
_anchors: dict[str, str] = {}  # README heading anchor -> the guide page holding it


def readme_sections(text: str) -> dict[str, str]:
    """The README's ``## `` sections by title (each with its heading line)."""
    sections: dict[str, str] = {}
    title = None
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            title = line[3:].strip()
            sections[title] = ""
        if title is not None:
            sections[title] += line
    return sections


def slug(title: str) -> str:
    """The anchor of a heading, as MkDocs' toc and GitHub make it (near enough for the README's titles)."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", title.strip().lower()))


def guide_pages(readme: str) -> dict[str, str]:
    """The guide pages' Markdown; raises when a README section is on no page or a listed one is missing."""
    sections = readme_sections(readme)
    included = {m.group(1) for page in sorted((ROOT / "docs").rglob("*.md"))
                for m in INCLUDE.finditer(page.read_text(encoding="utf-8"))}
    placed = {title for _, titles in GUIDE.values() for title in titles} | HOME_SECTIONS | included
    missing = [title for title in sections if title not in placed]
    gone = [title for title in placed if title not in sections]
    if missing or gone:
        raise ValueError(f"README sections not on any page of the site: {missing}; listed but not in the README: "
                         f"{gone} (scripts/docs_hooks.py GUIDE)")
    pages = {}
    for page, (title, titles) in GUIDE.items():
        body = "".join(sections[t] for t in titles)
        for t in titles:
            _anchors[slug(t)] = page
        for line in body.splitlines():
            if line.startswith("### "):
                _anchors[slug(line[4:])] = page
        note = "*This page is the README's section" + ("s " if len(titles) > 1 else " ") + \
               ", ".join(f"“{t}”" for t in titles) + ".*"
        pages[page] = f"# {title}\n\n{note}\n\n{body}"
    return pages


def on_files(files: Files, config) -> Files:  # noqa: ANN001 - MkDocs' config object
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    contents = {page: (text, "README.md") for page, text in guide_pages(readme).items()}
    for page, source in COPIED.items():
        contents[page] = ((ROOT / source).read_text(encoding="utf-8"), source)
    for page, make in GENERATED.items():
        contents[page] = (make(), f"docs/{page}")
    for page, (text, origin) in contents.items():
        _origin[page] = origin
        files.append(File.generated(config, page, content=text))
    return files


_LINK = re.compile(r"(!?\[[^\]\n]*\])\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def _site_target(origin: str, target: str) -> str | None:
    """The site page (and anchor) a repository-relative link from ``origin`` goes to; None: not on the site."""
    path, _, anchor = target.partition("#")
    repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(origin), path)) if path else origin
    hash_ = f"#{anchor}" if anchor else ""
    if repo_path == "README.md":
        if not anchor:
            return "index.md"
        return _anchors.get(anchor, "index.md") + hash_
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/"):] + hash_
    for page, source in COPIED.items():
        if repo_path == source:
            return page + hash_
    return None


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 - MkDocs' objects
    src = page.file.src_uri
    if INCLUDE.search(markdown):
        sections = readme_sections((ROOT / "README.md").read_text(encoding="utf-8"))
        markdown = INCLUDE.sub(lambda m: relink(sections[m.group(1)], "README.md", src), markdown)
    return relink(markdown, _origin.get(src, f"docs/{src}"), src)


def relink(markdown: str, origin: str, src: str) -> str:
    """``markdown`` (written relative to the repository file ``origin``) with its links pointed at the site's
    pages, as seen from the site page ``src``."""

    def fix(match: re.Match) -> str:
        text, target = match.group(1), match.group(2)
        if re.match(r"^[a-z]+:", target) or (target.startswith("#") and origin != "README.md"):
            return match.group(0)  # a URL, or an anchor on this page
        site = _site_target(origin, target)
        if site is None:
            if text.startswith("!"):
                return match.group(0)
            path = posixpath.normpath(posixpath.join(posixpath.dirname(origin), target.partition("#")[0]))
            return f"{text[1:-1]} (`{path}` in the repository)"
        page_path, _, anchor = site.partition("#")
        if page_path == src:
            return f"{text}(#{anchor})" if anchor else text[1:-1]
        rel = posixpath.relpath(page_path, posixpath.dirname(src) or ".")
        return f"{text}({rel}{'#' + anchor if anchor else ''})"

    out, fenced = [], False
    for line in markdown.splitlines(keepends=True):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
        out.append(line if fenced else _LINK.sub(fix, line))
    return "".join(out)

"""The reference pages of the documentation site, generated from the code so they cannot drift from it.

* :func:`recipe_reference`: every recipe key (section, key, type, default, comment) read from the config
  dataclasses: ``RunConfig``, ``TrainConfig`` and the configs nested in it, each model family's config (the
  ``MODELS`` registry), each task's data config (the ``TASKS`` registry), and ``GenerationConfig`` for Python.
  The comments are the ``# ...`` after each field in the source (and the ``#   ...`` lines continuing it).
* :func:`cli_reference`: every command's ``--help`` (with defaults) as argparse prints it.
* :func:`recipe_fields`: the (section, key) rows of the recipe reference, for the test that compares the page
  with the dataclasses.
* :func:`field_table`: one dataclass's fields as a Markdown table (the API reference shows it under each config
  class); :func:`markdown_roles` and :func:`docstring_markdown`: the Sphinx roles and literal blocks the docstrings
  are written with, as Markdown (``scripts/docs_griffe.py`` applies them to the API reference).

``scripts/docs_hooks.py`` (the MkDocs hook) writes both pages into the site at build time.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import os
import re
import textwrap
import tokenize
import typing
from collections.abc import Callable, Iterator
from typing import Any

from ..config import type_name


def field_comments(cls: type) -> dict[str, str]:
    """``{field: comment}`` from the source of ``cls`` and its dataclass bases: the comment after a field's line
    (a multi-line field's statement included) and the comment-only lines that continue it (``#   ...``)."""
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is cls.__mro__[-1]:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        comments.update(_comments_in(source))
    return comments


def _comments_in(source: str) -> dict[str, str]:
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    indent = next((len(t.string) for t in tokens if t.type == tokenize.INDENT), None)
    found: dict[str, str] = {}
    current: str | None = None  # the field being read: its statement, then its continuation comments
    in_statement = False
    for i, tok in enumerate(tokens):
        if tok.type in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
            continue
        if tok.type == tokenize.NEWLINE:
            in_statement = False
        elif tok.type == tokenize.COMMENT:
            text = tok.string[1:]
            if in_statement and current:
                found[current] = (found.get(current, "") + " " + text.strip()).strip()
            elif current in found and text.startswith("   "):  # "#   ..." continues the field's comment
                found[current] += " " + text.strip()
            else:
                current = None
        elif not in_statement:
            is_field = (tok.type == tokenize.NAME and tok.start[1] == indent and i + 1 < len(tokens)
                        and tokens[i + 1].string == ":")
            current, in_statement = (tok.string if is_field else None), True
    return found


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _shown_default(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return "(section)"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(str(v) for v in value) + "]`" if value else "`[]`"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{value}`"


@dataclasses.dataclass(frozen=True)
class FieldRow:
    section: str  # the page's section: "", train, model (gpt), data (lm), generation
    key: str  # the dotted key a recipe or --set uses: train.scheduled_sampling.k, model.num_layers, top_k
    type: str
    default: str
    comment: str


def _rows(cls: type, section: str, path: str) -> Iterator[FieldRow]:
    """The rows of ``cls`` (keys ``path.field``) and of the dataclasses nested in it, depth first after ``cls``."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    nested = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue  # derived (field(init=False)): not a key a recipe sets
        tp, key = hints[f.name], f"{path}.{f.name}" if path else f.name
        yield FieldRow(section, key, type_name(tp), _shown_default(_default(f)), comments.get(f.name, ""))
        if dataclasses.is_dataclass(tp) and path:  # (the top level's train: is a section of its own)
            nested.append((tp, key))
    for tp, where in nested:
        yield from _rows(tp, section, where)


def _sections() -> list[tuple[str, str, str, type]]:
    """(title, section, key prefix, dataclass) of every recipe section, in the order the page shows them."""
    from ..generation import GenerationConfig
    from ..models.registry import MODELS
    from ..tasks import TASKS
    from ..training.config import RunConfig, TrainConfig

    sections = [("The recipe's top level", "", "", RunConfig), ("`train:` — training", "train", "train", TrainConfig)]
    for family in MODELS.names():
        config_cls, _ = MODELS.get(family)
        sections.append((f"`model:` with `family: {family}`", f"model ({family})", "model", config_cls))
    for task in TASKS.names():
        sections.append((f"`data:` with `task: {task}`", f"data ({task})", "data", TASKS.get(task).data_config_cls))
    sections.append(("Generation settings (Python: `GenerationConfig`)", "generation", "", GenerationConfig))
    return sections


def recipe_fields() -> list[FieldRow]:
    """Every row of the recipe reference."""
    return [row for _, section, path, cls in _sections() for row in _rows(cls, section, path)]


ROLE = re.compile(r":(?:py:)?(?P<role>class|func|mod|meth|attr|data|exc|obj|const):`"
                  r"(?P<tilde>~?)(?P<target>[\w.][\w.\s]*)`")


def markdown_roles(text: str, link: Callable[[str, str], str | None] | None = None) -> str:
    """``text`` with its Sphinx roles (``:class:`Name```, ``:func:`~a.b.name```, ``:mod:``, ``:meth:``, ``:attr:``,
    ``:data:``, ``:exc:``) as Markdown: the name in code (``~``: its last part), linked where ``link(role, target)``
    gives the object's full dotted path (an optional cross-reference of mkdocs-autorefs: plain code where the site
    has no page for it)."""

    def replace(match: re.Match) -> str:
        target = "".join(match["target"].split())  # a name the docstring's line break cut in two
        shown = target.rsplit(".", 1)[-1] if match["tilde"] else target.lstrip(".")
        identifier = link(match["role"], target) if link else None
        if identifier is None:
            return f"`{shown}`"
        return f'<autoref identifier="{identifier}" optional><code>{shown}</code></autoref>'

    return ROLE.sub(replace, text)


def docstring_markdown(text: str, link: Callable[[str, str], str | None] | None = None) -> str:
    """A docstring (prose with ``code`` and Sphinx roles, literal blocks after ``::``) as Markdown: the roles as
    :func:`markdown_roles` makes them, ``text::`` as ``text:`` and its indented block as a code block, in which a role
    is the bare name (a code block shows its text as written)."""
    lines = text.splitlines()
    segments: list[tuple[bool, list[str]]] = [(False, [])]  # (literal?, lines), in order
    literal_indent = None  # the indent of the paragraph that opened the literal block (None: not in one)
    for i, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        if literal_indent is not None and line.strip() and indent <= literal_indent:
            literal_indent = None
            segments.append((False, []))
        opens = line.rstrip().endswith("::") and (i + 1 == len(lines) or not lines[i + 1].strip())
        if literal_indent is None and opens:
            segments[-1][1].append(line.rstrip()[:-1] if line.strip() != "::" else "")  # "text::" reads "text:"
            literal_indent = indent
            segments.append((True, []))
            continue
        segments[-1][1].append(line)

    def bare(match: re.Match) -> str:
        target = "".join(match["target"].split())
        return target.rsplit(".", 1)[-1] if match["tilde"] else target.lstrip(".")

    return "\n".join(ROLE.sub(bare, "\n".join(block)) if literal else markdown_roles("\n".join(block), link)
                     for literal, block in segments if block)


def _cell(text: str) -> str:
    return markdown_roles(text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " "))


def field_table(cls: type) -> str:
    """The fields of the dataclass ``cls`` (those ``__init__`` takes) as a Markdown table: name, type, default (as
    Python writes it) and the ``# comment`` after the field in the source."""
    hints, comments = typing.get_type_hints(cls), field_comments(cls)
    out = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        value = _default(f)
        if value is dataclasses.MISSING:
            shown = "(required)"
        elif dataclasses.is_dataclass(value):
            shown = f"`{type(value).__name__}()`"
        else:
            shown = f"`{value!r}`"
        kind = re.sub(r"\bnull\b", "None", type_name(hints[f.name]))  # (type_name spells types as YAML does)
        out.append(f"| `{f.name}` | {_cell(kind)} | {_cell(shown)} | "
                   f"{_cell(comments.get(f.name, ''))} |")
    return "\n".join(out)


def recipe_reference() -> str:
    """The recipe reference page (Markdown)."""
    from ..models.registry import MODELS
    from ..tasks import TASKS
    from ..training.config import TOKENIZER_KEYS

    out = ["# Recipe reference", "",
           "Every key a recipe (a YAML file given to `tokenloom train`) can set, with its type, default and "
           "meaning. This page is generated from the config dataclasses at build time "
           "(`tokenloom.cli.reference`), so it lists exactly what the code accepts. Any key can also be set on "
           "the command line: `--set train.max_steps=500` (values are read as YAML).", "",
           f"A recipe has the sections `task` (one of {', '.join(f'`{t}`' for t in TASKS.names())}), `model` "
           f"(`family` one of {', '.join(f'`{m}`' for m in MODELS.names())}; the default family is the task's), "
           f"`data` (the task's), `train` and `tokenizer` (keys: {', '.join(f'`{k}`' for k in TOKENIZER_KEYS)}).",
           "A key no section knows is an error that names the closest known key.", ""]
    for title, section, path, cls in _sections():
        out += [f"## {title}", ""]
        doc = inspect.getdoc(cls) or ""
        if doc and not doc.startswith(cls.__name__ + "("):  # dataclasses' generated signature is no docstring
            out += [markdown_roles(doc.split("\n\n")[0].replace("\n", " ")), ""]
        out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for row in _rows(cls, section, path):
            out.append(f"| `{row.key}` | {_cell(row.type)} | {_cell(row.default)} | {_cell(row.comment)} |")
        out.append("")
    return "\n".join(out)


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:  # argparse keeps its subcommands here and nowhere public
        if isinstance(action, argparse._SubParsersAction):
            seen = set()
            for name, sub in action.choices.items():
                if id(sub) in seen:
                    continue  # an alias
                seen.add(id(sub))
                yield name, sub


def cli_reference() -> str:
    """The CLI reference page (Markdown): ``tokenloom --help`` and every (sub)command's ``--help``."""
    from .main import build_parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: a fixed width makes the page reproducible
    try:
        parser = build_parser()
        out = ["# CLI reference", "",
               "Every `tokenloom` command and option, as `--help` prints them (generated from the argparse parser "
               "at build time, so it cannot drift). Shell completion: `eval \"$(tokenloom completion bash)\"`.",
               "", "```text", parser.format_help().rstrip(), "```", ""]

        def walk(p: argparse.ArgumentParser, prefix: str, depth: int) -> None:
            for name, sub in _subparsers(p):
                command = f"{prefix} {name}"
                out.extend([f"{'#' * depth} `{command}`", "", "```text", sub.format_help().rstrip(), "```", ""])
                walk(sub, command, min(depth + 1, 4))

        walk(parser, "tokenloom", 2)
        return "\n".join(out)
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns

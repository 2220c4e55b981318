"""The documentation site: the generated reference pages match the code, the README is all on the site, links are
pointed at the site's pages, and the whole site builds with ``mkdocs build --strict``."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from tokenloom.cli.main import build_parser
from tokenloom.cli.reference import cli_reference, field_comments, recipe_fields, recipe_reference
from tokenloom.generation import GenerationConfig
from tokenloom.models.registry import MODELS
from tokenloom.tasks import TASKS
from tokenloom.training.config import RunConfig, TrainConfig

ROOT = Path(__file__).resolve().parent.parent


def _keys(cls: type, prefix: str) -> list[str]:
    """Every settable key of ``cls``, dotted, nested dataclasses included (walked here, apart from the page's
    generator)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        keys.append(key)
        if dataclasses.is_dataclass(hints[f.name]) and prefix:
            keys += _keys(hints[f.name], key)
    return keys


def _config_classes() -> list[tuple[str, type]]:
    classes = [("", RunConfig), ("train", TrainConfig), ("", GenerationConfig)]
    classes += [("model", MODELS.get(family)[0]) for family in MODELS.names()]
    classes += [("data", TASKS.get(task).data_config_cls) for task in TASKS.names()]
    return classes


def test_the_recipe_reference_lists_every_config_field_with_its_default_and_a_comment():
    page = recipe_reference()
    rows = {line.split("|")[1].strip().strip("`") for line in page.splitlines() if line.startswith("| `")}
    expected = {key for prefix, cls in _config_classes() for key in _keys(cls, prefix)}
    assert expected <= rows, f"fields missing from the recipe reference: {sorted(expected - rows)}"
    assert rows <= expected, f"rows of no config field: {sorted(rows - expected)}"
    # a default shown for a field is the dataclass's own
    assert "| `train.max_steps` | int | `2000` |" in page
    assert "| `train.scheduled_sampling.min_teacher` | float | `0.75` |" in page
    assert f"| `model.embed_dim` | int | `{MODELS.get('gpt')[0]().embed_dim}` |" in page
    undocumented = [f"{row.section}: {row.key}" for row in recipe_fields() if not row.comment]
    assert not undocumented, f"config fields without a '# comment' in their dataclass: {undocumented}"


def test_field_comments_read_multiline_fields_and_continuations():
    @dataclasses.dataclass
    class Example:
        a: int = 1  # the first
        b: list[int] = dataclasses.field(
            default_factory=list)  # a long one
        c: str = "x"  # starts here
        #   and goes on here
        d: float = 0.5

        def method(self) -> None:  # not a field
            pass

    assert field_comments(Example) == {"a": "the first", "b": "a long one", "c": "starts here and goes on here"}


def _parsers(parser: argparse.ArgumentParser, name: str = "tokenloom"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_the_cli_reference_shows_every_command_and_option():
    page = cli_reference()
    for name, parser in _parsers(build_parser()):
        assert f"`{name}`" in page or name == "tokenloom", f"{name} is not on the CLI reference"
        for action in parser._actions:
            for option in action.option_strings:
                assert option in page, f"{name} {option} is not on the CLI reference"


def _hooks():
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_readme_section_is_on_a_page_of_the_site():
    hooks = _hooks()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    pages = hooks.guide_pages(readme)
    included = {m.group(1) for page in (ROOT / "docs").rglob("*.md")
                for m in hooks.INCLUDE.finditer(page.read_text(encoding="utf-8"))}
    for title in hooks.readme_sections(readme):
        if title not in hooks.HOME_SECTIONS | included:
            assert any(f"## {title}\n" in text for text in pages.values()), title
    with pytest.raises(ValueError, match="not on any page"):
        hooks.guide_pages(readme + "\n## A new section\n\ntext\n")


def test_links_relative_to_the_repository_point_at_the_sites_pages():
    hooks = _hooks()
    hooks.guide_pages((ROOT / "README.md").read_text(encoding="utf-8"))  # fills the README anchors
    hooks._origin["guide/translation.md"] = "README.md"

    class Page:
        class file:  # noqa: N801 - the shape of MkDocs' page.file
            src_uri = "guide/translation.md"

    markdown = ("See [interop](docs/interop.md), ![a](docs/images/viz-alignment.png), [bench](benchmarks/README.md),"
                " [recipe](configs/multi30k-de-en.yaml), [speed](#speed), [web](https://example.org).\n"
                "```\n[not](a/link.md)\n```\n")
    out = hooks.on_page_markdown(markdown, Page, None, None)
    assert "[interop](../interop.md)" in out
    assert "![a](../images/viz-alignment.png)" in out
    assert "[bench](../benchmarks.md)" in out
    assert "recipe (`configs/multi30k-de-en.yaml` in the repository)" in out
    assert "[speed](speed.md#speed)" in out  # an anchor of the README: another section's page now
    assert "[web](https://example.org)" in out and "[not](a/link.md)" in out  # URLs and code stay


def test_the_site_builds_with_strict(tmp_path):
    pytest.importorskip("mkdocstrings")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
                             str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                            env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "recipes.html").is_file()
    install = (tmp_path / "site" / "install.html").read_text(encoding="utf-8")
    assert "make wheel-test" in install  # the README section the install page includes
    html = (tmp_path / "site" / "api" / "training.html").read_text(encoding="utf-8")
    assert "tokenloom.training.config.load_run_config" in html and "tokenloom.training.trainer.Trainer" in html


def test_every_test_the_security_page_names_exists():
    """docs/security.md names the test that holds each promise (``tests/x.py::test_name`` or ``::test_name`` after a
    file named in the same cell): each file exists and defines each test."""
    import re

    text = (ROOT / "docs" / "security.md").read_text(encoding="utf-8")
    named = 0
    for line in text.splitlines():
        current = None
        for path, name in re.findall(r"`(tests/[\w/]+\.py)?(?:::(test_\w+))?", line):
            current = path or current
            if not current:
                continue
            source = (ROOT / current).read_text(encoding="utf-8") if (ROOT / current).is_file() else None
            assert source is not None, f"docs/security.md names {current}, which does not exist"
            if name:
                assert re.search(rf"^def {name}\(", source, re.M), f"docs/security.md names {current}::{name}"
                named += 1
    assert named >= 15

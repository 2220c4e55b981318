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
    # the docstrings' Sphinx roles render as code (linked where the site has the object), never as raw text
    raw = {}
    for page in (tmp_path / "site").rglob("*.html"):
        found = RAW_ROLE.findall(page.read_text(encoding="utf-8"))
        if found:
            raw[str(page.relative_to(tmp_path / "site"))] = found[:3]
    assert not raw, f"Sphinx roles left as text: {raw}"
    generation = (tmp_path / "site" / "api" / "generation.html").read_text(encoding="utf-8")
    assert 'href="#tokenloom.generation.beam.beam_search"><code>tokenloom.generation.beam_search</code>' in generation
    # a config dataclass lists its fields with their defaults and comments
    assert "<td><code>max_new_tokens</code></td>\n<td>int</td>\n<td><code>100</code></td>" in generation
    assert "<td><code>stop_after_steps</code></td>" in html


RAW_ROLE = __import__("re").compile(r":(?:class|func|mod|meth|attr|data|exc|obj):(?:`|<code>)")


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


def test_sphinx_roles_become_markdown_code_or_links():
    from tokenloom.cli.reference import docstring_markdown, markdown_roles

    text = "See :class:`GenerationConfig`, :func:`~tokenloom.generation.beam_search`, :mod:`tokenloom.nn` and " \
           ":meth:`~.kv_cache.KVCache.\n    reorder` (cut by a line break)."
    assert markdown_roles(text) == ("See `GenerationConfig`, `beam_search`, `tokenloom.nn` and `reorder` "
                                    "(cut by a line break).")
    linked = markdown_roles(":attr:`x`", lambda role, target: f"a.b.{target}")
    assert linked == '<autoref identifier="a.b.x" optional><code>x</code></autoref>'
    assert not RAW_ROLE.search(recipe_reference().replace("`", "<code>"))
    # a literal block (``text::`` and an indented block) is a Markdown code block: its roles bare names
    docstring = "Layout of :func:`load`::\n\n    a  :class:`~x.Y` row\n\nAfter :data:`Z`."
    assert docstring_markdown(docstring) == "Layout of `load`:\n\n    a  Y row\n\nAfter `Z`."


def test_the_cli_reference_wraps_its_help_blocks_at_100_columns():
    """A help block wider than the page is cut at its right edge: argparse wraps the options to COLUMNS (100), and
    the descriptions (written as long lines) wrap too (the CLI's help formatter)."""
    wide, fenced = [], False
    for line in cli_reference().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced and len(line) > 100:
            wide.append(line)
    assert not wide, f"{len(wide)} help lines wider than 100 columns, e.g. {wide[:2]}"


def _readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_lists_every_packaged_recipe():
    from tokenloom.packaged import packaged_recipes

    text = _readme()
    start = text.index("The wheel holds the code and the recipes")
    listed = __import__("re").findall(r"`([\w-]+)`", text[start:text.index("(the files of", start)])
    listed = [name for name in listed if name != "tokenloom"]  # (`tokenloom recipes` lists them)
    assert listed == sorted(packaged_recipes()), \
        f"README's recipe list: missing {sorted(set(packaged_recipes()) - set(listed))}, " \
        f"not packaged {sorted(set(listed) - set(packaged_recipes()))} (keep it sorted, as `tokenloom recipes`)"


def _commands(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """command -> its subcommands, in the parser's order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {name: list(_commands(sub)) for name, sub in action.choices.items()}
    return {}


def test_the_readme_names_every_command_with_its_subcommands():
    """The "What is inside" row of ``cli/`` against the parser: ``tokenloom train | ... | viz (attention, ...)``."""
    import re

    row = next(line for line in _readme().splitlines() if line.startswith("| `cli/` |"))
    listed = {}
    for part in re.search(r"`tokenloom (.+?)`", row).group(1).split(" | "):
        name, _, inner = part.partition(" (")
        listed[name.strip()] = [s.strip() for s in inner.rstrip(")").split(",")] if inner else []
    expected = _commands(build_parser())
    assert listed == expected, f"README's cli/ row: {listed}\nthe parser: {expected}"


def test_the_docs_home_page_names_every_command():
    """docs/index.md's table of commands names each command (`tokenloom X ...` or `X` in its first column)."""
    import re

    text = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    table = text[text.index("## The commands"):]
    named = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            cell = line.split("|")[1]
            named |= {m.split()[0] for m in re.findall(r"`(?:tokenloom )?([^`]+)`", cell)}
    missing = sorted(set(_commands(build_parser())) - named)
    assert not missing, f"commands not on docs/index.md's table: {missing}"


def test_the_install_page_lists_every_extra():
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    text = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    table = text[text.index("| extra | for |"):].split("\n\n")[0]
    listed = [line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]]
    assert sorted(listed) == sorted(extras), \
        f"docs/install.md's extras: missing {sorted(set(extras) - set(listed))}, not in pyproject.toml " \
        f"{sorted(set(listed) - set(extras))}"


def test_the_pyproject_license_is_an_spdx_string():
    """``license = { text = ... }`` makes setuptools warn at every build (PEP 639): an SPDX string, with a build
    backend that reads it (setuptools 77+)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert isinstance(project["project"]["license"], str)
    setuptools, = [r for r in project["build-system"]["requires"] if r.startswith("setuptools")]
    assert int(setuptools.split(">=")[1].split(".")[0]) >= 77, setuptools


USER_FACING = ["README.md", "docs/**/*.md", "configs/*.yaml", "benchmarks/README.md", "data/SOURCES.md",
               "src/tokenloom/**/*.py"]


def test_no_user_facing_text_cites_the_projects_issues():
    """The README, the docs, the recipes and the package's docstrings say what was measured against which
    reference, not "issue 27" or "the issue's target" (the project's history means nothing to a reader)."""
    import re

    cites = re.compile(r"\bissues?[ -]#?\d+|\b(?:the|this|earlier) issues?\b|\bissue's\b", re.I)
    found = []
    for pattern in USER_FACING:
        for path in sorted(ROOT.glob(pattern)):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if cites.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)

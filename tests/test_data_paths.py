"""Every bundled-data path the documentation and the recipes name exists: a ``data/...`` path in README.md or
docs/*.md (globs such as ``data/kb/format_*.jsonl`` match at least one file), and each packaged recipe's data paths
and bundled ``checkpoints/...`` starting point -- so the docs cannot drift to files that are not there."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tokenloom.packaged import packaged_recipes
from tokenloom.training.config import load_run_config

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DATA_PATH = re.compile(r"(?<![\w/.~-])data/[\w.*/-]*")  # data/... not inside another path (metadata/, x/data/)


def _named_paths(text: str) -> set[str]:
    return {m.group(0).rstrip(".-") for m in DATA_PATH.finditer(text)}


def _exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


def test_the_pattern_finds_paths_and_not_parts_of_others():
    text = ("train on data/kb/format_sft.jsonl. See `data/multi30k/`, data/kb/format_*.jsonl and (data/SOURCES.md); "
            "not runs/x/data/y, metadata/z or ~/data/w")
    assert _named_paths(text) == {"data/kb/format_sft.jsonl", "data/multi30k/", "data/kb/format_*.jsonl",
                                  "data/SOURCES.md"}
    assert _exists("data/kb/format_*.jsonl") and not _exists("data/prefs/train.jsonl")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_data_path_the_docs_name_exists(page):
    missing = sorted(p for p in _named_paths(page.read_text(encoding="utf-8")) if not _exists(p))
    assert not missing, f"{page.relative_to(ROOT)} names data that does not exist: {missing}"


def test_every_recipe_names_existing_data():
    missing = []
    for name, path in packaged_recipes().items():
        config = load_run_config(path)
        values = {f"data.{k}": v for k, v in dataclasses.asdict(config.data_config).items()}
        values["train.init_from"] = config.train.init_from
        for key, value in values.items():
            if isinstance(value, str) and value.startswith(("data/", "checkpoints/")) and not (ROOT / value).exists():
                missing.append(f"{name}: {key}={value}")
    assert not missing, missing

"""``tokenloom recipes [NAME]``: the recipes shipped inside the package (tokenloom/recipes), listed or printed."""

from __future__ import annotations

import argparse
import sys

from ..packaged import packaged_recipes, resolve_recipe


def _summary(text: str) -> str:
    """A recipe's first comment line (what it trains), without the ``#``."""
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def recipes(args: argparse.Namespace) -> int:
    if args.name:  # the YAML as shipped, e.g. `tokenloom recipes shakespeare-char > mine.yaml` to edit a copy
        sys.stdout.write(resolve_recipe(args.name).read_text(encoding="utf-8"))
        return 0
    known = packaged_recipes()
    width = max((len(name) for name in known), default=0)
    for name, path in known.items():
        print(f"{name:<{width}}  {_summary(path.read_text(encoding='utf-8'))}".rstrip())
    print("train one: tokenloom train NAME --out DIR; data/ and checkpoints/ paths are the repository's (not packaged)",
          file=sys.stderr)
    return 0

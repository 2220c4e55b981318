"""What the installed package ships and what stays in the repository.

The recipes ship inside the package (``tokenloom/recipes/*.yaml``; in a source checkout that folder is a link to
the repository's ``configs/``), so ``tokenloom train shakespeare-char --out runs/x`` works wherever tokenloom is
installed: a recipe that is not an existing file is looked up by name among them (:func:`resolve_recipe`).

The bundled corpora and checkpoints (``data/``, ``checkpoints/``) are not packaged: they stay in the repository.
The recipes name them by paths relative to the working directory (``data/tinyshakespeare/input.txt``); when such a
path is missing, :func:`where_bundled` adds to the error where those folders are and how to point at them.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .errors import ConfigError
from .registry import did_you_mean

RECIPE_SUFFIXES = (".yaml", ".yml")
BUNDLED = {"data": "the bundled corpora", "checkpoints": "the bundled checkpoints"}  # repository folders


def recipe_folder() -> Path:
    """The folder of the packaged recipes (an installed package is a folder on disk, so a plain path)."""
    return Path(str(resources.files("tokenloom") / "recipes"))


def packaged_recipes() -> dict[str, Path]:
    """Name (the file's stem) -> file of every packaged recipe, sorted by name."""
    folder = recipe_folder()
    if not folder.is_dir():
        return {}
    return {path.stem: path for path in sorted(folder.iterdir(), key=lambda path: path.stem)
            if path.suffix in RECIPE_SUFFIXES and path.is_file()}


def _bare_name(recipe: str) -> str | None:
    """``shakespeare-char`` or ``shakespeare-char.yaml`` -> ``shakespeare-char``; a path (with a folder) -> None."""
    if not recipe or "/" in recipe or "\\" in recipe or recipe in (".", ".."):
        return None
    path = Path(recipe)
    return path.stem if path.suffix in RECIPE_SUFFIXES else recipe


def resolve_recipe(recipe: str | Path) -> Path:
    """The recipe file to read: ``recipe`` itself when it is an existing file (a file always wins), else the
    packaged recipe of that name (``shakespeare-char``). Neither: a one-line :class:`ConfigError` listing the
    packaged recipes, with the closest name."""
    path = Path(recipe)
    if path.is_file():
        return path
    known = packaged_recipes()
    name = _bare_name(str(recipe))
    if name is not None and name in known:
        return known[name]
    listing = f"packaged recipes: {', '.join(known) or 'none'}"
    if name is not None:
        raise ConfigError(f"unknown recipe {str(recipe)!r}: no such file, nor a packaged recipe"
                          f"{did_you_mean(name, known)}; {listing}")
    stem = path.stem if path.suffix in RECIPE_SUFFIXES else path.name
    hint = f" (the packaged recipe {stem!r} is used by its name alone)" if stem in known else did_you_mean(stem, known)
    raise ConfigError(f"config file not found: {recipe}{hint}; {listing}")


def packaged_recipe(name: str) -> Path | None:
    """The packaged recipe ``name`` (or ``name.yaml``), or None."""
    bare = _bare_name(name)
    return packaged_recipes().get(bare) if bare is not None else None


def repository() -> Path | None:
    """The source checkout this package runs from (an editable install), or None (an installed wheel)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "src" / "tokenloom").is_dir() else None


def bundled_folder(path: str | Path) -> str | None:
    """``data`` or ``checkpoints`` when ``path`` is a missing relative path into one of the repository's bundled
    folders, looked up from a working directory other than the repository's own; else None."""
    path = Path(path)
    if path.is_absolute() or not path.parts or path.parts[0] not in BUNDLED or path.exists():
        return None
    repo = repository()
    if repo is not None and Path.cwd().resolve() == repo:
        return None  # in the repository itself: the file is really missing, no other place to point at
    return path.parts[0]


def where_bundled(path: str | Path, key: str | None = None) -> str:
    """``""``, or for a missing ``data/...`` / ``checkpoints/...`` path (see :func:`bundled_folder`) a clause for
    its error: where those folders are and how to point at them (``--set KEY=...`` when the recipe key is known)."""
    folder = bundled_folder(path)
    if folder is None:
        return ""
    repo = repository()
    found = repo is not None and (repo / path).exists()  # an editable install: the checkout's own copy
    target = str(repo / path) if found else f"<repository>/{Path(path).as_posix()}"
    how = f"add --set {key}={target}" if key else f"use {target}"
    return (f" (relative to {Path.cwd()}; {BUNDLED[folder]} are in the tokenloom repository's {folder}/ folder, "
            f"not in the installed package: run from the repository root or {how})")

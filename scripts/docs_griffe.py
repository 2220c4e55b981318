"""Griffe extension (mkdocs.yml, mkdocstrings' ``extensions:``): the docstrings as the API reference shows them.

* The Sphinx roles they are written with (``:class:`GenerationConfig```, ``:func:`~tokenloom.x.f```, ``:mod:``,
  ``:meth:``, ``:attr:``, ``:data:``, ``:exc:``) become the name in code, linked to its entry where the site has one
  (:func:`tokenloom.cli.reference.docstring_markdown`); the name is looked up as Python would from where the
  docstring is, then by its dotted path, then as the one object of the package with that name. A literal block
  (``text::`` and an indented block) becomes a code block, its roles bare names.
* Every public dataclass (``GenerationConfig``, ``TrainConfig``, the model configs, ...) gets a table of its fields
  with their types, defaults and the ``# comment`` after each in the source
  (:func:`tokenloom.cli.reference.field_table`), the same comments the recipe reference shows.

``mkdocs build`` runs from the repository's root, where mkdocs.yml names this file by its path.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import griffe

from tokenloom.cli.reference import docstring_markdown, field_table

log = logging.getLogger("mkdocs.plugins.tokenloom.griffe")


def _walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring of the package once it is loaded (roles as Markdown, dataclass field tables)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "tokenloom":
            return
        objects = list(_walk(pkg))
        by_name: dict[str, list[str]] = defaultdict(list)
        for obj in objects:
            by_name[obj.name].append(obj.path)
        for obj in objects:
            table = self._fields(obj)
            if table:
                text = (obj.docstring.value + "\n\n" if obj.docstring else "") + "**Fields**\n\n" + table
                obj.docstring = griffe.Docstring(text, parent=obj)
            if obj.docstring and obj.docstring.value:
                link = functools.partial(self._link, pkg, obj, by_name)
                obj.docstring.value = docstring_markdown(obj.docstring.value, link)

    @staticmethod
    def _fields(obj: griffe.Object) -> str | None:
        """The field table of a public dataclass (imported: its defaults as Python has them)."""
        if not obj.is_class or obj.name.startswith("_") or not (
                "dataclass" in obj.labels or any("dataclass" in str(d.value) for d in obj.decorators)):
            return None
        try:
            module = importlib.import_module(obj.module.path)
            cls = functools.reduce(getattr, obj.path[len(module.__name__) + 1:].split("."), module)
        except Exception as err:  # noqa: BLE001 - a module that cannot import here keeps its docstring as it is
            log.info("no field table for %s: %s", obj.path, err)
            return None
        return field_table(cls) if dataclasses.is_dataclass(cls) else None

    @staticmethod
    def _find(pkg: griffe.Module, path: str) -> str | None:
        """The canonical path of the package's object at the dotted ``path``; None: not one of the package's."""
        if path != pkg.name and not path.startswith(pkg.name + "."):
            return None
        try:
            found = pkg[path[len(pkg.name) + 1:]] if path != pkg.name else pkg
            return found.final_target.path if found.is_alias else found.path
        except Exception:  # noqa: BLE001 - KeyError, an alias to outside the package, ...
            return None

    def _link(self, pkg: griffe.Module, obj: griffe.Object, by_name: dict[str, list[str]], role: str,
              target: str) -> str | None:
        """The canonical path of the object ``target`` names in ``obj``'s docstring (``role`` is not needed: the
        name says which object); None: not one of the package's."""
        module = obj.module
        if target.startswith("."):  # relative to the docstring's package (~.config.GenerationConfig), .. its parent
            package = module if module.is_init_module else module.parent
            rest = target.lstrip(".")
            for _ in range(len(target) - len(rest) - 1):
                package = package.parent if package.parent is not None else package
            return self._find(pkg, f"{package.path}.{rest}")
        head, _, rest = target.partition(".")
        try:
            scoped = obj.resolve(head)  # a name the docstring's scope knows (a member, an import)
        except Exception:  # noqa: BLE001 - griffe's NameResolutionError, or an alias it cannot follow
            scoped = None
        if scoped and (found := self._find(pkg, f"{scoped}.{rest}" if rest else scoped)):
            return found
        if found := self._find(pkg, target):
            return found
        candidates = [path for path in by_name.get(target.rsplit(".", 1)[-1], []) if path.endswith("." + target)]
        if len(candidates) > 1:  # the one nearest the docstring
            near = max(len(_common(path, obj.path)) for path in candidates)
            candidates = [path for path in candidates if len(_common(path, obj.path)) == near]
        return candidates[0] if len(candidates) == 1 else None


def _common(a: str, b: str) -> list[str]:
    out = []
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        out.append(x)
    return out

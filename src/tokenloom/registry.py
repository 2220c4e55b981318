"""Named, pluggable parts.

Configs name parts by string (``attention: sdpa``, ``position: rope``) so they stay plain YAML; a
:class:`Registry` maps those names to classes or functions. An unknown name raises an error that
lists the known names and the closest match::

    NORMS = Registry("norm")

    @NORMS.register("rmsnorm")
    class RMSNorm(nn.Module): ...

    NORMS.get("rmsnrom")  # RegistryError: unknown norm 'rmsnrom' (did you mean 'rmsnorm'?) ...
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from .errors import RegistryError

T = TypeVar("T")


def closest(name: str, choices: list[str] | tuple[str, ...] | Any) -> str | None:
    """The choice most similar to ``name``, or None when nothing is close."""
    hits = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.5)
    return hits[0] if hits else None


def did_you_mean(name: str, choices: Any) -> str:
    """`` (did you mean 'x'?)`` or an empty string."""
    hit = closest(name, choices)
    return f" (did you mean {hit!r}?)" if hit else ""


class Registry(Generic[T]):
    """A name -> part table for one kind of part (``kind`` appears in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name``; names are unique per registry."""

        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name (a list from YAML)
            known = ", ".join(sorted(self._items))
            raise RegistryError(
                f"unknown {self.kind} {name!r}{did_you_mean(name, self._items)}; known: {known}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def names(self) -> list[str]:
        return sorted(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"

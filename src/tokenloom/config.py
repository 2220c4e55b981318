"""Dataclass configs <-> plain dicts / YAML, with dotted overrides and clear validation errors.

* :func:`from_dict` builds a (nested) dataclass from a dict, checking every key and type: an unknown
  key names the closest known one, a wrong type names the field, the value and the expected type.
* :func:`to_dict` is the inverse; :func:`load_yaml` / :func:`save_yaml` read and write files.
* :func:`apply_overrides` applies ``["train.max_steps=500", "model.dropout=0.1"]`` to a dict; the
  values are parsed as YAML scalars (``500`` -> int, ``true`` -> bool, ``null`` -> None).

Range checks live in each dataclass's ``__post_init__`` and raise :class:`ConfigError` naming the
field, the value and what is allowed.

:func:`from_dict` reports every problem of a config at once: it goes on past a bad key (leaving that field at its
default), builds the dataclass from the good ones to run its range checks, and raises the one error found as it is,
or a :class:`ConfigProblems` listing them all (``"3 problems in configs/x.yaml:"`` and one ``"  - ..."`` line each).
"""

from __future__ import annotations

import dataclasses
import math
import re
import reprlib
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

from .errors import ConfigError, ConfigProblems, unique_problems
from .registry import closest, did_you_mean

T = TypeVar("T")


def type_name(tp: Any) -> str:
    """A type hint as messages and the recipe reference show it: ``int or null``, ``list[float]``,
    ``one of 'a', 'b'``."""
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in get_args(tp))
    if origin in (list, tuple, dict) and get_args(tp):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in get_args(tp) if a is not Ellipsis)}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class _NotFinite(ConfigError):
    """A float setting given as NaN or an infinity."""


class _UnknownKey(ConfigError):
    """A key the dataclass has no field for; ``brief`` drops the list of allowed keys where a close match is named
    (how it reads among several problems)."""

    def __init__(self, message: str, brief: str) -> None:
        super().__init__(message)
        self.brief = brief

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.brief)


def raise_problems(errors: Sequence[ConfigError], source: str | None = None) -> None:
    """Raise nothing when ``errors`` is empty, the error itself when there is one (its message and type unchanged),
    else one :class:`ConfigProblems` listing them (headed ``N problems in <source>``)."""
    errors = unique_problems(errors)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigProblems(errors, source) from None


def gather(errors: list[ConfigError], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """Run ``fn(*args, **kwargs)``; a :class:`ConfigError` it raises joins ``errors`` instead (False is returned).
    For a ``__post_init__`` that validates several independent parts and reports them together."""
    try:
        fn(*args, **kwargs)
    except ConfigError as err:
        errors.append(err)
        return False
    return True


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the type hint ``tp``; return it (ints widen to floats)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for arg in get_args(tp):
            try:
                return _coerce(value, arg, where)
            except (_NotFinite, ConfigProblems):
                raise  # a number of the right type but NaN or infinite: that, not "expected float or null"; or a
                #   mapping with several problems of the dataclass it is given for
            except ConfigError as err:
                errors.append(err)
        raise ConfigError(f"{where}: expected {type_name(tp)}, got {shown(value)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{where}: expected null, got {shown(value)}")
    if origin is Literal:
        if value in get_args(tp):
            return value
        allowed = ", ".join(repr(a) for a in get_args(tp))
        raise ConfigError(f"{where}: {shown(value)} is not allowed{did_you_mean(value, get_args(tp))}; "
                          f"choose one of {allowed}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, prefix=where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {shown(value)}")
        (item_tp, *_) = get_args(tp) or (Any,)
        items = [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {shown(value)}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 2 ** 1024 else math.inf  # (an int too large for a float)
        elif isinstance(value, str) and _FLOAT.fullmatch(value.strip()):  # YAML 1.1 reads 1e-4 as a string
            number = float(value)
        if number is not None:
            if not math.isfinite(number):  # no setting is a NaN or infinite number (null turns off what can be off)
                raise _NotFinite(f"{where}: expected a finite number, got {shown(value)}")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{where}: expected {type_name(tp)}, got {shown(value)} ({type(value).__name__})")


def from_dict(cls: type[T], data: Any, prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, validating keys and types (see module docstring). Every problem is
    reported: one alone as it is, several as one :class:`ConfigProblems`."""
    if isinstance(data, cls):
        return data
    name = prefix or cls.__name__
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{name}: expected a mapping of fields, got {shown(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs, errors, dropped = {}, [], set()
    for key, value in data.items():
        if not (printable(key) and printable(value)):  # the messages below quote both
            at = (f"{prefix}.{key}" if prefix else str(key)) if printable(key) else name
            errors.append(ConfigError(f"{at}: holds an integer too long to print (more than 4300 digits); no setting "
                                      f"takes one"))
            dropped.add(key if printable(key) else None)
            continue
        where = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            hint = did_you_mean(str(key), fields)
            message = f"unknown key {where!r}{hint}"
            dropped.add(closest(str(key), fields))  # the field it likely meant: a check of its default is not trusted
            errors.append(_UnknownKey(f"{message}; allowed: {', '.join(fields)}",
                                      message if hint else f"{message}; allowed: {', '.join(fields)}"))
            continue
        try:
            kwargs[key] = _coerce(value, hints[key], where)
        except ConfigError as err:
            errors.append(err)
            dropped.add(key)
    built = _build(cls, kwargs, prefix, errors, dropped)
    raise_problems(errors)
    return built


def _named_fields(message: str, fields: Sequence[str], prefix: str) -> list[str]:
    """The fields a message names, in the order it names them (the section's prefix left out)."""
    if prefix and message.startswith(prefix + "."):
        message = message[len(prefix) + 1:]
    hits = ((m.start(), name) for name in fields if (m := re.search(rf"(?<!\w){re.escape(name)}(?!\w)", message)))
    return [name for _, name in sorted(hits)]


def _subject(message: str, prefix: str) -> str:
    """The first word of a message, the section's prefix left out: ``"train.lr must be ..."`` -> ``"train"``."""
    if prefix and message.startswith(prefix + "."):
        message = message[len(prefix) + 1:]
    match = re.match(r"\w+", message)
    return match.group() if match else ""


def _prefixed(err: ConfigError, prefix: str) -> ConfigError:
    """A ``__post_init__``'s error with the section's prefix: ``model.`` + ``"dropout must be ..."``; an unknown key
    of a part it validates gets it inside the quotes (``unknown key 'model.attention_options.x'``)."""
    text = str(err)
    if not prefix or text.startswith(prefix):
        return err
    if text.startswith("unknown key '") and isinstance(err, _UnknownKey):
        return _UnknownKey(text.replace("'", f"'{prefix}.", 1), err.brief.replace("'", f"'{prefix}.", 1))
    return ConfigError(f"{prefix}.{text}")


def _build(cls: type[T], kwargs: dict[str, Any], prefix: str, errors: list[ConfigError], dropped: set) -> T | None:
    """``cls(**kwargs)``, its range-check errors added to ``errors``. After a failed check the field it names is
    left at its default and the build retried, so several bad values of one section are all reported; an error
    that names a field already left out (it may come from that default) ends the search. None if not built."""
    fields = [f.name for f in dataclasses.fields(cls)]
    while True:
        try:
            return cls(**kwargs)
        except ConfigError as err:
            found = [_prefixed(e, prefix) for e in unique_problems([err])]
            if isinstance(err, ConfigProblems):  # a __post_init__ that reports all of its problems itself: each
                #   stands unless it is about a field left out (its subject, the message's first word)
                errors += [e for e in found if _subject(str(e), prefix) not in dropped]
                return None
            trusted = [e for e in found if not dropped & set(_named_fields(str(e), fields, prefix))]
            errors += trusted
            if len(trusted) != 1:
                return None  # one not to trust
            key = next((k for k in _named_fields(str(trusted[0]), fields, prefix) if k in kwargs), None)
            if key is None:
                return None
            del kwargs[key]
            dropped.add(key)
        except Exception:
            if not errors:  # (not a problem of the values given: raised as before)
                raise
            return None  # a check that a value left at its default upset: the errors found stand


def to_dict(obj: Any) -> Any:
    """A dataclass (possibly nested) as plain dicts/lists, ready for YAML."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


MAX_YAML_BYTES = 4 << 20  # a recipe, sweep or checkpoint config.yaml: a few KiB in practice
MAX_YAML_NODES = 100_000  # scalars, lists and mappings once every alias is expanded (a recipe has a few hundred)


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a document of more than :data:`MAX_YAML_NODES` nodes counted with every
    alias expanded, before building any Python object: a "billion laughs" document (9 aliases of 9 aliases of ...)
    composes into a few dozen shared nodes but reads as 9**9 values to whatever walks the result."""

    def compose_document(self):  # noqa: ANN201 - PyYAML's signature
        node = super().compose_document()
        if _expanded_size(node, MAX_YAML_NODES) > MAX_YAML_NODES:
            raise _TooLarge(f"it expands to more than {MAX_YAML_NODES} values once its aliases are expanded "
                            "(an alias bomb, or an alias inside its own anchor)")
        return node


class _TooLarge(ValueError):
    """A YAML document past :data:`MAX_YAML_NODES`."""


def _expanded_size(root: yaml.Node, cap: int) -> int:
    """Nodes under ``root`` with aliases expanded (shared nodes counted at every use), computed once per distinct
    node (so in time linear in the composed graph) and saturating just past ``cap``; a node that holds an alias of
    itself (``a: &x [*x]``) expands without end: past ``cap`` too."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()  # nodes whose children are being counted: meeting one again is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            children = []
        if children_done or not children:
            open_.discard(id(node))
            sizes[id(node)] = min(cap + 1, 1 + sum(sizes.get(id(c), 0) for c in children))
        else:
            if any(id(c) in open_ or c is node for c in children):
                return cap + 1
            open_.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes[id(root)]


def safe_load(text: str) -> Any:
    """``yaml.safe_load`` of ``text`` with the node bound of :class:`_BoundedLoader` (past it: ValueError)."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping; a missing file, bad YAML or a document past :data:`MAX_YAML_BYTES` bytes or
    :data:`MAX_YAML_NODES` values is a one-line :class:`ConfigError`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        size = path.stat().st_size
        data = safe_load(path.read_text(encoding="utf-8")) if size <= MAX_YAML_BYTES else None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = (str(getattr(err, "problem", None) or err).splitlines() or ["unreadable"])[0]
        raise ConfigError(f"{path}: invalid YAML{at}: {problem}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
    except ValueError as err:  # past the node bound, or an integer of more than 4300 digits (Python's int() limit)
        raise ConfigError(f"{path}: invalid YAML: {(str(err).splitlines() or ['a bad value'])[0]}") from None
    if size > MAX_YAML_BYTES:
        raise ConfigError(f"{path}: {size} bytes, over the limit of {MAX_YAML_BYTES} for a YAML config")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def save_yaml(data: dict, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    """Apply ``key.sub=value`` strings to a nested dict (in place) and return it."""
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        try:
            value = safe_load(raw) if raw.strip() else ""
        except (yaml.YAMLError, ValueError, RecursionError):  # ValueError: an int of more than 4300 digits
            value = raw
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def printable(value: Any) -> bool:
    """False for a value an error message cannot show: an int longer than ``str()`` converts (Python's 4,300-digit
    limit; YAML's hex ``0x...`` has no such limit), or a container holding one. Check it before quoting ``value``.
    Each distinct object is looked at once, so a structure of shared parts (YAML aliases) costs its distinct size."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, int) and not isinstance(item, bool) and item.bit_length() > 14_000:
            try:
                repr(item)
            except ValueError:
                return False
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
    return True


class _ShortRepr(reprlib.Repr):
    """``repr`` cut to a few items a level, a few levels deep and a few dozen characters a string."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxlong, self.maxother = 3, 80, 40, 80
        self.maxtuple = self.maxlist = self.maxarray = self.maxdict = self.maxset = self.maxfrozenset = 6
        self.maxdeque = 6

    def repr_int(self, x: int, level: int) -> str:  # noqa: ARG002 - reprlib's signature
        try:
            return super().repr_int(x, level)
        except ValueError:  # past Python's 4,300-digit limit for str(int)
            return f"<an integer of {x.bit_length()} bits>"


_SHORT_REPR = _ShortRepr()


def shown(value: Any) -> str:
    """``value`` as an error message quotes it: its ``repr``, cut short for long strings, large containers and
    huge integers (a message never renders a value whose size the user chose)."""
    return _SHORT_REPR.repr(value)


def check(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds (for ``__post_init__``)."""
    if not condition:
        raise ConfigError(message)


def check_choice(field: str, value: str, registry: Any) -> None:
    """Reject a part name that ``registry`` does not know, naming the field and the closest match."""
    if value not in registry:
        raise ConfigError(f"{field}: unknown {registry.kind} {shown(value)}{did_you_mean(value, registry)}; "
                          f"known: {', '.join(registry.names())}")

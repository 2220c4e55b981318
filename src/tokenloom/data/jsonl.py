"""Reading JSON Lines files: one JSON value a line, blank lines skipped, every problem a one-line
:class:`~tokenloom.errors.DataError` naming ``path:line`` -- while a line is read (:func:`read_jsonl`) and while the
record it became is encoded (:func:`record_errors`: characters outside the tokenizer's vocabulary, ...)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import DataError, TokenizerError


def read_jsonl(path: str | Path, what: str = "JSONL") -> Iterator[tuple[str, Any]]:
    """(``"path:line"``, the line's JSON value) for every non-blank line of ``path``; a missing file (``"{what} file
    not found"``), text that is not UTF-8 or a line that is not JSON is a one-line :class:`DataError`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror or err}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
        yield where, obj


@contextlib.contextmanager
def record_errors(where: str) -> Iterator[None]:
    """Encode a record read from ``where`` (``"path:line"``, as :func:`read_jsonl` names it) inside this block: a
    :class:`~tokenloom.errors.TokenizerError` raised there (characters outside the vocabulary, a template the record
    breaks) is raised again, of the same class, as ``"path:line: <message>"``."""
    try:
        yield
    except TokenizerError as err:
        message = str(err)
        if not where or message.startswith(f"{where}:"):
            raise
        raise type(err)(f"{where}: {message}") from None

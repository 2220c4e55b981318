"""Reading JSON Lines files: one JSON value a line, blank lines skipped, every problem a one-line
:class:`~tokenloom.errors.DataError` naming ``path:line``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import DataError


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

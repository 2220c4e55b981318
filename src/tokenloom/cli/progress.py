"""Progress of the commands that work through many inputs (``evaluate``, ``translate``, ``distill``, ``classify``):
a tqdm bar while stderr is a terminal, and in every case one summary line on stderr at the end, e.g.
``translated 1,014 sentences in 12.3 s (82/s)``. Nothing of it goes to stdout, which a user may pipe."""

from __future__ import annotations

import json
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # no stderr, or a closed one
        return False


def summary(verb: str, count: int, unit: str, seconds: float) -> str:
    """``translated 1,014 sentences in 12.3 s (82/s)``."""
    per_second = count / seconds if seconds > 0 else 0.0
    digits = 0 if per_second >= 10 else 1 if per_second >= 1 else 2  # 82/s, 1.5/s, 0.25/s: never "1/s" for 1.49
    rate = f" ({per_second:,.{digits}f}/s)" if seconds > 0 else ""
    return f"{verb} {count:,} {unit}{'' if count == 1 else 's'} in {seconds:.1f} s{rate}"


@contextmanager
def progress(command: str, total: int | None, verb: str, unit: str) -> Iterator[Callable[[int], None]]:
    """An ``update(n)`` callable to call as work is done (``n`` more of ``unit``); the bar is labelled
    ``command`` and sized by ``total`` (None when unknown); warnings meanwhile print on lines of their own above it.
    The summary line is printed when the block ends without an exception."""
    bar, shown = None, warnings.showwarning
    if stderr_is_terminal():
        from tqdm import tqdm

        bar = tqdm(total=total, unit=unit, desc=command, file=sys.stderr, leave=False, dynamic_ncols=True,
                   disable=False)

        def above_the_bar(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
            bar.write(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"), file=sys.stderr)

        warnings.showwarning = above_the_bar  # a warning on a line of its own, not after the bar's
    done = 0
    start = time.perf_counter()

    def update(n: int) -> None:
        nonlocal done
        done += n
        if bar is not None:
            bar.update(n)

    try:
        yield update
    finally:
        if bar is not None:
            warnings.showwarning = shown
            bar.close()
    print(summary(verb, done, unit, time.perf_counter() - start), file=sys.stderr, flush=True)


def print_speed(speed) -> None:  # noqa: ANN001 - a tokenloom.speed.Speed
    """A command's ``--verbose`` speed figures (:func:`tokenloom.speed.speed_lines`: load, prompt, decode, speculative,
    total), one ``label: text`` line each on stderr; stdout keeps only the command's output."""
    from ..speed import speed_lines

    for line in speed_lines(speed):
        print(line, file=sys.stderr, flush=True)


def print_result(result: dict, as_json: bool, width: int = 14) -> None:
    """A command's result on stdout: one JSON line (``--json``), else a ``key: value`` line per entry (floats to
    four decimals, the keys right-aligned to ``width``)."""
    if as_json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>{width}}: {value:.4f}" if isinstance(value, float) else f"{key:>{width}}: {value}")

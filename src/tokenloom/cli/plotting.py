"""matplotlib for the CLI's optional plots (the ``viz`` extra), imported lazily."""

from __future__ import annotations

import sys
from types import ModuleType


def pyplot(what: str) -> ModuleType | None:
    """``matplotlib.pyplot`` drawing to files only (the Agg backend), or None with a one-line notice on stderr
    that ``what`` is skipped when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed (pip install 'tokenloom[viz]'): no {what}", file=sys.stderr)
        return None
    return plt

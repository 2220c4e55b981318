"""The attention backend registry, and backends in files of their own.

``ATTENTION_BACKENDS`` maps a name (``attention:`` in a model config) to a function ``backend(q, k, v, attn_mask,
is_causal, dropout_p, need_weights) -> (out, weights | None)`` or to a class built once per attention layer
(``cls(num_heads, head_dim, max_len=, **options)``, its options declared by an ``Options`` dataclass); see
:mod:`tokenloom.nn.attention`. Every module in this package is imported when :mod:`tokenloom.nn.attention` is, so
a new backend is one file here that registers itself: the registry tests (tests/registry) pick it up by name.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

from ...registry import Registry

ATTENTION_BACKENDS: Registry[Callable] = Registry("attention backend")


def load_backend_files() -> None:
    """Import every module of this package (each registers its backend)."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")

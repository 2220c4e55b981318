"""Resource budgets: refuse, before allocating, what cannot fit in this machine's memory.

A size that cannot fit (``model.num_layers=1000000000``, ``serve --max-batch 100000``, ``generate --beam 100000``)
would otherwise allocate for minutes, or fail deep inside torch with a traceback, or be killed by the kernel. The
checks here compare a simple *estimate* with a *limit* and raise a one-line error naming both::

    model.num_layers=1000000000: the model needs about 6.4 PiB (its 1000000000 blocks: 6.4 PiB); this machine
    has 23.5 GiB (physical memory; set TOKENLOOM_MEMORY_LIMIT to change)

* **Estimates** count the big tensors only (weights and tables as the number of values x bytes per value; see
  :mod:`tokenloom.models.sizes` for the models, :func:`kv_cache_bytes` for key/value caches). They are lower
  bounds: what is refused can never fit, while something that passes may still run short of memory.
* **The limit** is the memory available for new allocations right now: ``MemAvailable`` of ``/proc/meminfo``
  (free memory plus the page cache the kernel can reclaim; Linux), else ``psutil``'s ``available`` when installed,
  else the physical memory (``os.sysconf``); capped by a container's cgroup memory limit. The checks run just
  before the allocation they guard, so what this process already holds (a loaded model) is not counted twice,
  and an allocation that would push the machine into the out-of-memory killer (which may pick another process)
  is refused instead. ``TOKENLOOM_MEMORY_LIMIT`` overrides it: a size (``64GiB``, ``512MB``, ``2e9`` bytes), a
  share of the physical memory (``50%``), or ``none`` to switch the checks off.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from pathlib import Path

from .errors import ConfigError, TokenloomError

ENV = "TOKENLOOM_MEMORY_LIMIT"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10 ** 3, "kib": 1 << 10, "m": 1 << 20, "mb": 10 ** 6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10 ** 9, "gib": 1 << 30, "t": 1 << 40, "tb": 10 ** 12, "tib": 1 << 40,
          "p": 1 << 50, "pb": 10 ** 15, "pib": 1 << 50}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``; binary units, three significant digits (``'64 GiB'``, ``'6.4 PiB'``)."""
    for unit, size in (("EiB", 1 << 60), ("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20),
                       ("KiB", 1 << 10)):
        if n >= size:
            value = n / size
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:,.0f} {unit}"
    return f"{int(n)} bytes"


def parse_size(text: str, total: int | None = None) -> int | None:
    """A memory size: ``'64GiB'``, ``'512 MB'``, ``'2e9'`` (bytes), ``'50%'`` (of ``total``); ``'none'`` -> None.
    A :class:`ConfigError` naming ``TOKENLOOM_MEMORY_LIMIT`` otherwise."""
    value = text.strip().lower()
    if value in ("none", "off", "unlimited"):
        return None
    if value.endswith("%"):
        try:
            share = float(value[:-1])
        except ValueError:
            share = math.nan
        if not 0 < share <= 100 or total is None:
            raise ConfigError(f"{ENV}={text!r}: a percentage must be in (0, 100]"
                              + ("" if total is not None else " (this machine's memory size is unknown)"))
        return int(total * share / 100)
    match = _SIZE.fullmatch(value)
    if match is None or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"{ENV}={text!r} is not a memory size: use e.g. 64GiB, 512MB, 2e9 (bytes), 50% (of the "
                          "physical memory) or none")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _meminfo(key: str) -> int | None:
    """A ``/proc/meminfo`` entry in bytes (Linux), None elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _psutil(field: str) -> int | None:
    try:
        import psutil  # optional (Windows, macOS)

        return int(getattr(psutil.virtual_memory(), field))
    except Exception:  # noqa: BLE001 - not installed, or unsupported here
        return None


def physical_memory() -> int | None:
    """This machine's memory in bytes (None when it cannot be told)."""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        if pages > 0 and size > 0:
            return pages * size
    except (AttributeError, ValueError, OSError):
        pass
    return _meminfo("MemTotal") or _psutil("total")


def available_memory() -> tuple[int | None, str]:
    """(bytes a new allocation may take now, where the number comes from)."""
    for value, source in ((_meminfo("MemAvailable"), "memory available now"),
                          (_psutil("available"), "memory available now"),
                          (physical_memory(), "physical memory")):
        if value is not None:
            return value, source
    return None, "unknown"


def _cgroup_limit() -> int | None:
    """A container's memory limit (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``), None when unlimited."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max", or v1's huge "unlimited" number
            return int(text)
    return None


def memory_limit() -> tuple[int | None, str]:
    """(bytes, where the number comes from) of the budget; bytes None = no limit (unknown, or switched off)."""
    override = os.environ.get(ENV, "").strip()
    if override:
        return parse_size(override, physical_memory()), f"{ENV}={override}"
    limit, source = available_memory()
    container = _cgroup_limit()
    if container is not None and (limit is None or container < limit):
        limit, source = container, "the container's memory limit"
    return limit, f"{source}; set {ENV} to change"


def check_memory(what: str, parts: Iterable[tuple[str, float]], *,
                 error: type[TokenloomError] = ConfigError) -> None:
    """Refuse ``what`` (e.g. ``'model.num_layers=1000000000'``) when the sum of its ``parts`` ((label, bytes),
    largest named) exceeds :func:`memory_limit`: a one-line ``error`` naming the estimate and the limit."""
    parts = [(label, float(n)) for label, n in parts if n > 0]
    need = sum(n for _, n in parts)
    limit, source = memory_limit()
    if limit is None or need <= limit:
        return
    parts.sort(key=lambda part: -part[1])
    detail = ", ".join(f"{label}: {format_bytes(n)}" for label, n in parts[:2])
    raise error(f"{what} needs about {format_bytes(need)} of memory ({detail}); this machine has "
                f"{format_bytes(limit)} ({source})")


def kv_cache_bytes(num_layers: int, rows: int, num_kv_heads: int, length: int, head_dim: int,
                   bytes_per_value: int) -> int:
    """A preallocated key/value cache: ``num_layers x 2 (keys, values) x rows x num_kv_heads x length x head_dim``
    values (:class:`tokenloom.nn.KVCache`, the server's row cache)."""
    return num_layers * 2 * rows * num_kv_heads * length * head_dim * bytes_per_value


def describe_kv_cache(num_layers: int, rows: int, num_kv_heads: int, length: int, head_dim: int,
                      bytes_per_value: int) -> str:
    """How :func:`kv_cache_bytes` counted, for the error message."""
    return (f"key/value cache of {rows} rows x {num_layers} layers x 2 x {length} positions x "
            f"{num_kv_heads * head_dim} x {bytes_per_value} bytes")

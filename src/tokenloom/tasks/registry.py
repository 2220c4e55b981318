"""``TASKS``: what a batch is, the loss and the metrics, by task name (``lm``, ...)."""

from __future__ import annotations

from ..registry import Registry

TASKS: Registry[type] = Registry("task")

"""``MODELS``: model families by name (``gpt``, later ``seq2seq``, ``vit``, ...), each a (config class,
model class) pair so a checkpoint's ``config.yaml`` can name its family."""

from __future__ import annotations

from ..registry import Registry

MODELS: Registry[tuple[type, type]] = Registry("model")

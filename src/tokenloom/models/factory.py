"""Build a model from a plain ``model:`` mapping: ``{family: gpt, num_layers: 6, ...}``."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import from_dict, to_dict
from .registry import MODELS


def model_config_from_dict(data: dict[str, Any], prefix: str = "model") -> tuple[str, Any]:
    """Validate a ``model:`` section -> (family, config dataclass). ``family`` defaults to ``gpt``."""
    data = dict(data or {})
    family = data.pop("family", "gpt")
    config_cls, _ = MODELS.get(family)
    return family, from_dict(config_cls, data, prefix=prefix)


def model_config_to_dict(family: str, config: Any) -> dict[str, Any]:
    return {"family": family, **to_dict(config)}


def create_model(family: str, config: Any) -> nn.Module:
    _, model_cls = MODELS.get(family)
    return model_cls(config)

"""Build a model from a plain ``model:`` mapping: ``{family: gpt, num_layers: 6, ...}``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..config import from_dict, to_dict
from ..errors import ConfigError
from .options import migrate_model_section
from .registry import MODELS
from .sizes import check_model_memory


def model_config_from_dict(data: dict[str, Any], prefix: str = "model") -> tuple[str, Any]:
    """Validate a ``model:`` section -> (family, config dataclass). ``family`` defaults to ``gpt``."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping of model fields (family, num_layers, ...), got "
                          f"{type(data).__name__}")
    data = migrate_model_section(dict(data or {}))
    family = data.pop("family", "gpt")
    config_cls, _ = MODELS.get(family)
    return family, from_dict(config_cls, data, prefix=prefix)


def model_config_to_dict(family: str, config: Any) -> dict[str, Any]:
    return {"family": family, **to_dict(config)}


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "zeros_", "ones_", "xavier_uniform_",
                   "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")


@contextlib.contextmanager
def _no_weight_init() -> Iterator[None]:
    """Make ``torch.nn.init`` functions no-ops: parameters keep whatever memory they were given. Buffers
    computed by the modules themselves (RoPE tables, masks) are still built. Not thread-safe."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def create_model(family: str, config: Any, *, init: bool = True) -> nn.Module:
    """The model of ``family`` for ``config``. ``init=False`` skips random initialisation (parameters hold
    uninitialised memory): for weights that are about to be loaded, where initialising a large model would
    take longer than loading it. A model that cannot fit in memory is refused first, in one line
    (:func:`tokenloom.models.sizes.check_model_memory`; not on the meta device, which allocates nothing)."""
    _, model_cls = MODELS.get(family)
    if torch.get_default_device().type != "meta":
        check_model_memory(config)
    if init:
        return model_cls(config)
    with _no_weight_init():
        return model_cls(config)

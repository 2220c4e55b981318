"""Switching a model into eval mode for a while without paying for it on every call.

``model.eval()`` walks the model and sets an attribute on every module (~1.5 ms for a 6 + 6-layer translation
model), and code that restores the mode afterwards pays it twice per call: a quarter of the time of translating
one sentence with a non-autoregressive model. These switch only the modules that are training, and restore each
module's own mode (a submodule left in training mode stays so)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


def enter_eval(model: nn.Module) -> list:
    """Put every training module of ``model`` in eval mode; -> what was switched, for :func:`restore_training`.
    A model-like object without ``modules()`` (only ``training`` / ``train()`` / ``eval()``) is switched as a
    whole."""
    if not hasattr(model, "modules"):
        if not model.training:
            return []
        model.eval()
        return [model]
    training = [m for m in model.modules() if m.training]
    for m in training:
        m.training = False
    return training


def restore_training(switched: list) -> None:
    for m in switched:
        if isinstance(m, nn.Module):
            m.training = True
        else:
            m.train(True)


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Eval mode for the duration of the block (see the module docstring)."""
    switched = enter_eval(model)
    try:
        yield model
    finally:
        restore_training(switched)

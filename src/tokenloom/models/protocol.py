"""Contracts a model declares on its type, for the layers above models/ to ask instead of probing attributes."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class BlockStacks(Protocol):
    """A model whose Transformer blocks live in more than one stack (an encoder-decoder: the encoder's and the
    decoder's). A model without it keeps its one stack as ``blocks`` (an ``nn.ModuleList``)."""

    def block_stacks(self) -> tuple[nn.ModuleList, ...]:
        """The model's block stacks, input side first."""
        ...


def block_stacks(model: nn.Module) -> tuple[nn.ModuleList, ...]:
    """``model``'s block stacks: the ones it declares (:class:`BlockStacks`), else its ``blocks`` list, else none."""
    if isinstance(model, BlockStacks):
        return model.block_stacks()
    stack = model._modules.get("blocks")
    return (stack,) if isinstance(stack, nn.ModuleList) else ()

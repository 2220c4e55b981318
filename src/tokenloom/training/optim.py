"""AdamW with weight decay on matrices only (no decay for biases, norms)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def param_groups(params: nn.Module | Iterable[nn.Parameter], weight_decay: float) -> list[dict]:
    """Two groups: parameters with >= 2 dims (weights, embeddings) decay; the rest (biases, norm
    gains) do not. Tied parameters appear once."""
    decay, no_decay = [], []
    for p in params.parameters() if isinstance(params, nn.Module) else params:  # a shared tensor once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def create_optimizer(model: nn.Module | Iterable[nn.Parameter], *, lr: float, weight_decay: float,
                     betas: tuple[float, float], eps: float = 1e-8) -> torch.optim.AdamW:
    groups = param_groups(model, weight_decay)
    fused = all(p.device.type in ("cpu", "cuda") for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)


def _order(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[str]:
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _by_position(state: dict) -> bool:
    return all(isinstance(key, int) for key in state["state"]) and all(
        isinstance(i, int) for group in state["param_groups"] for i in group["params"])


def named_optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str],
                          state: dict | None = None) -> dict:
    """``optimizer.state_dict()`` (or a position-keyed ``state`` of the same layout) keyed by parameter name
    instead of position (``names``: id(param) -> name): the form PyTorch's distributed checkpoint API uses,
    which loads whatever the sharding."""
    state = optimizer.state_dict() if state is None else state
    if not _by_position(state):
        return state
    order = _order(optimizer, names)
    return {"state": {order[i]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [order[i] for i in group["params"]]}
                             for group in state["param_groups"]]}


def load_named_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, names: dict[int, str]) -> None:
    """Load a state from :func:`named_optimizer_state` (or a plain position-keyed one)."""
    if _by_position(state):
        optimizer.load_state_dict(state)
        return
    index = {name: i for i, name in enumerate(_order(optimizer, names))}
    missing = [n for group in state["param_groups"] for n in group["params"] if n not in index]
    if missing:
        raise KeyError(f"the optimizer state names parameters this model lacks: {missing[:3]}")
    optimizer.load_state_dict({
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in state["param_groups"]]})

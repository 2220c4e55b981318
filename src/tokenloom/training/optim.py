"""AdamW with weight decay on matrices only (no decay for biases, norms); ``muon``: Muon for the hidden matrices,
AdamW for the rest (:class:`MuonWithAdamW`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from ..hardware import bf16_support
from ..models.protocol import block_stacks


def param_groups(params: nn.Module | Iterable[nn.Parameter], weight_decay: float) -> list[dict]:
    """Two groups: parameters with >= 2 dims (weights, embeddings) decay; the rest (biases, norm
    gains) do not. Tied parameters appear once."""
    decay, no_decay = [], []
    for p in params.parameters() if isinstance(params, nn.Module) else params:  # a shared tensor once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def create_optimizer(model: nn.Module | Iterable[nn.Parameter], *, lr: float, weight_decay: float,
                     betas: tuple[float, float], eps: float = 1e-8, optimizer: str = "adamw",
                     muon_lr: float = 0.02, hidden: Iterable[nn.Parameter] = (),
                     tensor_lr: bool = False) -> torch.optim.Optimizer:
    """AdamW over ``model`` (:func:`param_groups`); ``optimizer="muon"``: Muon (at ``muon_lr``) for the ``hidden``
    parameters (:func:`hidden_matrices`), AdamW for the rest. ``tensor_lr``: every group's learning rate a 0-dim
    float32 tensor (a schedule fills it in place) and AdamW's single-tensor update instead of the fused kernel: what
    ``torch.compile`` of the step wants (``train.compile: step``), a new learning rate then recompiling nothing."""
    if optimizer == "muon":
        hidden_ids = {id(p) for p in hidden}
        params = list(model.parameters() if isinstance(model, nn.Module) else model)
        rest = [p for p in params if id(p) not in hidden_ids]
        muon = [p for p in params if id(p) in hidden_ids and p.requires_grad]
        optim: torch.optim.Optimizer = MuonWithAdamW(param_groups(rest, weight_decay), muon, lr=lr, muon_lr=muon_lr,
                                                     betas=betas, eps=eps, fused=not tensor_lr)
    else:
        groups = param_groups(model, weight_decay)
        fused = not tensor_lr and all(p.device.type in ("cpu", "cuda") for g in groups for p in g["params"])
        optim = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused,
                                  foreach=False if tensor_lr else None)
    if tensor_lr:
        for group in optim.param_groups:
            group["lr"] = torch.tensor(float(group["lr"]))
    return optim


OPTIMIZERS = ("adamw", "muon")  # train.optimizer


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The parameters ``train.optimizer: muon`` gives to Muon: the weights of the ``nn.Linear`` layers inside a
    model's block stacks (:func:`~tokenloom.models.protocol.block_stacks`: an encoder-decoder's encoder and decoder,
    else the ``blocks`` list, of any module at any depth: the attention and MLP projections). Everything else
    (embeddings, the output head, norms, biases, position tables) stays with AdamW. Trainable ones only; a tied
    tensor once."""
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for stack in block_stacks(module):
            for layer in stack.modules():
                if isinstance(layer, nn.Linear) and layer.weight.requires_grad and layer.weight.dim() == 2:
                    found.setdefault(id(layer.weight), layer.weight)
    return list(found.values())


def newton_schulz(g: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> Tensor:
    """The quintic Newton-Schulz orthogonalisation of a 2-D ``g`` as ``torch.optim.Muon`` runs it (Keller Jordan's
    iteration: X = G / ||G||_F on the short side, then ``steps`` times A = X X^T, X = a X + (b A + c A^2) X), in
    ``dtype`` (torch's always bf16)."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def newton_schulz_dtype(params: list[nn.Parameter]) -> torch.dtype:
    """bf16 (torch's choice) where bf16 products are fast: on accelerators and CPUs that :func:`bf16_support` finds
    native; else float32. Muon's iteration is a fifth of a step on the 4 x 256 demo model (batch 16 x 256); on an Intel
    Xeon whose bf16 products run at 0.5x float32 the float32 iteration took 155 ms where bf16 took 264 (one thread)."""
    if any(p.device.type != "cpu" for p in params) or bf16_support().native:
        return torch.bfloat16
    return torch.float32


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` (the same groups, state and ``state_dict``) with the Newton-Schulz iteration in
    ``ns_dtype``: bf16 runs torch's own step; another dtype the same update written out (:func:`newton_schulz`, the
    learning rate scaled by sqrt(max(1, rows / cols)), torch's default ``adjust_lr_fn``)."""

    def __init__(self, params: Iterable[nn.Parameter], *, ns_dtype: torch.dtype = torch.bfloat16,
                 **options: Any) -> None:
        super().__init__(params, **options)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: ARG002 (no closure: the Trainer never passes one)
        if self.ns_dtype == torch.bfloat16:
            super().step()
            return
        for group in self.param_groups:
            if group["adjust_lr_fn"] not in (None, "original"):
                raise ValueError(f"Muon in {self.ns_dtype}: adjust_lr_fn {group['adjust_lr_fn']!r} is not written out")
            params: list[Tensor] = []
            grads: list[Tensor] = []
            buffers: list[Tensor] = []
            self._init_group(group, params, grads, buffers)
            lr, momentum = group["lr"], group["momentum"]
            for p, g, buf in zip(params, grads, buffers, strict=True):
                buf.lerp_(g, 1 - momentum)
                update = g.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-lr * math.sqrt(max(1.0, p.size(0) / p.size(1))))


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (Newton-Schulz orthogonalised momentum, ``torch.optim.Muon``) for the hidden matrices and AdamW for every
    other parameter, as the modded-nanogpt speedrun trains: one optimizer object, so one ``param_groups`` list
    (the AdamW groups first, then the Muon group: a learning-rate schedule drives both), one ``state`` and one
    ``state_dict`` / ``load_state_dict``. Muon: momentum 0.95, Nesterov, 5 Newton-Schulz steps, no weight decay."""

    def __init__(self, adamw_groups: list[dict], muon_params: list[nn.Parameter], *, lr: float, muon_lr: float,
                 betas: tuple[float, float], eps: float = 1e-8, fused: bool = True) -> None:
        # fused=False: AdamW's single-tensor update (the step compiled: train.compile step)
        use_fused = fused and all(p.device.type in ("cpu", "cuda") for g in adamw_groups for p in g["params"])
        self.adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, eps=eps, fused=use_fused,
                                       foreach=None if fused else False)
        self.muon = Muon(muon_params, lr=muon_lr, weight_decay=0.0, momentum=0.95, nesterov=True, ns_steps=5,
                         ns_dtype=newton_schulz_dtype(muon_params))
        super().__init__(self.adamw.param_groups + self.muon.param_groups, {})
        self._bind()

    def _bind(self) -> None:
        """The two inner optimizers work on this object's groups and state (the same dicts)."""
        n = len(self.adamw.param_groups)
        self.adamw.param_groups, self.muon.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.adamw.state = self.muon.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._bind()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: ARG002 (no closure: the Trainer never passes one)
        self.adamw.step()
        self.muon.step()


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

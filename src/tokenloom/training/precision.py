"""Training precision.

* ``fp32``: everything in float32.
* ``bf16``: weights, activations and gradients in bfloat16 (the CPU's fast matrix units), with float32
  *master* weights that the optimizer updates (mixed precision without autocast): per step, the bf16
  gradients are added into the masters' float32 gradients, the optimizer and clipping run on the masters,
  and the masters are copied back into the bf16 model. Checkpoints hold the float32 masters.
* ``bf16-autocast``: float32 weights, matmuls under ``torch.autocast`` (simpler, slower on CPU because
  every matmul input is cast each step; what a CUDA GPU's tensor cores want: the GPU's ``auto``).
* ``fp16`` (CUDA only): float32 weights, float16 autocast, losses scaled by ``torch.amp.GradScaler`` (the
  Trainer); for GPUs without bf16 (before Ampere).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import Tensor, nn

PRECISIONS = ("fp32", "bf16", "bf16-autocast", "fp16")


def autocast(precision: str, device_type: str = "cpu") -> contextlib.AbstractContextManager:
    """bf16 autocast for ``precision == "bf16-autocast"``, float16 autocast for ``fp16``, else a no-op."""
    if precision == "bf16-autocast":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    if precision == "fp16":
        return torch.autocast(device_type, dtype=torch.float16)
    return contextlib.nullcontext()


class MasterWeights:
    """float32 master copies of a model's trainable parameters, for training the model in bfloat16.

    Create it while the model is still float32 (so the masters are exact), then call :meth:`to_low`.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16, keep: Iterable[str] = ()) -> None:
        """``keep``: names of untrained floating state (a LoRA run's frozen base, a quantised base's scales) that
        :meth:`to_fp32` and :meth:`state_dict` give back unrounded: the float32 tensors themselves are held (no copy)
        while the model runs in bf16."""
        self.model, self.dtype = model, dtype
        self.params = [p for p in model.parameters() if p.requires_grad]  # a tied weight appears once
        self.masters = [nn.Parameter(p.detach().float().clone()) for p in self.params]
        self._by_id = {id(p): m for p, m in zip(self.params, self.masters, strict=True)}
        keep = set(keep)
        self.frozen = {name: t.detach() for name, t in model.state_dict(keep_vars=True).items()
                       if name in keep and t.is_floating_point() and id(t) not in self._by_id}

    def master_of(self, param: Tensor) -> nn.Parameter:
        return self._by_id[id(param)]

    def to_low(self) -> None:
        """Model weights (and every other floating tensor) -> bf16 copies of the masters."""
        self.model.to(self.dtype)
        self.copy_to_model()

    def to_fp32(self) -> None:
        """Model back to float32, holding the exact master values (for evaluation, export, sampling) and the exact
        untrained state."""
        self.model.float()
        self.copy_to_model()
        if self.frozen:
            state = self.model.state_dict(keep_vars=True)
            with torch.no_grad():
                for name, tensor in self.frozen.items():
                    state[name].copy_(tensor)

    @torch.no_grad()
    def copy_to_model(self) -> None:
        torch._foreach_copy_(self.params, self.masters)

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Add the model's (bf16) gradients into the masters' float32 gradients; clear the model's."""
        for p, m in zip(self.params, self.masters, strict=True):
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.add_(p.grad)
            p.grad = None

    def state_dict(self) -> dict[str, Tensor]:
        """The model's state dict with every parameter replaced by its float32 master (and the untrained floating
        state by its float32 original)."""
        state = self.model.state_dict(keep_vars=True)
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in self._by_id:
                state[name] = self._by_id[id(p)]
        state.update((name, tensor) for name, tensor in self.frozen.items() if name in state)
        return {k: v.detach() for k, v in state.items()}

"""``train.ema``: an exponential moving average of the weights, what evaluations and checkpoints use.

After every optimizer update ``t`` (0-based: the number of updates averaged before it) the float32 average of
each trainable parameter ``w`` (the float32 master in bf16 training) moves towards it::

    d_t = min(decay, (1 + t) / (10 + t))        # bias-free warm-up: 0.1, 0.18, 0.25, ... then decay
    ema = d_t * ema + (1 - d_t) * w

(the warm-up keeps the early average from being dominated by the initial weights, as TensorFlow's
``ExponentialMovingAverage(num_updates=...)`` and timm's ``ModelEmaV2`` warm up). Evaluations during training, the
final evaluation and the checkpoint's weights (``model.safetensors``, or a LoRA run's ``adapter.safetensors``, and
``<run>/best``) hold the average: it is swapped into the parameters, used, and swapped out again
(:meth:`WeightAverage.swapped`). Resuming needs the raw weights too: a checkpoint's ``trainer_state.pt`` holds, under
``"ema"``, ``{"decay", "updates", "average": {name: float32 tensor}, "weights": {name: float32 tensor}}`` (tensors and
numbers only, read with ``torch.load(weights_only=True)``), the parameters named as in the model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor


class WeightAverage:
    """The moving average of ``params`` (float32 tensors the optimizer updates in place) with ``decay``."""

    def __init__(self, params: list[Tensor], decay: float) -> None:
        self.params, self.decay = list(params), decay
        self.average = [p.detach().float().clone() for p in self.params]
        self.updates = 0  # t: updates averaged so far

    def factor(self) -> float:
        """d_t = min(decay, (1 + t) / (10 + t))."""
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        """ema = d_t * ema + (1 - d_t) * w, for every parameter; t += 1."""
        d = self.factor()
        torch._foreach_mul_(self.average, d)
        torch._foreach_add_(self.average, [p.detach().float() for p in self.params], alpha=1 - d)
        self.updates += 1

    @contextlib.contextmanager
    def swapped(self, refresh: Callable[[], None] = lambda: None) -> Iterator[None]:
        """The parameters hold the average inside the block, their own values again after it (exactly);
        ``refresh`` runs after each swap (bf16: copy the float32 masters into the bf16 model)."""
        with torch.no_grad():
            raw = [p.detach().clone() for p in self.params]
            torch._foreach_copy_(self.params, self.average)
        refresh()
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.params, raw)
            refresh()

    def state_dict(self, names: list[str]) -> dict:
        """What a trainer state keeps (``names``: the parameters' names, in order)."""
        return {"decay": self.decay, "updates": self.updates,
                "average": {n: a.detach().cpu().clone() for n, a in zip(names, self.average, strict=True)},
                "weights": {n: p.detach().float().cpu().clone() for n, p in zip(names, self.params, strict=True)}}

    @torch.no_grad()
    def load_state_dict(self, state: dict, names: list[str]) -> None:
        """Restore the average and put the raw weights back into the parameters (a resume's model was loaded with
        the checkpoint's averaged weights)."""
        missing = [n for n in names if n not in state["average"] or n not in state["weights"]]
        if missing:
            raise KeyError(f"the EMA state lacks parameters of this model: {missing[:3]}")
        self.updates = int(state["updates"])
        for n, a, p in zip(names, self.average, self.params, strict=True):
            a.copy_(state["average"][n])
            p.copy_(state["weights"][n])

"""Training the exit heads of depth-adaptive early exit (:mod:`tokenloom.generation.early_exit`) on a frozen model.

Trained heads are a norm of their own per exit layer (:class:`~tokenloom.nn.exits.ExitHeads`) in front of the
model's own output layer. Only the norms learn; the backbone, its final norm and output layer stay frozen, so the
full model's predictions never change. The loss is the mean over the exit layers of the next-token cross-entropy
of ``lm_head(norm_l(h_l))``, ``h_l`` the full model's state after layer l (teacher forcing, no exits), on random
windows of the training text: a few hundred parameters per layer, so tens of steps of a few thousand tokens
converge (on the bundled shakespeare-char model, 40 steps of 4 x 128 tokens reach per-layer bits per character
within 0.01-0.02 of 300 steps of 2,048).

    heads = ExitHeads.trained(model.final_norm, L, "layernorm", C)
    losses = train_exit_heads(model, heads, random_windows(train_ids, 4, 128, seed=0), steps=40)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..nn.exits import ExitHeads


def random_windows(ids: np.ndarray, batch_size: int, seq_len: int, seed: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless (x, y) batches of ``batch_size`` random windows of ``seq_len`` tokens from ``ids`` (y = x shifted by
    one), from a seeded generator."""
    if len(ids) < seq_len + 2:
        raise ValueError(f"{len(ids)} tokens are too few for windows of {seq_len} + 1")
    gen = torch.Generator().manual_seed(seed)
    data = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    while True:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        window = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])  # (B, T + 1)
        yield window[:, :-1], window[:, 1:]


@torch.no_grad()
def layer_states(model: nn.Module, input_ids: Tensor) -> list[Tensor]:
    """(B, T) ids -> the (B, T, C) state after each layer but the last, the full model run without a cache."""
    x, contexts = model.layer_inputs(input_ids, None, None, None)
    states = []
    for block, ctx in zip(model.blocks[:-1], contexts, strict=False):
        x, _ = block(x, ctx)
        states.append(x)
    return states


def exit_loss(model: nn.Module, heads: ExitHeads, states: list[Tensor], targets: Tensor) -> Tensor:
    """The mean over the exit layers of the cross-entropy of each head's logits at ``targets`` (B, T)."""
    norms = heads.norm_functions(model.final_norm, plain=False)
    losses = [F.cross_entropy(model.forward_head(norm(h)).flatten(0, 1).float(), targets.flatten())
              for norm, h in zip(norms, states, strict=True)]
    return torch.stack(losses).mean()


def train_exit_heads(model: nn.Module, heads: ExitHeads, batches: Iterator[tuple[Tensor, Tensor]], steps: int,
                     lr: float = 3e-2, log: Callable[[int, float], object] | None = None) -> list[float]:
    """Train ``heads`` (trained: norms of their own) for ``steps`` AdamW steps with ``model`` frozen (in eval mode,
    its parameters' ``requires_grad`` restored afterwards). Returns the loss of each step; ``log(step, loss)`` is
    called after each."""
    if heads.norms is None:
        raise ValueError("shared exit heads have nothing to train")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = model.tok_embed.weight.device
    heads.to(device).train()
    was_training = model.training
    flags = [p.requires_grad for p in model.parameters()]
    model.eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    try:
        for step in range(steps):
            x, y = next(batches)
            x, y = x.to(device), y.to(device)
            loss = exit_loss(model, heads, layer_states(model, x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if log is not None:
                log(step + 1, losses[-1])
    finally:
        for p, flag in zip(model.parameters(), flags, strict=True):
            p.requires_grad_(flag)
        model.train(was_training)
        heads.eval()
    return losses

"""Adaptive Computation Time (Graves 2016, "Adaptive Computation Time for Recurrent Neural Networks").

Shape legend: S steps, B batch, T positions, C state width; ``...`` the positions' leading shape ((B, T), or (B,)
in a one-token decode step).

A recurrent transition (an RNN cell, a Universal Transformer's shared block) runs for up to M steps. After step
n = 1, 2, ... a halting unit (:class:`HaltingUnit`: ``sigmoid(Linear(C, 1)(s))``) reads each position's new state
s^n and gives a halting probability p^n. A position halts at

    N = min(M, min{n : p^1 + ... + p^n >= 1 - eps})

with the remainder R = 1 - (p^1 + ... + p^(N-1)); its halting weights are w^n = p^n for n < N, w^N = R and 0 after,
so they sum to exactly one; its output is the weighted sum of its states sum_n w^n s^n, and its ponder count is
N + R. The ponder cost tau * mean(N + R), added to a loss, asks for fewer steps: N is a count (no gradient), R
carries the gradient into the halting unit.

One body, :func:`act_step`, runs it in two ways:

* inside a model's loop, step by step (the states of step n depend on which positions still run)::

      acc = None
      for n in range(M):
          state = transition(...)
          acc = act_step(acc, halting(state), state, eps, last=n == M - 1)
      acc.output, acc.ponder

* over all steps at once, the probabilities and states given: :func:`adaptive_computation`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn


class HaltingUnit(nn.Module):
    """The halting probability of each position: (..., C) states -> (...) ``sigmoid(w . s + b)``. ``bias`` is the
    initial b: a positive one makes the first steps' probabilities high (halting early), as Graves and the
    Universal Transformer initialise it."""

    def __init__(self, embed_dim: int, bias: float = 1.0) -> None:
        super().__init__()
        self.proj = nn.Linear(embed_dim, 1)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.constant_(self.proj.bias, bias)

    def forward(self, state: Tensor) -> Tensor:
        """(..., C) -> (...) probabilities in (0, 1)."""
        return torch.sigmoid(self.proj(state)).squeeze(-1)


class ACTState(NamedTuple):
    """What ACT knows after a step; each field (...) per position, ``output`` (..., C)."""

    total: Tensor  # p^1 + ... + p^n of the steps taken before halting (R = 1 - total at the halting step)
    running: Tensor  # bool: still running after this step
    ran: Tensor  # bool: took this step (was running before it); a model keeps the others' states unchanged
    weight: Tensor  # this step's halting weight w^n (0 for a position that halted before)
    steps: Tensor  # N so far: the steps taken, as a float
    remainder: Tensor  # R once halted, else 0
    output: Tensor  # sum of w^k s^k over the steps so far

    @property
    def ponder(self) -> Tensor:
        """(...) the ponder count N + R (final once every position halted)."""
        return self.steps + self.remainder


def act_step(acc: ACTState | None, p: Tensor, state: Tensor, eps: float = 0.01, last: bool = False) -> ACTState:
    """One ACT step: ``acc`` the state after the previous step (None before the first), ``p`` (...) this step's
    halting probabilities, ``state`` (..., C) this step's states; ``last``: the last step allowed (M), where every
    position still running halts. A position halts here when its cumulated probability reaches ``1 - eps``."""
    if acc is None:
        zeros = torch.zeros_like(p)
        acc = ACTState(zeros, torch.ones_like(p, dtype=torch.bool), zeros.bool(), zeros, zeros, zeros, None)
    ran = acc.running
    halts = ran if last else ran & (acc.total + p >= 1.0 - eps)
    rest = 1.0 - acc.total  # R, for the positions that halt now
    weight = torch.where(halts, rest, torch.where(ran, p, torch.zeros_like(p)))
    contribution = weight.unsqueeze(-1) * state  # (..., C)
    output = contribution if acc.output is None else acc.output + contribution
    continues = ran & ~halts
    return ACTState(total=torch.where(continues, acc.total + p, acc.total), running=continues, ran=ran,
                    weight=weight, steps=acc.steps + ran.to(p.dtype),
                    remainder=torch.where(halts, rest, acc.remainder), output=output)


class ACTResult(NamedTuple):
    """:func:`adaptive_computation`'s result."""

    output: Tensor  # (..., C) the weighted sum of the states
    weights: Tensor  # (S, ...) the halting weights, summing to one over S
    remainder: Tensor  # (...) R
    steps: Tensor  # (...) N, as a float
    ponder: Tensor  # (...) N + R


def adaptive_computation(probs: Tensor, states: Tensor, eps: float = 0.01) -> ACTResult:
    """ACT over S given steps: ``probs`` (S, ...) halting probabilities, ``states`` (S, ..., C); the last of the S
    steps is the last allowed (M = S). The states of steps after a position halted are not read."""
    acc = None
    weights = []
    S = probs.shape[0]
    for n in range(S):
        acc = act_step(acc, probs[n], states[n], eps, last=n == S - 1)
        weights.append(acc.weight)
    return ACTResult(acc.output, torch.stack(weights), acc.remainder, acc.steps, acc.ponder)

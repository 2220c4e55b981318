"""Recurrent layers (LSTM, GRU) over left-padded batches, and their decode state as a cache strategy.

Shape legend: B batch, T new positions in this call, L layers, E input width, H hidden width.

* :data:`RECURRENT_CELLS`: a cell name -> torch's fused multi-layer module (``nn.LSTM``, ``nn.GRU``: cuDNN on CUDA,
  the fused CPU kernels elsewhere).
* :func:`run_recurrent`: one call of such a module over (B, T, E) from a carried state, where padding positions
  (``valid`` False) leave a row's state as it was: a left-padded row runs exactly as it would alone.
* :class:`RecurrentState`: the carried state as a cache strategy (what a Transformer's key/value cache is to
  attention): each layer's hidden state (and an LSTM's cell state) per row, with the row operations decoding uses
  (``select`` drops finished rows, ``reorder`` follows beam search, ``reset``). Example::

      cache = model.create_cache(batch_size=2)
      logits = model(prompt_ids, attention_mask=mask, cache=cache)   # prefill: the state after each prompt
      logits = model(next_id[:, None], cache=cache)                  # one step: (B, 1) through the cell
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..registry import Registry

RECURRENT_CELLS: Registry[type[nn.RNNBase]] = Registry("recurrent cell")
RECURRENT_CELLS.register("lstm")(nn.LSTM)
RECURRENT_CELLS.register("gru")(nn.GRU)

State = Tensor | tuple[Tensor, Tensor]  # h (L, B, H), or an LSTM's (h, c)


def run_recurrent(rnn: nn.RNNBase, x: Tensor, state: State | None, valid: Tensor | None) -> tuple[Tensor, State]:
    """Run ``rnn`` (batch_first) over ``x`` (B, T, E) from ``state`` (None: zeros) -> the top layer's outputs
    (B, T, H) and the new state. ``valid`` (B, T) bool marks real tokens (None: all are); a padding position changes
    no state and outputs zeros, so each row runs exactly its own tokens.

    A one-token call runs the cell on every row and keeps the old state of the padded ones. A longer call moves each
    row's real tokens to its start and runs the rows longest first in segments between their distinct lengths: the
    rows still running in a segment are a prefix of the batch, so every segment is one fused call over them, no
    padding is computed, and the time steps run in sequence are T in all. (``pack_padded_sequence`` does the same work
    in one call but needs its lengths on the host beside device inputs; on a 2-core CPU it was no faster: 62 vs 41 ms
    for 8 rows of 10..128 tokens through a 2 x 256 LSTM.)"""
    if valid is None:
        return rnn(x, state)
    if state is None:
        state = zero_state(rnn, x.shape[0], x.dtype, x.device)
    B, T, _ = x.shape
    if T == 1:
        out, new = rnn(x, state)
        return out * valid[..., None], _where(valid.view(1, B, 1), new, state)
    lengths = valid.sum(1)  # (B,) real tokens per row
    # each row's real positions first, in order, then its padding: (B, T) a permutation of 0..T-1 per row
    order = torch.sort(valid.to(torch.uint8), dim=1, descending=True, stable=True).indices
    rows = lengths.argsort(descending=True, stable=True)  # (B,) longest first
    xs = x.gather(1, order[..., None].expand_as(x))[rows]  # (B, T, E) real tokens at the start, rows longest first
    states = [s[:, rows] for s in _tensors(state)]  # each (L, B, H) in the rows' new order
    ends = lengths[rows].tolist()  # non-increasing
    pieces, start = [], 0
    for end in sorted(set(ends) - {0}):
        n = sum(1 for length in ends if length >= end)  # the rows still running: a prefix
        # contiguous: cuDNN refuses a strided initial state
        out, new = rnn(xs[:n, start:end].contiguous(), _state([s[:, :n].contiguous() for s in states]))
        states = [torch.cat((s_new, s[:, n:]), dim=1) for s_new, s in zip(_tensors(new), states, strict=True)]
        pieces.append(F.pad(out, (0, 0, 0, 0, 0, B - n)))  # (B, end - start, H), zeros for the rows that stopped
        start = end
    out = torch.cat(pieces, dim=1) if pieces else xs.new_zeros(B, 0, rnn.hidden_size)  # (B, max length, H)
    out = F.pad(out, (0, 0, 0, T - start))  # (B, T, H)
    back = rows.argsort()  # the rows' original order
    out = out[back].gather(1, order.argsort(dim=1)[..., None].expand_as(out))  # back to the original positions
    return out, _state([s[:, back] for s in states])


def without_cpu_autocast(x: Tensor) -> contextlib.AbstractContextManager:
    """The context a recurrence over ``x`` runs in: autocast off on a CPU under autocast (oneDNN builds no bf16 LSTM
    primitive there; measured on an AVX2 CPU: "could not create a primitive descriptor"), so the recurrence runs in
    the weights' dtype while the layers around it stay under autocast; elsewhere nothing changes."""
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return torch.autocast("cpu", enabled=False)
    return contextlib.nullcontext()


def zero_state(rnn: nn.RNNBase, batch_size: int, dtype: torch.dtype, device: torch.device | str | None) -> State:
    """The all-zero initial state of ``rnn`` for ``batch_size`` rows: h (L, B, H), and c for an LSTM."""
    h = torch.zeros(rnn.num_layers, batch_size, rnn.hidden_size, dtype=dtype, device=device)
    return (h, torch.zeros_like(h)) if isinstance(rnn, nn.LSTM) else h


def _tensors(state: State) -> list[Tensor]:
    return [state] if isinstance(state, Tensor) else list(state)


def _state(tensors: list[Tensor]) -> State:
    return tensors[0] if len(tensors) == 1 else (tensors[0], tensors[1])


def _where(keep: Tensor, new: State, old: State) -> State:
    """``new`` where ``keep`` (broadcast over (L, B, H)), else ``old``; for h or (h, c)."""
    if isinstance(new, Tensor):
        return torch.where(keep, new, old)
    return tuple(torch.where(keep, n, o) for n, o in zip(new, old, strict=True))


class RecurrentState:
    """The cache strategy of a recurrent network: ``h`` (L, B, H) and, for an LSTM, ``c`` (L, B, H), the state after
    every position seen so far, per layer and row (what a Transformer keeps as keys and values of all positions, an
    RNN keeps as one fixed-size state). A model reads :attr:`state`, runs its layers and :meth:`store` s the result,
    then :meth:`advance` s ``length``. States are stored detached: no gradient flows into an earlier call. There are
    no key positions, so no span, no capacity (``max_len`` None) and no static (compiled) form."""

    max_len = None  # no capacity: the state has the same size after any number of positions

    def __init__(self, num_layers: int, batch_size: int, hidden_dim: int, cell_state: bool,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        self.h = torch.zeros(num_layers, batch_size, hidden_dim, dtype=dtype, device=device)
        self.c = torch.zeros_like(self.h) if cell_state else None
        self.length = 0  # positions seen (padding included)

    @classmethod
    def of(cls, rnn: nn.RNNBase, batch_size: int, dtype: torch.dtype | None = None,
           device: torch.device | str | None = None) -> RecurrentState:
        """The zero state of ``rnn`` (an ``nn.LSTM`` keeps a cell state too), in its weights' dtype and device unless
        given."""
        ref = next(iter(rnn.parameters()))
        return cls(rnn.num_layers, batch_size, rnn.hidden_size, isinstance(rnn, nn.LSTM), dtype or ref.dtype,
                   device or ref.device)

    @property
    def batch_size(self) -> int:
        return self.h.shape[1]

    @property
    def state(self) -> State:
        """What the recurrent module takes as its initial state: h, or (h, c)."""
        return self.h if self.c is None else (self.h, self.c)

    def store(self, state: State) -> None:
        """Keep the module's new state (detached)."""
        if isinstance(state, Tensor):
            self.h = state.detach()
        else:
            self.h, self.c = state[0].detach(), state[1].detach()

    def advance(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        """Forget every row's state (new tensors: the old ones may be inference tensors)."""
        self.h = torch.zeros_like(self.h)
        self.c = torch.zeros_like(self.c) if self.c is not None else None
        self.length = 0

    def select(self, index: Tensor) -> None:
        """Keep only rows ``index`` (any number; row ``i`` becomes the old row ``index[i]``): decoding drops the rows
        that finished."""
        self.h = self.h.index_select(1, index)
        if self.c is not None:
            self.c = self.c.index_select(1, index)

    reorder = select  # beam search: row i <- old row index[i] (as many rows); new tensors are as cheap as in place

"""Recurrent (LSTM / GRU) language model: the baseline the Transformer articles measure against.

Shape legend: B batch, T new positions in this call, E embed_dim, H hidden_dim, L num_layers, V vocab_size.

It trains with the same Trainer, ``lm`` task, tokenizers and checkpoints as GPT (``model: {family: rnn, ...}``) and
decodes through the same :mod:`tokenloom.generation` (greedy, sampling, beam search) over the same protocol::

    logits = model(input_ids, positions=None, attention_mask=None, cache=None)   # (B, T, V)
    cache = model.create_cache(batch_size)   # a RecurrentState: (h, c) per layer and row

The layers are torch's fused ``nn.LSTM`` / ``nn.GRU`` (cuDNN on CUDA). ``positions`` are accepted and ignored (the
order is the recurrence itself). Left padding (``attention_mask`` 0) changes no state, so a padded row decodes
exactly as it would alone (:func:`tokenloom.nn.recurrent.run_recurrent`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..config import check, check_choice
from ..nn.dropout import Dropout
from ..nn.recurrent import RECURRENT_CELLS, RecurrentState, run_recurrent, without_cpu_autocast
from .counting import CountsParameters
from .registry import MODELS, declare_decoding


@dataclass
class RNNConfig:
    """A recurrent language model (``model:`` with ``family: rnn``): token embedding -> L LSTM or GRU layers ->
    vocabulary logits."""

    vocab_size: int = 65  # number of token ids
    cell: str = "lstm"  # lstm | gru (torch's fused nn.LSTM / nn.GRU)
    num_layers: int = 2  # stacked recurrent layers
    embed_dim: int = 448  # token embedding width, E
    hidden_dim: int | None = None  # recurrent state width per layer, H; None = embed_dim
    dropout: float = 0.0  # dropout on the embeddings, between recurrent layers and before the head
    tie_embeddings: bool = True  # the output projection shares the token embedding matrix (through a
    #   Linear(hidden_dim, embed_dim) when the widths differ)
    max_seq_len: int = 256  # the longest training window and prompt + generation decoding accepts (a recurrent
    #   network itself has no limit)
    hidden: int = field(init=False, default=0)  # derived: the state width the model builds (hidden_dim or embed_dim)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "embed_dim", "max_seq_len"):
            value = getattr(self, name)
            check(value >= 1, f"{name} must be a positive integer, got {value}")
        check(self.hidden_dim is None or self.hidden_dim >= 1,
              f"hidden_dim must be a positive integer or null, got {self.hidden_dim}")
        check(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        check_choice("cell", self.cell, RECURRENT_CELLS)
        self.hidden = self.hidden_dim or self.embed_dim


@declare_decoding("causal_lm")
class RNNLM(CountsParameters, nn.Module):
    """Token embedding -> L recurrent layers -> (projection to E when tied and H != E) -> vocabulary logits."""

    def __init__(self, config: RNNConfig) -> None:
        super().__init__()
        self.config = c = config
        E, H = c.embed_dim, c.hidden
        self.tok_embed = nn.Embedding(c.vocab_size, E)
        self.embed_dropout = Dropout(c.dropout)
        self.rnn = RECURRENT_CELLS.get(c.cell)(E, H, num_layers=c.num_layers, batch_first=True,
                                               dropout=c.dropout if c.num_layers > 1 else 0.0)
        self.out_dropout = Dropout(c.dropout)
        tied_projection = c.tie_embeddings and H != E
        self.proj = nn.Linear(H, E, bias=False) if tied_projection else nn.Identity()
        self.lm_head = nn.Linear(E if c.tie_embeddings else H, c.vocab_size, bias=False)
        # the word-language-model initialisation (Zaremba et al.): embeddings and head uniform in +-0.1; the
        # recurrent weights keep torch's uniform +-1/sqrt(H)
        nn.init.uniform_(self.tok_embed.weight, -0.1, 0.1)
        nn.init.uniform_(self.lm_head.weight, -0.1, 0.1)
        if tied_projection:
            nn.init.uniform_(self.proj.weight, -H ** -0.5, H ** -0.5)
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_embed.weight

    def create_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None,
                     device: torch.device | str | None = None, rolling: bool | None = None) -> RecurrentState:
        """The zero :class:`~tokenloom.nn.recurrent.RecurrentState` of ``batch_size`` rows. ``max_len`` and
        ``rolling`` are accepted for the decoding protocol and change nothing: the state has one size however
        long the sequence."""
        return RecurrentState.of(self.rnn, batch_size, dtype, device)

    def forward_features(self, input_ids: Tensor, *, positions: Tensor | None = None,
                         attention_mask: Tensor | None = None, cache: RecurrentState | None = None,
                         need_weights: bool = False) -> tuple[Tensor, list[Tensor | None]]:
        """(B, T) ids -> (B, T, H) the top layer's outputs, and one None per layer (no attention weights).

        ``attention_mask`` (B, S) marks real tokens (1) and padding (0) over cached + new positions (its last T
        columns are this call's); ``cache`` carries the state from the previous call and takes the new one
        (None: a zero state, nothing kept)."""
        T = input_ids.shape[1]
        x = self.embed_dropout(self.tok_embed(input_ids))  # (B, T, E)
        valid = None
        if attention_mask is not None:
            valid = attention_mask[:, -T:].bool()  # (B, T)
            if bool(valid.all()):
                valid = None
        state = cache.state if cache is not None else None
        with without_cpu_autocast(x):  # the recurrence in the weights' dtype, the head under autocast
            out, state = run_recurrent(self.rnn, x.to(self.tok_embed.weight.dtype), state, valid)  # (B, T, H)
        if cache is not None:
            cache.store(state)
            cache.advance(T)
        return self.out_dropout(out), [None] * self.config.num_layers

    def forward_head(self, hidden: Tensor) -> Tensor:
        """(B, T, H) -> (B, T, V) logits."""
        return self.lm_head(self.proj(hidden))

    def forward(self, input_ids: Tensor, *, positions: Tensor | None = None, attention_mask: Tensor | None = None,
                cache: RecurrentState | None = None) -> Tensor:
        """(B, T) token ids -> (B, T, V) logits."""
        hidden, _ = self.forward_features(input_ids, attention_mask=attention_mask, cache=cache)
        return self.forward_head(hidden)


MODELS.register("rnn")((RNNConfig, RNNLM))

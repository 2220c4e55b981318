"""Two model options of the modded-nanogpt speedrun, as parts a decoder stack composes: value embeddings and U-net
skip connections.

Shape legend: B batch, T positions, C embed_dim, Hkv key/value heads, D head_dim, V vocab_size, L num_layers.

* :class:`ValueEmbeddings`: ``k`` extra token-embedding tables of (V, Hkv * D); table i feeds layer i and layer
  ``L - k + i`` (the first k and the last k layers; where ``2k > L`` a layer takes the first table that names it).
  In such a layer l the attention's values become ``v + lambda_l * table[ids]`` (a learned scalar per layer,
  initialised to 0.5), added before the values are cached (:func:`~.attention.mixed_values`), so a cache holds
  the mixed values.
* :class:`UNetSkips`: the outputs of the first ``L // 2`` layers are kept, and layer ``L // 2 + j`` (j < L // 2)
  runs on ``x + w_j * kept[L // 2 - 1 - j]`` (learned scalars w_j, initialised to 1.0): the first half's outputs
  enter the second half in reverse order (an odd L's last layer gets none).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

VALUE_LAMBDA_INIT = 0.5  # lambda_l at initialisation (the speedrun's value-embedding mix)
SKIP_WEIGHT_INIT = 1.0  # w_j at initialisation (the speedrun's skip weights)


def value_embed_tables(num_layers: int, k: int) -> list[int | None]:
    """Per layer, the value-embedding table it reads (or None): table i feeds layers i and ``num_layers - k + i``;
    a layer both name (``2k > num_layers``) takes the first, i.e. ``l`` where ``l < k``."""
    return [i if i < k else (i - (num_layers - k) if i >= num_layers - k else None) for i in range(num_layers)]


class ValueEmbeddings(nn.Module):
    """``k`` value-embedding tables (V, Hkv * D) and one learned scalar per layer they feed (``lambdas`` (n,),
    n the layers fed, in layer order). ``forward(ids)`` gives each layer's rows ``lambda_l * table[ids]``."""

    def __init__(self, vocab_size: int, kv_dim: int, num_layers: int, k: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(vocab_size, kv_dim) for _ in range(k))
        self.layers = value_embed_tables(num_layers, k)  # per layer: its table index, or None
        self.lambdas = nn.Parameter(torch.full((sum(t is not None for t in self.layers),), VALUE_LAMBDA_INIT))

    def forward(self, input_ids: Tensor) -> list[Tensor | None]:
        """(B, T) ids -> per layer, ``lambda_l * table_l[ids]`` (B, T, Hkv * D), or None for a layer without."""
        rows = [table(input_ids) for table in self.tables]  # each looked up once, shared by its two layers
        out: list[Tensor | None] = []
        fed = 0
        for table in self.layers:
            if table is None:
                out.append(None)
            else:
                out.append(self.lambdas[fed] * rows[table])
                fed += 1
        return out


class UNetSkips(nn.Module):
    """The speedrun's U-net skips over ``num_layers`` layers: ``weights`` (L // 2,) w_j, initialised to 1.0.
    A block loop calls :meth:`enter` before layer i and :meth:`leave` after it, with one list ``kept`` per pass."""

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.half = num_layers // 2
        self.weights = nn.Parameter(torch.full((self.half,), SKIP_WEIGHT_INIT))

    def enter(self, index: int, x: Tensor, kept: list[Tensor]) -> Tensor:
        """x (..., C) before layer ``index``: ``x + w_j * kept[L//2 - 1 - j]`` for ``index = L//2 + j``, j < L//2;
        else x."""
        j = index - self.half
        if 0 <= j < self.half:
            return x + self.weights[j] * kept[self.half - 1 - j]
        return x

    def leave(self, index: int, x: Tensor, kept: list[Tensor]) -> None:
        """Keep layer ``index``'s output x (..., C) when it is one of the first L // 2."""
        if index < self.half:
            kept.append(x)

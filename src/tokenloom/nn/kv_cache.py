"""A preallocated key/value cache for incremental decoding."""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Keys and values of every layer, preallocated to ``max_len`` positions.

    ``k`` and ``v`` are (L, B, Hkv, max_len, D); ``length`` counts the positions already written.
    A model's forward writes its new positions through :meth:`layer` views and then calls
    :meth:`advance`. Example::

        cache = model.create_cache(batch_size=1, max_len=128)
        logits = model(prompt_ids, cache=cache)          # prefill: cache.length == T
        logits = model(next_id[:, None], cache=cache)    # one step: cache.length == T + 1
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0
        self._layers = [(self.k[i], self.v[i]) for i in range(num_layers)]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return self._layers[i]

    def advance(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        self.length = 0

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (beam search): k/v rows are gathered in place."""
        self.k.copy_(self.k.index_select(1, index))
        self.v.copy_(self.v.index_select(1, index))

"""A preallocated key/value cache for incremental decoding."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class KVCache:
    """Keys and values of every layer, preallocated to ``max_len`` positions.

    ``kv`` is (L, 2, B, Hkv, max_len, D); ``k`` and ``v`` are its (L, B, Hkv, max_len, D) halves (views),
    kept in one tensor so a decode step can write a layer's new key and value with one copy.
    ``length`` counts the positions already written. A model's forward writes its new positions
    through :meth:`layer` views and then calls :meth:`advance`. ``plan`` holds whatever per-generation
    state the model attaches (GPT keeps its fast decode-step functions there); :meth:`reset` drops it.
    Example::

        cache = model.create_cache(batch_size=1, max_len=128)
        logits = model(prompt_ids, cache=cache)          # prefill: cache.length == T
        logits = model(next_id[:, None], cache=cache)    # one step: cache.length == T + 1
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        self.max_len = max_len
        self.length = 0
        self._set_storage(torch.zeros((num_layers, 2, batch_size, num_kv_heads, max_len, head_dim), dtype=dtype,
                                      device=device))  # also k, v: (L, B, Hkv, max_len, D) views

    @property
    def batch_size(self) -> int:
        return self.kv.shape[2]

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        """Layer ``i``'s (k, v) buffers, each (B, Hkv, max_len, D)."""
        return self._layers[i]

    def layer_kv(self, i: int) -> Tensor:
        """Layer ``i``'s keys and values as one (2, B, Hkv, max_len, D) view."""
        return self.kv[i]

    def advance(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        self.length = 0
        self.plan = None

    def select(self, index: Tensor) -> None:
        """Keep only batch rows ``index`` (any number; row ``i`` becomes the old row ``index[i]``), in new
        storage: decoding drops the rows that finished. The :meth:`layer` views are rebuilt and ``plan`` is
        dropped (a model rebuilds it on its next step)."""
        L, two, _, Hkv, max_len, D = self.kv.shape
        kv = self.kv.new_empty((L, two, index.numel(), Hkv, max_len, D))
        n = self.length
        if n:
            kv[..., :n, :] = self.kv[..., :n, :].index_select(2, index)
        self._set_storage(kv)

    def _set_storage(self, kv: Tensor) -> None:
        self.kv = kv
        self.k, self.v = kv[:, 0], kv[:, 1]
        self._layers = [(self.k[i], self.v[i]) for i in range(kv.shape[0])]
        self._spare: Tensor | None = None  # reorder's gather buffer, allocated on first use
        self.plan: Any = None

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (beam search): row ``i`` becomes the old row ``index[i]``. The rows are
        gathered and copied back into the same storage (only the ``length`` positions written so far), so
        the :meth:`layer` views and a model's ``plan`` bound to them stay valid."""
        kv = self.kv[..., :self.length, :] if 0 < self.length < self.max_len else self.kv
        if self._spare is None:
            self._spare = torch.empty_like(self.kv)
        spare = self._spare[..., :kv.shape[-2], :]
        # gathering into a preallocated buffer and copying back is ~3.6x faster than copy_(index_select(...))
        # on CPU (measured: 7.9 vs 28.6 ms for a (3, 2, 320, 4, 30, 64) float32 cache)
        torch.index_select(kv, 2, index, out=spare)
        kv.copy_(spare)

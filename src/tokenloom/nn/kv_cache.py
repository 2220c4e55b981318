"""Key/value caches for incremental decoding, as strategies behind one protocol.

Attention sees one layer of a cache through :class:`LayerCache`::

    k, v = layer.update(k_new, v_new)   # store the new keys and values, get the ones to attend over

and a model sees the whole cache through :class:`DecodeCache`: its ``layers``, the :class:`~.masks.KeySpan` of a
call (which key positions the new queries may see, what the one mask builder :func:`~.masks.attention_mask` turns
into the mask), ``advance`` and ``plain`` (whether the plain one-token functions may run on it). The strategies:

* :class:`KVCache` (dense): one preallocated (L, 2, B, Hkv, M, D) tensor; a call writes its T positions at
  ``[length, length + T)`` and attends over ``[0, length + T)``: training-free prefill and eager decoding.
* :class:`StaticView` (static shapes, for a compiled step) over a :class:`StaticKVCache`'s separate per-layer
  tensors, written at a position given as a tensor, attention over all M positions with a mask hiding the unwritten ones
  (:mod:`tokenloom.generation.compiled`).
* :class:`RaggedView` (rows at different lengths, a server's running batch): row b writes its T new positions from
  its own ``lengths[b]`` and attends over the first ``max(lengths) + T`` positions, the mask hiding each row's later
  ones.
* :class:`MemoryLayer`: an encoder's keys and values for cross-attention, computed once; ``update`` returns them.
* :class:`SegmentMemory` (Transformer-XL): each layer's keys and values of the last ``memory_len`` positions,
  detached, prepended to the next call's own: segment-level recurrence in training, evaluation and decoding.
* :class:`RollingKVCache` (sliding-window attention): a ring of ``globals + window`` slots per layer, so decoding
  holds the memory of the window however long it runs.

A paged cache joins as one more class with these methods. Speculative decoding drops the rejected drafts of each
verification (:meth:`KVCache.rewind`); the strategies that can are declared with :func:`declare_rewind` (the dense one
and its subclasses), never probed: a rolling ring has overwritten what a rejected draft displaced, a Transformer-XL
memory has pushed it out, a static cache belongs to compiled one-token steps.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from ..errors import GenerationError
from .masks import KeySpan


class LayerCache(Protocol):
    """One layer's keys and values as attention sees them."""

    def update(self, k: Tensor | None, v: Tensor | None) -> tuple[Tensor, Tensor]:
        """Store ``k``, ``v`` (B, Hkv, T, D) of the new positions; return the keys and values to attend over."""
        ...


class DecodeCache(Protocol):
    """A whole model's cache as the models' ``forward_features`` uses it."""

    layers: list[LayerCache]
    plain: bool  # the plain one-token step functions may run on it (False: call the modules, e.g. compiled)

    @property
    def batch_size(self) -> int: ...

    def span(self, T: int, attention_mask: Tensor | None) -> KeySpan: ...

    def advance(self, n: int) -> None: ...


class DenseLayer:
    """Writes T new positions at the owner's ``length``; attends over ``[0, length + T)``."""

    __slots__ = ("k", "v", "owner")

    def __init__(self, k: Tensor, v: Tensor, owner) -> None:
        self.k, self.v, self.owner = k, v, owner

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        start, T = self.owner.length, k.shape[-2]
        self.k.narrow(2, start, T).copy_(k)  # narrow + copy_: one call each (slice assignment parses its index)
        self.v.narrow(2, start, T).copy_(v)
        return self.k.narrow(2, 0, start + T), self.v.narrow(2, 0, start + T)


class StaticLayer:
    """Writes at the owner's ``pos`` ((T,) long tensor) and attends over all M positions (static shapes)."""

    __slots__ = ("k", "v", "owner")

    def __init__(self, k: Tensor, v: Tensor, owner) -> None:
        self.k, self.v, self.owner = k, v, owner

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k.index_copy_(2, self.owner.pos, k)
        self.v.index_copy_(2, self.owner.pos, v)
        return self.k, self.v


class RaggedLayer:
    """Row b writes its T new positions at ``owner.lengths[b]`` onwards; attends over the first ``owner.keys``."""

    __slots__ = ("k", "v", "owner", "rows")

    def __init__(self, k: Tensor, v: Tensor, owner) -> None:
        self.k, self.v, self.owner = k, v, owner
        self.rows = torch.arange(k.shape[0], device=k.device)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if k.shape[2] == 1:
            at = self.owner.lengths
            self.k[self.rows, :, at] = k[:, :, 0]
            self.v[self.rows, :, at] = v[:, :, 0]
        else:  # (B, T) columns; the indexed (B, T, Hkv, D) gets the new (B, Hkv, T, D) transposed
            at = self.owner.columns
            self.k[self.rows[:, None], :, at] = k.transpose(1, 2)
            self.v[self.rows[:, None], :, at] = v.transpose(1, 2)
        S = self.owner.keys
        return self.k[:, :, :S], self.v[:, :, :S]


class MemoryLayer:
    """Cross-attention keys and values (Bm, Hkv, S, D) of an encoder's memory, computed once."""

    __slots__ = ("k", "v")

    def __init__(self, k: Tensor, v: Tensor) -> None:
        self.k, self.v = k, v

    def update(self, k: Tensor | None = None, v: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self.k, self.v


class DenseCache:
    """What the dense strategies share: ``length`` positions written of ``max_len``; a call's T new queries sit at
    ``[length, length + T)`` and see keys ``[0, length + T)``."""

    plain = True
    length: int
    max_len: int
    layers: list[LayerCache]

    def span(self, T: int, attention_mask: Tensor | None) -> KeySpan:
        """``attention_mask`` (B, length + T) marks padding (0)."""
        past = self.length
        return KeySpan(past, past + T, None, None if attention_mask is None else attention_mask.bool(),
                       extent=past + T)

    def advance(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        self.length = 0


_REWINDS: set[type] = set()  # cache strategies that can forget their last positions (speculative decoding)


def declare_rewind(cls: type) -> type:
    """Class decorator: ``cls`` (and its subclasses) offers ``rewind(drop) -> shifts``, ``trim(n)`` and
    ``select(index)`` with :class:`KVCache`'s meaning (what speculative decoding does after each verification)."""
    _REWINDS.add(cls)
    return cls


def rewinds(cache: object) -> bool:
    """Whether ``cache``'s strategy was declared with :func:`declare_rewind`, along its MRO."""
    return any(base in _REWINDS for base in type(cache).__mro__)


@declare_rewind
class KVCache(DenseCache):
    """The dense strategy: keys and values of every layer, preallocated to ``max_len`` positions.

    ``kv`` is (L, 2, B, Hkv, max_len, D); ``k`` and ``v`` are its (L, B, Hkv, max_len, D) halves (views),
    kept in one tensor so rows can be gathered, copied and dropped in one operation. ``length`` counts the
    positions already written; a model's forward writes its new positions through :attr:`layers` and then
    calls :meth:`advance`. Example::

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
        return self.k[i], self.v[i]

    def select(self, index: Tensor) -> None:
        """Keep only batch rows ``index`` (any number; row ``i`` becomes the old row ``index[i]``), in new
        storage: decoding drops the rows that finished. The :attr:`layers` are rebuilt."""
        L, two, _, Hkv, max_len, D = self.kv.shape
        kv = self.kv.new_empty((L, two, index.numel(), Hkv, max_len, D))
        n = self.length
        if n:
            kv[..., :n, :] = self.kv[..., :n, :].index_select(2, index)
        self._set_storage(kv)

    def _set_storage(self, kv: Tensor) -> None:
        self.kv = kv
        self.k, self.v = kv[:, 0], kv[:, 1]
        self.layers: list[LayerCache] = [DenseLayer(self.k[i], self.v[i], self) for i in range(kv.shape[0])]
        self._spare: Tensor | None = None  # reorder's gather buffer, allocated on first use

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (beam search): row ``i`` becomes the old row ``index[i]``. The rows are
        gathered and copied back into the same storage (only the ``length`` positions written so far), so
        the :attr:`layers` stay valid."""
        kv = self.kv[..., :self.length, :] if 0 < self.length < self.max_len else self.kv
        if self._spare is None:
            self._spare = torch.empty_like(self.kv)
        spare = self._spare[..., :kv.shape[-2], :]
        # gathering into a preallocated buffer and copying back is ~3.6x faster than copy_(index_select(...))
        # on CPU (measured: 7.9 vs 28.6 ms for a (3, 2, 320, 4, 30, 64) float32 cache)
        torch.index_select(kv, 2, index, out=spare)
        kv.copy_(spare)

    def rewind(self, drop: Tensor) -> Tensor:
        """Row b forgets its last ``drop[b]`` positions ((B,) long, each in [0, length]): speculative decoding
        dropping the rejected drafts of a verification. ``length`` goes down by ``min(drop)``, and a row that drops
        more is moved right by the difference (its left padding grows), so every row still ends at ``length``: the
        batch stays left-padded. Returns the (B,) shifts; the caller masks each row's first ``shifts[b]`` columns
        as padding (what they hold is left over). Batch 1 (or equal drops) just lowers ``length``."""
        low = int(drop.min())
        self.length -= low
        shifts = drop - low  # (B,)
        rows = shifts.nonzero().view(-1)
        n = self.length
        if rows.numel() and n:
            moved = self.kv[..., :n, :].index_select(2, rows)  # (L, 2, R, Hkv, n, D), a copy
            L, two, R, Hkv, _, D = moved.shape
            source = (torch.arange(n, device=drop.device)[None] - shifts[rows][:, None]).clamp_(min=0)  # (R, n)
            self.kv[:, :, rows, :, :n] = moved.gather(4, source.view(1, 1, R, 1, n, 1).expand(L, two, R, Hkv, n, D))
        return shifts

    def trim(self, n: int) -> None:
        """Forget the first ``n`` positions of every row (columns that are padding in the rows that matter): the
        rest moves left, ``length`` goes down by ``n``. The :attr:`layers` stay valid (same storage)."""
        if n <= 0:
            return
        kept = self.length - n
        if kept > 0:
            self.kv[..., :kept, :] = self.kv[..., n:self.length, :].clone()
        self.length = max(kept, 0)

    def copy_rows(self, row: int, source: KVCache, source_row: int, n: int) -> None:
        """Copy the first ``n`` positions of ``source``'s row ``source_row`` (``source`` may be this cache) into
        row ``row``: a server moving a prefilled prompt into its running batch, or a last row into a freed one."""
        self.kv[:, :, row, :, :n] = source.kv[:, :, source_row, :, :n]

    def ragged(self, rows: int, lengths: Tensor) -> RaggedView:
        """The first ``rows`` rows as a :class:`RaggedView` whose row b is ``lengths[b]`` long (a view: no copy)."""
        return RaggedView(self.k[:, :rows], self.v[:, :rows], lengths)


class RaggedView:
    """The ragged strategy: rows at different lengths (continuous batching), T new positions each.

    ``k``, ``v`` (L, B, Hkv, M, D) views of a dense cache's first B rows; ``lengths`` (B,) each row's cached
    positions, which is also where its new keys and values go: row b writes its T positions at ``lengths[b] ..
    lengths[b] + T - 1`` and its query t sees keys ``j <= lengths[b] + t`` (T > 1: a server's speculative
    verification, rows with fewer drafts padding theirs; what a row wrote past the tokens it keeps is never seen
    again, and overwritten later). The caller advances ``lengths`` and keeps ``max(lengths) + T <= M``.
    """

    plain = True

    def __init__(self, k: Tensor, v: Tensor, lengths: Tensor) -> None:
        self.layers: list[LayerCache] = [RaggedLayer(k[i], v[i], self) for i in range(k.shape[0])]
        self.lengths, self.keys = lengths, 0
        self.columns = lengths[:, None]  # (B, T) the columns a call writes (its queries' key indices)
        self._batch = k.shape[1]

    @property
    def batch_size(self) -> int:
        return self._batch

    def span(self, T: int, attention_mask: Tensor | None) -> KeySpan:
        """One query per row (T = 1) is computed with the one-query kernel (``ragged``); T > 1 with the (B, 1, T, S)
        mask of each row's queries."""
        self.keys = int(self.lengths.max()) + T
        self.columns = self.lengths[:, None] if T == 1 else \
            self.lengths[:, None] + torch.arange(T, device=self.lengths.device)  # (B, T)
        return KeySpan(None, self.keys, self.columns, None, ragged=T == 1)

    def advance(self, n: int) -> None:
        """Nothing: the caller owns ``lengths``."""


class StaticKVCache(DenseCache):
    """The cache of compiled decoding: separate (B, Hkv, M, D) key and value tensors per layer, which a compiled
    step writes in place (as views of one storage, each write made the compiled graph copy the whole storage:
    11 ms a step for the 4-layer model at batch 8). The eager prefill uses it as a dense cache; the compiled steps
    see it through :meth:`static`."""

    def __init__(self, cache: KVCache) -> None:
        self.max_len, self.length = cache.max_len, cache.length
        self.tensors = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in (cache.layer(i)
                                                                             for i in range(cache.k.shape[0]))]
        self.layers: list[LayerCache] = [DenseLayer(k, v, self) for k, v in self.tensors]

    @property
    def batch_size(self) -> int:
        return self.tensors[0][0].shape[0]

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return self.tensors[i]

    def static(self, pos: Tensor, key_mask: Tensor | None) -> StaticView:
        """The same tensors as a :class:`StaticView` written at ``pos``."""
        return StaticView(self.tensors, pos, key_mask)


class StaticView:
    """The static strategy: per-layer (B, Hkv, M, D) tensors written at ``pos`` ((1,) long tensor), attention over
    all M positions, ``key_mask`` (B, M) bool | None hiding each row's prompt padding. Every call has the same
    shapes, so a compiled step compiles once; the caller fills ``pos`` and advances."""

    plain = False  # the modules run (inside torch.compile)

    def __init__(self, layers: list[tuple[Tensor, Tensor]], pos: Tensor, key_mask: Tensor | None) -> None:
        self.layers: list[LayerCache] = [StaticLayer(k, v, self) for k, v in layers]
        self.pos, self.key_mask = pos, key_mask
        self.keys = layers[0][0].shape[-2]
        self._batch = layers[0][0].shape[0]

    @property
    def batch_size(self) -> int:
        return self._batch

    def span(self, T: int, attention_mask: Tensor | None) -> KeySpan:
        return KeySpan(None, self.keys, self.pos[None], self.key_mask)

    def advance(self, n: int) -> None:
        """Nothing: the caller advances (no Python state changes inside a compiled step)."""


class RollingLayer:
    """One layer of a :class:`RollingKVCache`: writes the positions the owner keeps into their slots; attends over
    the new keys alone (the first call: the whole prompt), the ring (one-token steps) or the ring before the write
    and the new keys (later calls of several positions)."""

    __slots__ = ("k", "v", "owner")

    def __init__(self, k: Tensor, v: Tensor, owner: RollingKVCache) -> None:
        self.k, self.v, self.owner = k, v, owner  # (B, Hkv, S + 1, D): the ring and one slot for what is not kept

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        owner, S = self.owner, self.owner.slots
        before = None
        if owner.mode == "extend":
            before = (torch.cat((self.k[:, :, :S], k), dim=2), torch.cat((self.v[:, :, :S], v), dim=2))
        at = owner.write_at
        if isinstance(at, int):  # every row writes its one new position into the same slot
            self.k.narrow(2, at, 1).copy_(k)
            self.v.narrow(2, at, 1).copy_(v)
        else:  # (B, 1, T, 1) slots, expanded over heads and features
            index = at.expand(-1, k.shape[1], -1, k.shape[3])
            self.k.scatter_(2, index, k)
            self.v.scatter_(2, index, v)
        if owner.mode == "first":
            return k, v
        return before if before is not None else (self.k[:, :, :S], self.v[:, :, :S])


class RollingKVCache:
    """The rolling strategy of sliding-window attention: per layer a ring of ``globals + window`` key/value slots,
    so memory stays that of ``globals + window`` positions however long decoding runs.

    Position p goes to slot p (p < globals, the global positions, kept for good) or ``globals + (p - globals) %
    window``; a write keeps only the positions a later query can still see (the global ones and the last
    ``window``). The slots are attended in slot order (attention does not depend on the order of its keys; the
    positions are already in the keys (rotary) or come from :attr:`positions` (a score bias)). Left padding is
    marked by the ``attention_mask`` each call gets, over all columns so far (as for the dense cache): a row's
    positions count its real tokens, its padding is never stored. ``limit``: the highest position count the model
    takes (None: no limit, a position scheme that extrapolates)."""

    plain = True

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, window: int, globals: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 limit: int | None = None) -> None:
        self.window, self.globals, self.limit = window, globals, limit
        self.slots = S = globals + window
        self.max_len = None  # no capacity: the ring never fills up
        self.length = 0  # columns seen (padding included)
        self._set_storage(torch.zeros((num_layers, 2, batch_size, num_kv_heads, S + 1, head_dim), dtype=dtype,
                                      device=device),
                          torch.full((batch_size, S + 1), -1, dtype=torch.long, device=device),
                          torch.zeros(batch_size, dtype=torch.long, device=device))
        self.padded = False  # a row had padding: slots can be empty for some rows only
        self.mode, self.write_at, self._pending = "first", 0, None

    def _set_storage(self, kv: Tensor, positions: Tensor, count: Tensor) -> None:
        self.kv, self.positions, self.count = kv, positions, count  # positions: (B, S + 1) per slot, -1 = empty
        self.layers: list[LayerCache] = [RollingLayer(kv[i, 0], kv[i, 1], self) for i in range(kv.shape[0])]

    @property
    def batch_size(self) -> int:
        return self.kv.shape[2]

    def span(self, T: int, attention_mask: Tensor | None) -> KeySpan:
        """The keys of T new columns (``attention_mask`` (B, length + T) or None) and where they are written."""
        B, S, W, g = self.batch_size, self.slots, self.window, self.globals
        device = self.positions.device
        valid = None if attention_mask is None else attention_mask[:, -T:].bool()  # (B, T)
        if valid is not None and not bool(valid.all()):
            self.padded = True
        else:
            valid = None
        offsets = torch.arange(T, device=device)[None] if valid is None else valid.long().cumsum(-1) - 1
        pos = self.count[:, None] + offsets  # (B, T) the new positions
        count = self.count + (T if valid is None else valid.sum(-1))
        if self.limit is not None and self.length + T > self.limit:
            raise GenerationError(f"sequence of {self.length + T} positions exceeds the model's context of "
                                  f"{self.limit}")
        keep = pos > (count[:, None] - 1 - W)  # the last W positions of each row
        if g:
            keep |= pos < g
        if valid is not None:
            keep &= valid
        slot = torch.where(pos < g, pos, g + (pos - g).remainder(W)) if g else pos.remainder(W)
        slot = torch.where(keep, slot, S)  # (B, T); what is not kept goes to the spare slot S
        if T == 1 and valid is None and not self.padded and self.length >= g:
            self.write_at = g + (self.length - g) % W  # no padding ever: every row writes the same slot
        else:
            self.write_at = slot[:, None, :, None]  # (B, 1, T, 1)
        self._pending = (slot, pos, count)
        extent = self.length + T
        if self.length == 0:
            self.mode = "first"
            return KeySpan(0, T, None, valid, extent=extent)
        if T == 1:  # the ring itself, written first: every kept slot is inside the window of the new position
            self.mode = "step"
            self._record(slot, pos)  # the slots' positions now: the layers read only their keys and values
            self._pending = (None, None, count)
            known = self.positions[:, :S]
            return KeySpan(None, S, pos, known >= 0 if self.padded or self.length < S else None, windowed=True,
                           key_positions=known, extent=extent)
        self.mode = "extend"
        keys_valid = torch.cat((self.positions[:, :S] >= 0,
                                torch.ones(B, T, dtype=torch.bool, device=device) if valid is None else valid), 1)
        return KeySpan(None, S + T, pos, keys_valid, key_positions=torch.cat((self.positions[:, :S], pos), 1),
                       extent=extent)

    def _record(self, slot: Tensor, pos: Tensor) -> None:
        self.positions.scatter_(1, slot, pos)
        self.positions[:, self.slots] = -1  # the spare slot holds nothing

    def advance(self, n: int) -> None:
        slot, pos, count = self._pending
        if slot is not None:  # (a step recorded its slots' positions already)
            self._record(slot, pos)
        self.count, self.length, self._pending = count, self.length + n, None

    def reset(self) -> None:
        self.positions.fill_(-1)
        self.count.zero_()
        self.length, self.padded = 0, False

    def select(self, index: Tensor) -> None:
        """Keep only batch rows ``index`` (decoding drops finished rows); the :attr:`layers` are rebuilt."""
        self._set_storage(self.kv.index_select(2, index), self.positions.index_select(0, index),
                          self.count.index_select(0, index))

    def reorder(self, index: Tensor) -> None:
        """Row ``i`` becomes the old row ``index[i]`` (beam search), in place."""
        self.kv.copy_(self.kv.index_select(2, index))
        self.positions.copy_(self.positions.index_select(0, index))
        self.count.copy_(self.count.index_select(0, index))


class MemorySlot:
    """One layer of a :class:`SegmentMemory`: attends over the memory and the new positions, then keeps the last
    ``memory_len`` of them, detached (no gradient flows into an earlier segment)."""

    __slots__ = ("k", "v", "owner")

    def __init__(self, owner: SegmentMemory) -> None:
        self.k = self.v = None
        self.owner = owner

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.k is not None:
            k, v = torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)  # (B, Hkv, m + T, D)
        M = self.owner.memory_len
        if M:
            self.k, self.v = k[:, :, -M:].detach(), v[:, :, -M:].detach()
        return k, v


class SegmentMemory:
    """Transformer-XL's segment-level recurrence as a cache strategy: every call's queries see the memory (the last
    ``memory_len`` positions' keys and values of each layer, from earlier calls, detached) and their own positions
    causally. The same object carries the memory across training steps (a stream of consecutive segments),
    evaluation segments and decoding steps; :meth:`reset` forgets it (a new stream). The keys and values are kept
    rather than the hidden states they come from: the same forward computation as the paper's concatenated states,
    with no gradient into the key/value projections through the memory (the memory is constant either way).
    Rows cannot be padded: every row's memory must end at the same position."""

    plain = True
    max_len = None

    def __init__(self, num_layers: int, batch_size: int, memory_len: int) -> None:
        self.memory_len, self._batch = memory_len, batch_size
        self.layers: list[LayerCache] = [MemorySlot(self) for _ in range(num_layers)]
        self.length = 0  # positions seen since the last reset

    @property
    def batch_size(self) -> int:
        return self._batch

    def span(self, T: int, attention_mask: Tensor | None) -> KeySpan:
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise GenerationError("a Transformer-XL memory cannot carry padded rows (every row's memory must end at "
                                  "the same position): give rows of equal length, or decode them one by one")
        past = min(self.length, self.memory_len)
        return KeySpan(past, past + T)

    def advance(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        for layer in self.layers:
            layer.k = layer.v = None
        self.length = 0

    def select(self, index: Tensor) -> None:
        """Keep only batch rows ``index``."""
        self._batch = index.numel()
        for layer in self.layers:
            if layer.k is not None:
                layer.k, layer.v = layer.k.index_select(0, index), layer.v.index_select(0, index)

    reorder = select

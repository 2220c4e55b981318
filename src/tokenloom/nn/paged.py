"""The paged strategy: keys and values in a pool of fixed-size blocks, each sequence a table of block ids (vLLM's
PagedAttention, Kwon et al. 2023), for a server that packs requests of any length into one memory budget.

* :class:`PagedKVCache` holds the pool: per layer (Hkv, num_blocks, block_size, D) keys and values, in one
  (L, 2, Hkv, N, bs, D) tensor. It knows nothing of which block belongs to whom: the server's allocator
  (:mod:`tokenloom.serving.blocks`) does, and hands each call its rows' block tables.
* :class:`PagedView` is one call's cache strategy (the :class:`~.kv_cache.DecodeCache` protocol): the call's (B, T)
  tokens, flattened in row order, are split into *segments*, one per sequence: segment r holds ``counts[r]``
  consecutive tokens, written at columns ``lengths[r] .. lengths[r] + counts[r] - 1`` of the sequence whose blocks
  are ``tables[r]``. Decode steps are (A, 1) calls of one-token segments, a speculative verification (A, T) calls
  of T-token segments, a chunked prefill mixed with decode rows a (1, N) call whose segments are the prompts' chunks
  and the running rows' newest tokens: the linear layers then run over exactly the tokens of the step.
* Attention (:class:`PagedLayout`, planned once per forward and shared by every layer): the segments are grouped by
  their token count (and, where one batch would gather far more blocks than its sequences hold, their block counts
  within a factor of 2), and each group attends as one batch:
  its sequences' blocks gathered into (G, Hkv, S, D) (one copy of the keys and values the step reads), the mask from
  the one builder :func:`~.masks.attention_mask` (causal over each row's own columns, with the position scheme's
  score bias and a sliding window where the model has them), the one-query kernel for one-token groups.

A sequence's positions are its columns (a server's requests are never left-padded), so the rotary angles and
learned positions come from the ``positions`` the caller gives as they would for a dense cache. Columns a call
writes past what its sequence keeps (a speculative row's padded drafts) are never seen (causal) and overwritten later.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import sdpa_attention
from .masks import KeySpan, attention_mask


class PagedKVCache:
    """A pool of ``num_blocks`` blocks of ``block_size`` positions for every layer's keys and values."""

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a paged cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks} and "
                             f"{block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.pool = torch.zeros((num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim), dtype=dtype,
                                device=device)
        self._scratch: Tensor | None = None  # the gathers' buffers (gather), grown as needed

    def gather(self, k: Tensor, v: Tensor, tables: Tensor) -> tuple[Tensor, Tensor]:
        """One layer's ``k``, ``v`` pools (Hkv, N, bs, D) gathered at ``tables`` (G, nb) into two reused buffers:
        (Hkv, G, nb * bs, D) views (valid until the next gather)."""
        Hkv, _, bs, D = k.shape
        G, nb = tables.shape
        size = Hkv * G * nb * bs * D
        if self._scratch is None or self._scratch.shape[1] < size:
            self._scratch = k.new_empty((2, size))
        index = tables.reshape(-1)
        out = []
        for pool, buffer in zip((k, v), self._scratch[:, :size], strict=True):
            buffer = buffer.view(Hkv, G * nb, bs, D)
            torch.index_select(pool, 1, index, out=buffer)
            out.append(buffer.view(Hkv, G, nb * bs, D))
        return out[0], out[1]

    @property
    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def copy_block(self, dst: int, src: int, n: int | None = None) -> None:
        """Copy the first ``n`` positions (all by default) of block ``src`` into block ``dst`` in every layer
        (copy-on-write of a shared partial block)."""
        n = self.block_size if n is None else n
        self.pool[:, :, :, dst, :n] = self.pool[:, :, :, src, :n]

    def view(self, tables: Tensor, lengths: Tensor, counts: Tensor | None = None) -> PagedView:
        """The strategy of one call over R sequences: ``tables`` (R, nb) long block ids (a row's entries past its
        blocks: any valid id), ``lengths`` (R,) columns already written, ``counts`` (R,) the call's tokens of each
        (None: the call's T for every row, its input (R, T))."""
        return PagedView(self, tables, lengths, counts)


class PagedLayer:
    """One layer of a :class:`PagedView`: writes the call's tokens into their blocks; attention reads the pool
    through the view's :class:`PagedLayout` (the returned pools)."""

    __slots__ = ("k", "v", "owner")

    def __init__(self, k: Tensor, v: Tensor, owner: PagedView) -> None:
        self.k, self.v, self.owner = k, v, owner  # (Hkv, num_blocks, bs, D)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        B, Hkv, T, D = k.shape
        blocks, offsets = self.owner.slots
        self.k[:, blocks, offsets] = k.transpose(0, 1).reshape(Hkv, B * T, D)
        self.v[:, blocks, offsets] = v.transpose(0, 1).reshape(Hkv, B * T, D)
        return self.k, self.v


class PagedView:
    """The paged strategy for one call: see the module docstring. ``span`` plans the attention (a
    :class:`PagedLayout` in :attr:`KeySpan.layout`); the caller advances its own lengths."""

    plain = True

    def __init__(self, cache: PagedKVCache, tables: Tensor, lengths: Tensor, counts: Tensor | None) -> None:
        self.cache, self.tables, self.lengths, self.counts = cache, tables, lengths, counts
        pool = cache.pool
        self.layers = [PagedLayer(pool[i, 0], pool[i, 1], self) for i in range(pool.shape[0])]
        self.slots: tuple[Tensor, Tensor] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.tables.shape[0])

    def span(self, T: int, attention_mask: Tensor | None) -> KeySpan:
        """``T`` tokens per input row; the segments as the view was given them. Padding is not taken (a server's
        sequences are not padded): ``attention_mask`` must be None."""
        if attention_mask is not None:
            raise ValueError("a paged cache takes no attention_mask: its sequences are not padded")
        R, device = self.tables.shape[0], self.tables.device
        counts = self.counts if self.counts is not None else torch.full((R,), T, dtype=torch.long, device=device)
        layout = PagedLayout(self, counts)
        self.slots = layout.slots
        return KeySpan(None, layout.keys, layout.columns.view(-1, T), None, layout=layout)

    def advance(self, n: int) -> None:
        """Nothing: the caller owns ``lengths``."""


class PagedLayout:
    """One forward's attention over a :class:`PagedView`: the segments grouped by token count, each group's block
    tables, key count and mask (the masks built by :meth:`plan`, once, for every layer); :meth:`attend` runs each
    group and puts its outputs back in token order."""

    def __init__(self, view: PagedView, counts: Tensor) -> None:
        self.view = view
        bs = view.cache.block_size
        device = counts.device
        lengths = view.lengths
        starts = torch.cumsum(counts, 0) - counts  # (R,) each segment's first flat token
        N = int(counts.sum())
        row = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts, output_size=N)  # (N,)
        offset = torch.arange(N, device=device) - starts[row]
        self.columns = lengths[row] + offset  # (N,) each token's column in its sequence
        self.slots = (view.tables[row, self.columns // bs], self.columns % bs)
        self.keys = int((lengths + counts).max())
        self.groups: list[_Group] = []
        # groups: segments of one size; where gathering every sequence to the longest one's blocks would copy over
        # 1.5x the blocks they hold, split further into sequences whose block counts are within 2x of each other
        # (48 rows of 16-1024 tokens in one group ran 0.69x the slot layout's speed; a group more costs a call of
        # each kernel per layer)
        sizes: dict[int, list[tuple[int, int]]] = {}
        for r, (c, end) in enumerate(zip(counts.tolist(), (lengths + counts).tolist(), strict=True)):
            sizes.setdefault(c, []).append((r, -(-end // bs)))
        members: dict[tuple[int, int], list[int]] = {}
        for c, rows_blocks in sizes.items():
            blocks = [b for _, b in rows_blocks]
            split = max(blocks) * len(blocks) > 1.5 * sum(blocks)
            for r, b in rows_blocks:
                members.setdefault((c, (b - 1).bit_length() if split else 0), []).append(r)
        whole = len(members) == 1  # one group: its tokens are the call's, in order
        for (n, _), listed in sorted(members.items()):
            rows = torch.arange(len(listed), device=device) if whole else torch.tensor(listed, device=device)
            ends = lengths[rows] + n  # (G,) each row's keys after the call
            S = int(ends.max())
            nb = -(-S // bs)
            queries = lengths[rows][:, None] + torch.arange(n, device=device)  # (G, n) the queries' columns
            tokens = None if whole else (starts[rows][:, None] + torch.arange(n, device=device)).view(-1)
            self.groups.append(_Group(n, view.tables[rows, :nb], S, queries, tokens))
        self.N = N

    def plan(self, *, causal: bool, window, position, dtype: torch.dtype, device: torch.device) -> PagedLayout:
        """Each group's mask from the one builder (causal over its rows' own columns, a score bias, a window)."""
        for g in self.groups:
            span = KeySpan(None, g.keys, g.queries, None)
            g.mask, _ = attention_mask(span, g.n, causal=causal, position=position, window=window, dtype=dtype,
                                       device=device)
        return self

    def attend(self, backend, q: Tensor, k: Tensor, v: Tensor, dropout: float) -> Tensor:
        """``q`` (B, H, T, D) of the call's tokens, ``k``/``v`` a layer's pools (Hkv, num_blocks, bs, D) -> the
        (B, H, T, D) attention output."""
        B, H, T, D = q.shape
        if len(self.groups) == 1 and self.groups[0].tokens is None and self.groups[0].n == T:
            return self._group(backend, self.groups[0], q, k, v, dropout)
        flat = q.transpose(1, 2).reshape(B * T, H, D)
        out = flat.new_empty(B * T, H, D)
        for g in self.groups:
            index = g.tokens if g.tokens is not None else slice(None)
            qg = flat[index].view(-1, g.n, H, D).transpose(1, 2)  # (G, H, n, D)
            og = self._group(backend, g, qg, k, v, dropout)
            out[index] = og.transpose(1, 2).reshape(-1, H, D)
        return out.view(B, T, H, D).transpose(1, 2)

    def _group(self, backend, g: _Group, q: Tensor, k: Tensor, v: Tensor, dropout: float) -> Tensor:
        """One group's attention: its rows' blocks gathered into the cache's reused buffers (a fresh tensor each
        time costs its page faults: 36 against 6 ms for 64 rows of 35 blocks of 6 x 16 x 64 on the AVX2 EPYC),
        head-major (Hkv, G, S, D); with the default backend, attention over them with the G rows as heads and
        each key/value head's query heads folded into its queries, so nothing large is copied again."""
        G, nb = g.tables.shape
        Hkv, _, bs, D = k.shape
        keys, values = self.view.cache.gather(k, v, g.tables)  # (Hkv, G, nb * bs, D) each
        keys, values = keys[:, :, :g.keys], values[:, :, :g.keys]
        if backend is not sdpa_attention:  # (another backend: its own layout, one copy more)
            out, _ = backend(q, keys.transpose(0, 1), values.transpose(0, 1), g.mask, False, dropout, False)
            return out
        _, H, n, _ = q.shape
        r = H // Hkv
        folded = q.reshape(G, Hkv, r * n, D).transpose(0, 1)  # (Hkv, G, r * n, D)
        mask = g.mask
        if mask is not None:
            if mask.shape[1] == 1 and (r == 1 or n == 1):  # one mask for every head: (1, G, n, S) broadcasts
                mask = mask.transpose(0, 1)
            else:
                S = mask.shape[-1]
                mask = mask.expand(G, H, n, S).reshape(G, Hkv, r * n, S).transpose(0, 1)
        out, _ = sdpa_attention(folded, keys, values, mask, False, dropout, False)  # (Hkv, G, r * n, D)
        return out.transpose(0, 1).reshape(G, H, n, D)


class _Group:
    """Segments of ``n`` tokens each: ``tables`` (G, nb) their blocks, ``keys`` the most keys any attends over,
    ``queries`` (G, n) the queries' columns, ``tokens`` (G * n,) their flat indices in the call (None: the call's
    tokens in order), ``mask`` filled by :meth:`PagedLayout.plan`."""

    __slots__ = ("n", "tables", "keys", "queries", "tokens", "mask")

    def __init__(self, n: int, tables: Tensor, keys: int, queries: Tensor, tokens: Tensor | None) -> None:
        self.n, self.tables, self.keys, self.queries, self.tokens = n, tables, keys, queries, tokens
        self.mask: Tensor | None = None

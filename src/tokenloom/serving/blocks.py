"""Block ids of a paged KV cache, with automatic prefix caching (vLLM's scheme).

The serving engine keeps keys and values in a pool of ``num_blocks`` blocks of ``block_size`` token positions; a
request's block table lists the blocks holding its positions in order. :class:`BlockManager` only hands out and takes
back block ids; the engine copies tensor contents itself.

* **Refcounts.** Each block counts the tables that reference it. :meth:`BlockManager.allocate` hands out a block with
  refcount 1, :meth:`~BlockManager.fork` adds a reference (a sibling sample sharing its parent's blocks), and
  :meth:`~BlockManager.release` drops one; releasing an unreferenced block is a bug (``ValueError``).
* **Copy-on-write.** A block may be written only by its sole owner and only while it is not cached
  (:meth:`~BlockManager.writable`). Forked sequences share their partial last block; the first to write into it
  calls :meth:`~BlockManager.copy_on_write`, gets a fresh block, and copies the shared one's contents into it. The
  old block is released only after the new one is allocated, and a cached block left unreferenced keeps its
  contents (it only becomes evictable), so the copy can read it right after.
* **Prefix caching.** Only full blocks are cached, under a hash chain: ``key_i = sha256(key_{i-1} + tokens of block
  i as int64 little-endian)``, ``key_{-1} = b""``, so a key names a block's tokens *and* everything before them.
  :meth:`~BlockManager.register` records a filled block under its key; :meth:`~BlockManager.match` returns the
  longest run of cached blocks matching a prompt's block-aligned prefix (stopping at the first miss), each
  referenced anew, so the engine skips prefilling those positions.
* **LRU eviction.** A cached block released to refcount 0 keeps its contents and key and waits, evictable, in an
  LRU (most recently released last); a match revives it. An uncached block released to 0 returns to the free list.
  Allocation takes from the free list first, else evicts the least recently released cached block (its key
  dropped). A referenced block is never evicted.

Every operation is O(1) amortised (``match`` and ``block_keys``: O(tokens)).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

from ..errors import ConfigError

_SWAP = sys.byteorder == "big"  # block keys hash little-endian int64 on every platform


class NoFreeBlocks(Exception):
    """No block is free or evictable."""


class BlockManager:
    """Refcounted block ids of ``num_blocks`` blocks of ``block_size`` positions, with an LRU prefix cache of full
    blocks (when ``prefix_caching``). Invariant: each block is referenced (refcount > 0), on the free list
    (unreferenced, uncached), or evictable (unreferenced, cached, in the LRU); ``free + used == num_blocks``."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: expected an integer >= 1")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, bool(prefix_caching)
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced, uncached; allocated from the left
        self._refs = [0] * num_blocks
        self._key: dict[int, bytes] = {}  # cached block -> its key
        self._by_key: dict[bytes, int] = {}  # key -> the block holding it
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, least recently released first
        self.query_tokens = self.hit_tokens = self.evictions = 0

    # --- accounting ---

    @property
    def free(self) -> int:
        """Blocks allocatable now: on the free list, or cached and unreferenced (evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def used(self) -> int:
        """Blocks with refcount > 0."""
        return self.num_blocks - self.free

    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` blocks can be allocated now."""
        return n <= self.free

    def refcount(self, block: int) -> int:
        """How many tables reference ``block``."""
        return self._refs[self._valid(block)]

    def writable(self, block: int) -> bool:
        """Whether the owner may write into ``block``: referenced once and not cached."""
        return self._refs[self._valid(block)] == 1 and block not in self._key

    def key_of(self, block: int) -> bytes | None:
        """The cache key of ``block``, or None when it is not cached."""
        return self._key.get(self._valid(block))

    # --- allocation ---

    def allocate(self) -> int:
        """A block with refcount 1 and no key: from the free list, else the least recently released evictable
        block (evicted: its key dropped). Raises :class:`NoFreeBlocks` when there is neither."""
        if self._free:
            block = self._free.popleft()
        elif self._lru:
            block, _ = self._lru.popitem(last=False)
            del self._by_key[self._key.pop(block)]
            self.evictions += 1
        else:
            raise NoFreeBlocks(f"no free block (all {self.num_blocks} in use)")
        self._refs[block] = 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        """``n`` blocks, all or nothing (:class:`NoFreeBlocks`, nothing taken)."""
        if n < 0:
            raise ValueError(f"n={n}: expected a count >= 0")
        if not self.can_allocate(n):
            raise NoFreeBlocks(f"{n} blocks asked, {self.free} free")
        return [self.allocate() for _ in range(n)]

    def fork(self, block: int) -> int:
        """Another reference to ``block`` (an evictable cached block is revived); returns ``block``."""
        if self._refs[self._valid(block)] == 0:
            if block not in self._lru:
                raise ValueError(f"block {block} is free: fork needs a referenced or cached block")
            del self._lru[block]
        self._refs[block] += 1
        return block

    def release(self, block: int) -> None:
        """Drop a reference; at 0 a cached block becomes evictable (most recently used), an uncached one free.
        Raises ValueError for a block with no reference (a double free)."""
        if self._refs[self._valid(block)] <= 0:
            raise ValueError(f"block {block} released with no reference (double free)")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key:
                self._lru[block] = None
            else:
                self._free.append(block)

    def release_all(self, blocks: list[int]) -> None:
        """:meth:`release` each of ``blocks``."""
        for block in blocks:
            self.release(block)

    def copy_on_write(self, block: int) -> tuple[int, bool]:
        """``(block, False)`` when :meth:`writable`; else ``(new, True)``: a new block, ``block`` released. The caller
        copies ``block``'s contents into ``new`` before writing (they are intact: ``block`` is released after the
        allocation, and a cached block left unreferenced is only made evictable)."""
        if self.writable(block):
            return block, False
        new = self.allocate()
        self.release(block)
        return new, True

    # --- prefix caching ---

    def _keys(self, tokens: list[int]) -> Iterator[bytes]:
        """The hash chain over the full blocks of ``tokens``, lazily."""
        key, bs = b"", self.block_size
        for start in range(0, len(tokens) // bs * bs, bs):
            chunk = array("q", tokens[start:start + bs])
            if _SWAP:
                chunk.byteswap()
            key = hashlib.sha256(key + chunk.tobytes()).digest()
            yield key

    def block_keys(self, tokens: list[int]) -> list[bytes]:
        """The keys of the full blocks of ``tokens`` (``len(tokens) // block_size`` of them): ``key_i =
        sha256(key_{i-1} + block i's ids as int64 little-endian).digest()``, ``key_{-1} = b""``."""
        return list(self._keys(tokens))

    def match(self, tokens: list[int], limit: int | None = None) -> list[int]:
        """The cached blocks of the longest block-aligned prefix of ``tokens`` (at most ``limit`` blocks), each
        referenced anew (an evictable one revived). Counts ``query_tokens`` and ``hit_tokens``."""
        if limit is not None and limit < 0:
            raise ValueError(f"limit={limit}: expected None or a count >= 0")
        self.query_tokens += len(tokens)
        if not self.prefix_caching or limit == 0:
            return []
        out: list[int] = []
        for key in self._keys(tokens):
            block = self._by_key.get(key)
            if block is None:
                break
            out.append(self.fork(block))
            if len(out) == limit:
                break
        self.hit_tokens += len(out) * self.block_size
        return out

    def register(self, block: int, key: bytes) -> int:
        """Cache the full, written ``block`` under ``key``; returns ``block``, or the block already holding ``key``
        (``block`` then stays uncached). A no-op returning ``block`` without prefix caching."""
        if self._refs[self._valid(block)] == 0:
            raise ValueError(f"block {block} registered with no reference")
        if not self.prefix_caching:
            return block
        held = self._by_key.get(key)
        if held is not None:
            return held
        if block in self._key:
            raise ValueError(f"block {block} is already cached under another key")
        self._by_key[key], self._key[block] = block, key
        return block

    # --- a sequence's table of blocks ---------------------------------------------------------------------------

    def grow(self, table: list[int], length: int, columns: int, copy: Callable[[int, int, int], None]) -> None:
        """Extend ``table`` (a sequence of ``length`` columns) to hold ``columns`` columns; first, the partial block
        the next write lands in is made its own when shared (``copy(new, old, n)`` copies its first n positions).
        :class:`NoFreeBlocks` when the blocks are not there (the table then holds what it got)."""
        bs = self.block_size
        i = length // bs
        if length % bs and i < len(table) and not self.writable(table[i]):
            old = table[i]
            new, copied = self.copy_on_write(old)
            if copied:
                copy(new, old, length % bs)
            table[i] = new
        need = -(-columns // bs) - len(table)
        if need > 0:
            table.extend(self.allocate_many(need))

    def register_run(self, table: list[int], tokens: list[int], registered: int) -> int:
        """Register the full blocks of ``table`` past its first ``registered`` ones, ``tokens`` the sequence's tokens
        they hold; a block whose tokens another block holds already is replaced by that one (the duplicate
        released). -> the full blocks now registered."""
        full = len(tokens) // self.block_size
        if full <= registered or not self.prefix_caching:
            return max(registered, full)
        keys = self.block_keys(tokens[:full * self.block_size])
        for i in range(registered, full):
            held = self.register(table[i], keys[i])
            if held != table[i]:
                self.fork(held)
                self.release(table[i])
                table[i] = held
        return full

    def stats(self) -> dict:
        """Counters and occupancy: query_tokens, hit_tokens, evictions, cached_blocks, free, used."""
        return {"query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens, "evictions": self.evictions,
                "cached_blocks": len(self._key), "free": self.free, "used": self.used}

    # --- checks ---

    def _valid(self, block: int) -> int:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block={block!r}: expected an id in [0, {self.num_blocks})")
        return block

    def check(self) -> None:
        """Raise AssertionError unless the free list, LRU, refcounts and key maps agree (for tests)."""

        def expect(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(what)

        free, lru = set(self._free), set(self._lru)
        expect(len(free) == len(self._free), "a block is on the free list twice")
        expect(not free & lru, "a block is both free and evictable")
        expect(all(r >= 0 for r in self._refs), "a negative refcount")
        for block, refs in enumerate(self._refs):
            where = (block in free) + (block in lru) + (refs > 0)
            expect(where == 1, f"block {block} (refcount {refs}) is in {where} of free/evictable/used")
            expect(block not in free or block not in self._key, f"free block {block} has a key")
            expect(block not in lru or block in self._key, f"evictable block {block} has no key")
        expect(len(self._key) == len(self._by_key), "the key maps differ in size")
        expect(all(self._by_key.get(k) == b for b, k in self._key.items()), "the key maps disagree")
        expect(self.prefix_caching or not self._key, "a cached block without prefix caching")
        expect(self.used == sum(r > 0 for r in self._refs), "used disagrees with the refcounts")
        expect(self.free + self.used == self.num_blocks, "free + used != num_blocks")

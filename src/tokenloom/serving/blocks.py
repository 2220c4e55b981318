"""Block ids of a paged KV cache (interim; the full version replaces this file)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque


class NoFreeBlocks(Exception):
    """No block is free or evictable."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self._free = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._key: dict[int, bytes] = {}
        self._by_key: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.query_tokens = self.hit_tokens = self.evictions = 0

    @property
    def free(self) -> int:
        return len(self._free) + len(self._lru)

    @property
    def used(self) -> int:
        return self.num_blocks - self.free

    def can_allocate(self, n: int) -> bool:
        return n <= self.free

    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._lru:
            block, _ = self._lru.popitem(last=False)
            del self._by_key[self._key.pop(block)]
            self.evictions += 1
        else:
            raise NoFreeBlocks("no free block")
        self._refs[block] = 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise NoFreeBlocks(f"{n} blocks asked, {self.free} free")
        return [self.allocate() for _ in range(n)]

    def fork(self, block: int) -> int:
        if self._refs[block] == 0:
            self._lru.pop(block)
        self._refs[block] += 1
        return block

    def release(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} released with no reference")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key:
                self._lru[block] = None
            else:
                self._free.append(block)

    def release_all(self, blocks: list[int]) -> None:
        for b in blocks:
            self.release(b)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def writable(self, block: int) -> bool:
        return self._refs[block] == 1 and block not in self._key

    def copy_on_write(self, block: int) -> tuple[int, bool]:
        if self.writable(block):
            return block, False
        new = self.allocate()
        self.release(block)
        return new, True

    def block_keys(self, tokens: list[int]) -> list[bytes]:
        keys, key, bs = [], b"", self.block_size
        for i in range(len(tokens) // bs):
            key = hashlib.sha256(key + array("q", tokens[i * bs:(i + 1) * bs]).tobytes()).digest()
            keys.append(key)
        return keys

    def match(self, tokens: list[int], limit: int | None = None) -> list[int]:
        self.query_tokens += len(tokens)
        if not self.prefix_caching:
            return []
        out = []
        for key in self.block_keys(tokens)[:limit]:
            block = self._by_key.get(key)
            if block is None:
                break
            out.append(self.fork(block))
        self.hit_tokens += len(out) * self.block_size
        return out

    def register(self, block: int, key: bytes) -> int:
        if not self.prefix_caching:
            return block
        held = self._by_key.get(key)
        if held is not None:
            return held
        self._by_key[key], self._key[block] = block, key
        return block

    def key_of(self, block: int) -> bytes | None:
        return self._key.get(block)

    def stats(self) -> dict:
        return {"query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens, "evictions": self.evictions,
                "cached_blocks": len(self._key), "free": self.free, "used": self.used}

"""The block allocator of the paged KV cache (tokenloom.serving.blocks): refcounts, copy-on-write, the prefix cache's
hash chain and matching, LRU eviction, and a randomized run checking the invariants after every operation."""

import hashlib
import random
import struct

import pytest

from tokenloom.serving.blocks import BlockManager, NoFreeBlocks

BS = 4


def cached(manager: BlockManager, tokens: list[int]) -> list[int]:
    """Allocate, register and release the full blocks of ``tokens`` (as a finished request would): their blocks."""
    blocks = manager.allocate_many(len(tokens) // manager.block_size)
    for block, key in zip(blocks, manager.block_keys(tokens), strict=True):
        assert manager.register(block, key) == block
    manager.release_all(blocks)
    return blocks


# --- construction and accounting ---


@pytest.mark.parametrize(("args", "field"), [((0, 4), "num_blocks=0"), ((4, 0), "block_size=0"),
                                             ((-1, 4), "num_blocks=-1"), ((4, 2.5), "block_size=2.5")])
def test_constructor_rejects_bad_sizes(args, field):
    with pytest.raises(ValueError, match=field) as err:
        BlockManager(*args)
    assert "\n" not in str(err.value)


def test_allocate_release_accounting():
    m = BlockManager(5, BS)
    assert (m.free, m.used, m.num_blocks, m.block_size, m.prefix_caching) == (5, 0, 5, BS, True)
    blocks = [m.allocate() for _ in range(3)]
    assert len(set(blocks)) == 3 and all(m.refcount(b) == 1 and m.writable(b) for b in blocks)
    assert (m.free, m.used) == (2, 3)
    m.release(blocks[1])
    assert (m.free, m.used, m.refcount(blocks[1])) == (3, 2, 0)
    m.release_all([blocks[0], blocks[2]])
    assert (m.free, m.used) == (5, 0)
    m.check()


def test_allocate_many_all_or_nothing():
    m = BlockManager(4, BS)
    m.allocate()
    assert m.can_allocate(3) and not m.can_allocate(4)
    with pytest.raises(NoFreeBlocks):
        m.allocate_many(4)
    assert (m.free, m.used) == (3, 1)
    m.check()
    got = m.allocate_many(3)
    assert len(set(got)) == 3 and m.free == 0
    assert m.allocate_many(0) == []


def test_no_free_blocks():
    m = BlockManager(2, BS)
    m.allocate_many(2)
    assert not m.can_allocate(1)
    with pytest.raises(NoFreeBlocks):
        m.allocate()
    m.check()


def test_double_release_raises():
    m = BlockManager(2, BS)
    b = m.allocate()
    m.release(b)
    with pytest.raises(ValueError, match="double free"):
        m.release(b)
    assert m.refcount(b) == 0 and m.free == 2
    m.check()


def test_release_of_a_cached_unreferenced_block_raises():
    m = BlockManager(2, BS)
    [b] = cached(m, [1, 2, 3, 4])
    with pytest.raises(ValueError):
        m.release(b)
    m.check()


def test_bad_block_ids_raise():
    m = BlockManager(2, BS)
    for bad in (-1, 2, 7):
        with pytest.raises(ValueError, match="block="):
            m.refcount(bad)
        with pytest.raises(ValueError):
            m.release(bad)


# --- fork and copy-on-write ---


def test_fork_and_copy_on_write_of_a_shared_block():
    m = BlockManager(4, BS)
    b = m.allocate()
    assert m.fork(b) == b and m.refcount(b) == 2 and not m.writable(b)
    new, copied = m.copy_on_write(b)
    assert copied and new != b
    assert m.refcount(b) == 1 and m.refcount(new) == 1 and m.writable(b) and m.writable(new)
    assert m.copy_on_write(b) == (b, False)  # the other owner is now the sole one
    m.check()


def test_copy_on_write_of_a_sole_owner_keeps_the_block():
    m = BlockManager(2, BS)
    b = m.allocate()
    assert m.copy_on_write(b) == (b, False)
    assert (m.refcount(b), m.used) == (1, 1)


def test_copy_on_write_of_a_cached_block_copies_and_keeps_it_intact():
    m = BlockManager(2, BS)
    b = m.allocate()
    key = m.block_keys([5, 6, 7, 8])[0]
    m.register(b, key)
    assert not m.writable(b)
    new, copied = m.copy_on_write(b)
    assert copied and new != b and m.writable(new)
    # the old block is unreferenced but still cached (evictable, contents kept): a later prompt still matches it
    assert m.refcount(b) == 0 and m.key_of(b) == key and m.free == 1
    assert m.match([5, 6, 7, 8, 9]) == [b]
    m.check()


def test_copy_on_write_never_reuses_the_source_block():
    m = BlockManager(2, BS)
    b = m.allocate()
    m.fork(b)
    other = m.allocate()
    m.release(other)  # one block free: the allocation must take it, not b
    new, copied = m.copy_on_write(b)
    assert copied and new == other and m.refcount(b) == 1


def test_copy_on_write_without_room_changes_nothing():
    m = BlockManager(1, BS)
    b = m.allocate()
    m.fork(b)
    with pytest.raises(NoFreeBlocks):
        m.copy_on_write(b)
    assert m.refcount(b) == 2
    m.check()


def test_fork_of_a_free_block_raises():
    m = BlockManager(2, BS)
    with pytest.raises(ValueError):
        m.fork(0)
    m.check()


# --- block keys ---


def test_block_keys_hash_chain():
    m = BlockManager(2, 3)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks, a partial one ignored
    keys = m.block_keys(tokens)
    k0 = hashlib.sha256(struct.pack("<3q", 1, 2, 3)).digest()
    k1 = hashlib.sha256(k0 + struct.pack("<3q", 4, 5, 6)).digest()
    assert keys == [k0, k1]
    assert m.block_keys([1, 2]) == [] and m.block_keys([]) == []
    assert m.block_keys([4, 5, 6])[0] != k1  # a key depends on the blocks before it
    assert m.block_keys([2**40, -1, 0])[0] == hashlib.sha256(struct.pack("<3q", 2**40, -1, 0)).digest()


# --- match and register ---


def test_match_longest_prefix_stops_at_first_miss():
    m = BlockManager(8, BS)
    a = cached(m, list(range(12)))  # three blocks
    hit = m.match(list(range(8)) + [99, 9, 10, 11])  # the third block differs
    assert hit == a[:2] and all(m.refcount(b) == 1 for b in hit) and m.refcount(a[2]) == 0
    m.release_all(hit)
    assert m.match(list(range(12)) + [1, 2, 3, 4]) == a  # a fourth uncached block is simply not matched
    m.check()


def test_match_a_different_first_block_breaks_the_chain():
    m = BlockManager(8, BS)
    cached(m, [1, 2, 3, 4, 5, 6, 7, 8])
    assert m.match([9, 9, 9, 9, 5, 6, 7, 8]) == []  # same second block, different first: no match
    assert m.match([5, 6, 7, 8]) == []  # the second block alone is not the prefix it was cached under
    m.check()


def test_partial_last_block_never_matched():
    m = BlockManager(4, BS)
    a = cached(m, [1, 2, 3, 4, 5, 6, 7, 8])
    assert m.match([1, 2, 3, 4, 5, 6, 7]) == a[:1]  # the second block is only partly in the prompt
    assert m.match([1, 2, 3]) == []
    assert m.stats()["hit_tokens"] == BS


def test_match_limit():
    m = BlockManager(8, BS)
    a = cached(m, list(range(12)))
    assert m.match(list(range(12)), limit=2) == a[:2]
    assert m.refcount(a[2]) == 0
    assert m.match(list(range(12)), limit=0) == []
    assert m.match(list(range(12)), limit=10) == a
    with pytest.raises(ValueError, match="limit"):
        m.match([1], limit=-1)
    m.check()


def test_match_stats():
    m = BlockManager(8, BS)
    cached(m, list(range(8)))
    m.match(list(range(10)))  # 2 blocks hit
    m.match([7] * 6)  # a miss
    s = m.stats()
    assert (s["query_tokens"], s["hit_tokens"], s["evictions"], s["cached_blocks"]) == (16, 8, 0, 2)
    assert (s["free"], s["used"]) == (6, 2)


def test_match_revives_an_evictable_block():
    m = BlockManager(2, BS)
    [b] = cached(m, [1, 2, 3, 4])
    assert m.free == 2
    assert m.match([1, 2, 3, 4]) == [b]
    assert (m.refcount(b), m.free, m.used) == (1, 1, 1)
    other = m.allocate()  # from the free list, not b
    assert other != b
    with pytest.raises(NoFreeBlocks):
        m.allocate()  # b is referenced again: never evicted
    m.check()


def test_match_of_a_referenced_block_adds_a_reference():
    m = BlockManager(2, BS)
    b = m.allocate()
    m.register(b, m.block_keys([1, 2, 3, 4])[0])
    assert m.match([1, 2, 3, 4]) == [b] and m.refcount(b) == 2


def test_register_duplicate_key_returns_the_holder():
    m = BlockManager(4, BS)
    key = m.block_keys([1, 2, 3, 4])[0]
    a, b = m.allocate(), m.allocate()
    assert m.register(a, key) == a and m.key_of(a) == key
    assert m.register(b, key) == a
    assert m.key_of(b) is None and m.writable(b)  # b stays uncached
    assert m.register(a, key) == a  # registering again is harmless
    m.release(b)
    assert m.stats()["cached_blocks"] == 1 and m.free == 3
    m.check()


def test_register_needs_a_referenced_block_and_one_key():
    m = BlockManager(2, BS)
    k1, k2 = m.block_keys([1, 2, 3, 4, 5, 6, 7, 8])
    with pytest.raises(ValueError):
        m.register(0, k1)
    b = m.allocate()
    m.register(b, k1)
    with pytest.raises(ValueError, match="already cached"):
        m.register(b, k2)
    m.check()


def test_prefix_caching_off():
    m = BlockManager(4, BS, prefix_caching=False)
    b = m.allocate()
    key = m.block_keys([1, 2, 3, 4])[0]
    assert m.register(b, key) == b and m.key_of(b) is None and m.writable(b)
    m.release(b)
    assert m.match([1, 2, 3, 4, 5]) == []
    s = m.stats()
    assert (s["query_tokens"], s["hit_tokens"], s["cached_blocks"], s["free"]) == (5, 0, 0, 4)
    m.check()


# --- eviction ---


def test_free_list_before_eviction():
    m = BlockManager(3, BS)
    [c] = cached(m, [1, 2, 3, 4])
    assert m.free == 3
    got = m.allocate_many(2)
    assert c not in got and m.key_of(c) is not None and m.stats()["evictions"] == 0
    assert m.allocate() == c and m.key_of(c) is None and m.stats()["evictions"] == 1
    assert m.match([1, 2, 3, 4]) == []  # its key is gone
    m.check()


def test_lru_order_of_eviction():
    m = BlockManager(3, BS)
    prompts = [[1] * BS, [2] * BS, [3] * BS]
    blocks = m.allocate_many(3)
    for block, tokens in zip(blocks, prompts, strict=True):
        m.register(block, m.block_keys(tokens)[0])
    for i in (1, 2, 0):  # released in this order: 1 is the least recently used
        m.release(blocks[i])
    [revived] = m.match(prompts[1])  # ... but matching revives it, then it is released last
    m.release(revived)
    assert [m.allocate() for _ in range(3)] == [blocks[2], blocks[0], blocks[1]]
    assert m.stats()["evictions"] == 3 and m.stats()["cached_blocks"] == 0
    m.check()


def test_eviction_never_takes_a_referenced_block():
    m = BlockManager(3, BS)
    held = cached(m, [1] * BS + [2] * BS)  # two cached blocks, evictable
    m.match([1] * BS + [2] * BS)  # both referenced again
    free = m.allocate()
    assert free not in held
    with pytest.raises(NoFreeBlocks):
        m.allocate()
    assert all(m.refcount(b) == 1 and m.key_of(b) is not None for b in held)
    m.check()


# --- randomized ---


def test_randomized_operations_keep_the_invariants():
    rng = random.Random(0)
    m = BlockManager(12, 2)
    owned: list[int] = []  # one entry per reference this test holds
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 9))] for _ in range(20)]
    for _ in range(4000):
        op = rng.random()
        if op < 0.25:
            if m.can_allocate(1):
                owned.append(m.allocate())
            else:
                with pytest.raises(NoFreeBlocks):
                    m.allocate()
        elif op < 0.35:
            n = rng.randrange(4)
            before = m.free
            if n <= before:
                owned += m.allocate_many(n)
            else:
                with pytest.raises(NoFreeBlocks):
                    m.allocate_many(n)
                assert m.free == before
        elif op < 0.45 and owned:
            owned.append(m.fork(rng.choice(owned)))
        elif op < 0.7 and owned:
            m.release(owned.pop(rng.randrange(len(owned))))
        elif op < 0.8 and owned:
            i = rng.randrange(len(owned))
            if m.free or m.writable(owned[i]):
                new, copied = m.copy_on_write(owned[i])
                assert copied == (new != owned[i]) and m.writable(new)
                owned[i] = new
            else:
                with pytest.raises(NoFreeBlocks):
                    m.copy_on_write(owned[i])
        elif op < 0.9 and owned:
            block, tokens = rng.choice(owned), rng.choice(prompts)
            keys = m.block_keys(tokens)
            if keys and m.key_of(block) in (None, keys[-1]):
                held = m.register(block, keys[-1])
                assert m.key_of(held) == keys[-1]
        else:
            tokens = rng.choice(prompts)
            hit = m.match(tokens, limit=rng.choice([None, 1, 2]))
            assert len(hit) <= len(tokens) // m.block_size
            assert [m.key_of(b) for b in hit] == m.block_keys(tokens)[:len(hit)]
            owned += hit
        m.check()
        assert all(m.refcount(b) >= 0 for b in range(m.num_blocks))
        assert m.free + m.used == m.num_blocks
        assert sorted(owned) == sorted(b for b in range(m.num_blocks) for _ in range(m.refcount(b)))
    s = m.stats()
    assert s["hit_tokens"] > 0 and s["evictions"] > 0  # the run exercised the cache and eviction
    m.release_all(owned)
    assert (m.used, m.free) == (0, m.num_blocks)
    m.check()

"""BlockPool and the free-block queue: exact ids, LRU order, ref counts, integrity checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def fake_hashes(n: int, seed: int = 0) -> list[bytes]:
    """A chain of n block hashes (the token ids only need to be distinct per seed)."""
    hashes, parent = [], None
    for i in range(n):
        parent = hash_block_tokens(parent, [seed, i, 0, 0])
        hashes.append(parent)
    return hashes


def cached_request(pool: BlockPool, num_blocks: int, seed: int = 0):
    """Take num_blocks blocks and cache them all under a fresh hash chain."""
    request = SimpleNamespace(block_hashes=fake_hashes(num_blocks, seed))
    blocks = pool.get_new_blocks(num_blocks)
    pool.cache_full_blocks(request, blocks, 0, num_blocks)
    return request, blocks


# ------------------------------------------------------------------------- free queue


def test_free_queue_pop_remove_append():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])  # from the middle
    queue.append(blocks[0])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 3, 4, 0]
    assert [b.block_id for b in queue.popleft_n(2)] == [1, 3]
    assert queue.num_free_blocks == 2
    queue.check_links()


def test_free_queue_errors_leave_it_unchanged():
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError):
        queue.popleft_n(4)
    with pytest.raises(ValueError):
        queue.append(blocks[1])  # already in it
    removed = queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(removed)  # not in it
    assert [b.block_id for b in queue.get_all_free_blocks()] == [1, 2]
    queue.popleft_n(2)
    with pytest.raises(ValueError):
        queue.popleft()
    assert queue.get_all_free_blocks() == []
    queue.check_links()


def test_free_queue_append_n_keeps_order():
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue([])
    queue.append_n([blocks[3], blocks[1], blocks[2]])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [3, 1, 2]


# --------------------------------------------------------------------------- block pool


def test_initial_state():
    pool = BlockPool(6, enable_caching=True)
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]
    assert pool.get_num_free_blocks() == 6
    assert pool.get_usage() == 0.0
    pool.check_integrity()
    with pytest.raises(ValueError):
        BlockPool(0, enable_caching=True)


def test_get_new_blocks_in_lru_order_and_tail_first_freeing():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.get_usage() == pytest.approx(0.5)
    pool.free_blocks(reversed(blocks))  # a request's chain, tail first
    assert free_ids(pool) == [3, 4, 5, 2, 1, 0]
    assert [b.block_id for b in pool.get_new_blocks(4)] == [3, 4, 5, 2]
    pool.check_integrity()


def test_get_new_blocks_short_raises_and_changes_nothing():
    pool = BlockPool(4, enable_caching=True)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert free_ids(pool) == [2, 3]
    pool.check_integrity()


def test_cached_blocks_survive_free_until_evicted_lru():
    pool = BlockPool(4, enable_caching=True)
    req_a, blocks_a = cached_request(pool, 2, seed=1)  # blocks 0, 1
    req_b, blocks_b = cached_request(pool, 2, seed=2)  # blocks 2, 3
    pool.free_blocks(reversed(blocks_a))
    pool.free_blocks(reversed(blocks_b))
    assert free_ids(pool) == [1, 0, 3, 2]
    # Free but still cached: a hit is possible.
    assert pool.get_cached_block(req_a.block_hashes[0]) is blocks_a[0]
    assert pool.get_cached_block(req_b.block_hashes[1]) is blocks_b[1]
    # Taking blocks evicts the least recently freed first: a's tail, then a's head.
    taken = pool.get_new_blocks(2)
    assert [b.block_id for b in taken] == [1, 0]
    assert all(b.block_hash is None for b in taken)
    assert pool.get_cached_block(req_a.block_hashes[0]) is None
    assert pool.get_cached_block(req_a.block_hashes[1]) is None
    assert pool.get_cached_block(req_b.block_hashes[0]) is blocks_b[0]
    pool.check_integrity()


def test_touch_free_cached_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(5, enable_caching=True)
    req, blocks = cached_request(pool, 3)  # blocks 0, 1, 2
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 2, 1, 0]
    hit = pool.get_cached_block(req.block_hashes[1])
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert free_ids(pool) == [3, 4, 2, 0]
    assert pool.get_num_free_blocks() == 4
    # A touched block is not evicted by later allocations.
    assert [b.block_id for b in pool.get_new_blocks(4)] == [3, 4, 2, 0]
    assert pool.get_cached_block(req.block_hashes[1]) is hit
    # Touching a block in use only adds a reference.
    pool.touch([hit])
    assert hit.ref_cnt == 2
    pool.check_integrity()


def test_shared_block_freed_only_at_last_reference():
    pool = BlockPool(3, enable_caching=True)
    _, blocks = cached_request(pool, 1)
    pool.touch(blocks)
    pool.free_blocks(blocks)
    assert blocks[0].ref_cnt == 1 and free_ids(pool) == [1, 2]
    pool.free_blocks(blocks)
    assert free_ids(pool) == [1, 2, 0]
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks(blocks)


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(4, enable_caching=True)
    req, first = cached_request(pool, 2)
    second = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, second, 0, 2)  # same hashes, different blocks
    assert [b.block_hash for b in second] == [None, None]
    assert pool.get_cached_block(req.block_hashes[0]) is first[0]
    pool.free_blocks(reversed(second))
    pool.free_blocks(reversed(first))
    assert free_ids(pool) == [3, 2, 1, 0]
    pool.check_integrity()


def test_cache_full_blocks_handles_only_the_new_range():
    pool = BlockPool(4, enable_caching=True)
    req = SimpleNamespace(block_hashes=fake_hashes(3))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 1)
    assert [b.block_hash is not None for b in blocks] == [True, False, False]
    pool.cache_full_blocks(req, blocks, 1, 3)
    assert [b.block_hash for b in blocks] == req.block_hashes
    pool.check_integrity()


def test_caching_disabled_caches_nothing():
    pool = BlockPool(3, enable_caching=False)
    req = SimpleNamespace(block_hashes=fake_hashes(2))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    assert pool.get_cached_block(req.block_hashes[0]) is None
    assert all(b.block_hash is None for b in blocks)
    pool.check_integrity()


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(3, enable_caching=True)
    req, blocks = cached_request(pool, 2)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(req.block_hashes[0]) is None
    assert all(b.block_hash is None for b in pool.blocks)
    assert free_ids(pool) == [2, 1, 0]
    pool.check_integrity()


def test_uncache_blocks():
    pool = BlockPool(3, enable_caching=True)
    req, blocks = cached_request(pool, 2)
    pool.uncache_blocks(blocks[1:])
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    assert pool.get_cached_block(req.block_hashes[1]) is None
    pool.check_integrity()


# ------------------------------------------------------------- integrity catches corruption


def corrupt_negative_ref(pool: BlockPool) -> None:
    pool.blocks[2].ref_cnt = -1


def corrupt_in_use_block_in_free_queue(pool: BlockPool) -> None:
    pool.blocks[3].ref_cnt = 1


def corrupt_free_block_missing_from_queue(pool: BlockPool) -> None:
    pool.free_block_queue.remove(pool.blocks[3])


def corrupt_count(pool: BlockPool) -> None:
    pool.free_block_queue.num_free_blocks += 1


def corrupt_broken_prev_link(pool: BlockPool) -> None:
    pool.blocks[3].prev_free_block = pool.blocks[3]


def corrupt_cycle_lists_a_block_twice(pool: BlockPool) -> None:
    pool.blocks[4].next_free_block = pool.blocks[3]  # 2 -> 3 -> 4 -> 3 -> ...


def corrupt_hash_map_points_elsewhere(pool: BlockPool) -> None:
    block_hash = pool.blocks[0].block_hash
    pool.cached_block_hash_to_block[block_hash] = pool.blocks[1]


def corrupt_hash_without_map_entry(pool: BlockPool) -> None:
    pool.blocks[2].block_hash = b"x" * 32


def corrupt_map_entry_without_hash(pool: BlockPool) -> None:
    pool.blocks[1].block_hash = None


@pytest.mark.parametrize(
    "corrupt",
    [
        corrupt_negative_ref,
        corrupt_in_use_block_in_free_queue,
        corrupt_free_block_missing_from_queue,
        corrupt_count,
        corrupt_broken_prev_link,
        corrupt_cycle_lists_a_block_twice,
        corrupt_hash_map_points_elsewhere,
        corrupt_hash_without_map_entry,
        corrupt_map_entry_without_hash,
    ],
)
def test_check_integrity_catches(corrupt):
    pool = BlockPool(5, enable_caching=True)
    cached_request(pool, 2)  # blocks 0, 1 in use and cached; 2, 3, 4 free
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError):
        pool.check_integrity()

"""KVCacheManager.fork: beams share full blocks by reference count and copy the block they
diverge in (copy-on-write), on a toy cache (block_size 4, 10 blocks)."""

from __future__ import annotations

import pytest

from tests.core.test_kv_cache_manager import admit, decode, free_ids, make_manager, make_request


def fork(kv, parent, child_id):
    child = parent.fork(child_id)
    return child, kv.fork(parent, child)


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = make_manager()
    a = make_request("a", list(range(10)))  # blocks 0, 1 full; block 2 holds 2 tokens
    assert admit(kv, a) == [0, 1, 2]
    b, copies = fork(kv, a, "b")
    assert copies == [(2, 3)]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in kv.block_pool.blocks[:4]] == [2, 2, 1, 1]
    assert b.num_computed_tokens == 10 and b.block_hashes == a.block_hashes
    kv.check_integrity()
    # Each beam now writes its own token into its own third block.
    assert decode(kv, a, 50) == [] and decode(kv, b, 51) == []
    kv.check_integrity()


def test_fork_on_a_block_boundary_copies_nothing():
    kv = make_manager()
    a = make_request("a", list(range(8)))
    admit(kv, a)
    b, copies = fork(kv, a, "b")
    assert copies == []
    assert kv.get_block_ids("b") == [0, 1]
    # The next token opens a new block for each beam: still no copy.
    assert decode(kv, a, 50) == [2]
    assert decode(kv, b, 51) == [3]
    assert [blk.ref_cnt for blk in kv.block_pool.blocks[:4]] == [2, 2, 1, 1]
    kv.check_integrity()


def test_freeing_beams_releases_shared_blocks_last():
    kv = make_manager()
    a = make_request("a", list(range(10)))
    admit(kv, a)
    b, _ = fork(kv, a, "b")
    c, _ = fork(kv, b, "c")  # a fork of a fork shares the same full blocks
    assert [blk.ref_cnt for blk in kv.block_pool.blocks[:5]] == [3, 3, 1, 1, 1]
    kv.free(b)
    assert [blk.ref_cnt for blk in kv.block_pool.blocks[:5]] == [2, 2, 1, 0, 1]
    assert free_ids(kv)[-1] == 3
    kv.free(a)
    kv.free(c)
    kv.check_integrity()
    assert kv.num_free_blocks == 10
    # The shared prefix stays cached for later requests.
    assert kv.block_pool.blocks[0].block_hash == a.block_hashes[0]


def test_fork_without_a_free_block_changes_nothing():
    kv = make_manager(num_blocks=3)
    a = make_request("a", list(range(10)))
    admit(kv, a)
    b, copies = fork(kv, a, "b")
    assert copies is None
    assert kv.get_block_ids("b") == []
    assert [blk.ref_cnt for blk in kv.block_pool.blocks] == [1, 1, 1]
    kv.check_integrity()


def test_fork_rejects_a_parent_without_blocks():
    kv = make_manager()
    a = make_request("a", list(range(10)))
    with pytest.raises(ValueError):
        kv.fork(a, a.fork("b"))

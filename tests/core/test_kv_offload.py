"""The offload tiers (host, then disk): exact slots, LRU order, pinning and moves; and the
KV cache manager storing evicted blocks there and loading a prefix back from them."""

from __future__ import annotations

import pytest

from tests.core.test_kv_cache_manager import admit, make_request
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_offload import KVOffloadManager, OffloadTier

H = [bytes([i]) * 32 for i in range(10)]  # block hashes


def test_tier_lru_and_pinning():
    tier = OffloadTier("host", 2)
    assert tier.put(H[0]) == (0, None)
    assert tier.put(H[1]) == (1, None)
    tier.pinned.clear()
    tier.get(H[0])  # H[1] is now the least recently used
    assert tier.put(H[2]) == (1, (H[1], 1))
    assert tier.put(H[3]) == (0, (H[0], 0))  # slot 1 is pinned this step
    assert tier.put(H[4]) is None  # both pinned
    tier.check_integrity()
    tier.clear()
    assert len(tier) == 0 and tier.num_evictable() == 2


def test_store_demotes_to_disk_and_lookup_stops_at_a_miss():
    off = KVOffloadManager(host_slots=2, disk_slots=2)
    off.store(H[0], block_id=7)
    off.store(H[1], block_id=8)
    assert off.take_transfers().device_to_host == [(7, 0), (8, 1)]
    off.begin_step()
    off.store(H[2], block_id=9)  # evicts H[0] (LRU) to disk
    t = off.take_transfers()
    assert t.device_to_host == [(9, 0)]
    assert t.host_to_disk == [(0, 0)]
    assert H[0] in off.disk and H[0] not in off.host
    assert off.lookup([H[1], H[2], H[5], H[2]]) == [H[1], H[2]]  # stops at the miss
    # H[0] must come up through a host slot: none is free while H[2]'s slot is pinned
    # (written this step) and H[1]'s is needed for its own load.
    assert off.lookup([H[1], H[0]]) == [H[1]]
    off.begin_step()
    assert off.lookup([H[1], H[0]]) == [H[1], H[0]]
    assert off.lookup([H[1], H[0]], limit=1) == [H[1]]
    off.check_integrity()


def test_reserve_loads_brings_disk_entries_up_through_the_host():
    off = KVOffloadManager(host_slots=2, disk_slots=2)
    for i, h in enumerate(H[:3]):
        off.store(h, block_id=i)
        off.begin_step()
    off.take_transfers()
    # host: H[1] (slot 1), H[2] (slot 0); disk: H[0] (slot 0)
    assert off.lookup([H[0], H[1]]) == [H[0], H[1]]
    slots = off.reserve_loads([H[0], H[1]], block_size=4)
    off.add_loads(slots, [20, 21])
    t = off.take_transfers()
    # H[1] is pinned first, so H[0] takes H[2]'s host slot, H[2] moving to disk before.
    assert t.host_to_disk == [(0, 1)]
    assert t.disk_to_host == [(0, 0)]
    assert t.host_to_device == [(0, 20), (1, 21)]
    assert off.take_hit_tokens() == {"host": 4, "disk": 4}
    off.check_integrity()


@pytest.fixture
def kv():
    return KVCacheManager(
        num_blocks=4, block_size=4, max_model_len=40, offload=KVOffloadManager(host_slots=8)
    )


def test_evicted_prefix_is_stored_and_loaded_back(kv):
    a = make_request("a", list(range(12)))  # 3 blocks, 2 full ones cached on admission
    admit(kv, a)
    a.num_computed_tokens = 12
    kv.free(a)
    kv.begin_step()
    b = make_request("b", list(range(100, 116)))  # takes all 4 blocks: evicts a's cache
    assert admit(kv, b) is not None
    t = kv.offload.take_transfers()
    assert sorted(slot for _, slot in t.device_to_host) == [0, 1, 2]
    b.num_computed_tokens = 16
    kv.free(b)
    kv.begin_step()
    # a again: its first two blocks come back from the host tier, not from the device.
    a2 = make_request("a2", list(range(12)))
    hits, num_hit_tokens = kv.get_computed_blocks(a2)
    assert hits == [] and num_hit_tokens == 8
    block_ids = kv.allocate_slots(a2, 4, num_hit_tokens, hits)
    assert block_ids is not None and len(block_ids) == 3
    t = kv.offload.take_transfers()
    assert [dst for _, dst in t.host_to_device] == block_ids[:2]
    kv.check_integrity()


def test_reset_prefix_cache_forgets_the_tiers(kv):
    a = make_request("a", list(range(12)))
    admit(kv, a)
    a.num_computed_tokens = 12
    kv.free(a)
    admit(kv, make_request("b", list(range(100, 116))))
    assert len(kv.offload.host) > 0
    kv.free(kv_request := make_request("b", []))  # (no blocks: ignored)
    del kv_request
    for req_id in list(kv.req_to_blocks):
        kv.free(make_request(req_id, list(range(100, 116))))
    assert kv.reset_prefix_cache()
    assert len(kv.offload.host) == 0


def test_offload_needs_prefix_caching():
    with pytest.raises(ValueError):
        KVCacheManager(4, 4, 40, enable_caching=False, offload=KVOffloadManager(2))

"""KVCacheManager on a toy cache (block_size 4, 10 blocks): exact block ids, ref counts,
prefix hits and eviction order."""

from __future__ import annotations

import pytest

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 10


def make_manager(enable_caching: bool = True, num_blocks: int = NUM_BLOCKS) -> KVCacheManager:
    return KVCacheManager(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_model_len=40,
        enable_caching=enable_caching,
    )


def make_request(req_id: str, prompt: list[int], cache_salt: str | None = None) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=8), cache_salt=cache_salt)


def admit(kv: KVCacheManager, request: Request) -> list[int] | None:
    """Look up the prefix cache and allocate the whole rest of the prompt, as a step would."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit_tokens
    block_ids = kv.allocate_slots(request, num_new, num_hit_tokens, hits)
    if block_ids is not None:
        request.num_computed_tokens = num_hit_tokens + num_new
    return block_ids


def decode(kv: KVCacheManager, request: Request, token: int) -> list[int] | None:
    """Append a sampled token and allocate its slot, as the next step would."""
    request.append_output_token_ids([token])
    block_ids = kv.allocate_slots(request, 1)
    if block_ids is not None:
        request.num_computed_tokens += 1
    return block_ids


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def ref_counts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.block_pool.blocks]


def test_allocate_exact_block_ids():
    kv = make_manager()
    a = make_request("a", list(range(10)))
    assert admit(kv, a) == [0, 1, 2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 7
    assert kv.usage == pytest.approx(0.3)
    blocks = kv.req_to_blocks["a"]
    # Only full blocks are cached; the partly filled third is not.
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    assert [b.block_hash for b in blocks[:2]] == a.block_hashes
    b = make_request("b", list(range(100, 105)))
    assert admit(kv, b) == [3, 4]
    kv.check_integrity()


def test_growth_one_block_at_a_time():
    kv = make_manager()
    a = make_request("a", list(range(10)))
    admit(kv, a)
    assert decode(kv, a, 50) == []  # 11 tokens in 3 blocks
    assert kv.req_to_blocks["a"][2].block_hash is None
    assert decode(kv, a, 51) == []  # 12 tokens: block 2 is now full ...
    assert kv.req_to_blocks["a"][2].block_hash == a.block_hashes[2]  # ... and cached
    assert decode(kv, a, 52) == [3]  # 13th token opens block 3
    assert decode(kv, a, 53) == []
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    kv.check_integrity()


def test_chunked_allocation_caches_only_scheduled_full_blocks():
    kv = make_manager()
    a = make_request("a", list(range(14)))
    assert kv.allocate_slots(a, 6) == [0, 1]
    assert [b.block_hash is not None for b in kv.req_to_blocks["a"]] == [True, False]
    a.num_computed_tokens = 6
    assert kv.allocate_slots(a, 6) == [2]
    assert [b.block_hash is not None for b in kv.req_to_blocks["a"]] == [True, True, True]
    kv.check_integrity()


def test_prefix_hit_full_blocks_only_and_shared_ref_counts():
    kv = make_manager()
    a = make_request("a", list(range(10)))
    admit(kv, a)  # blocks 0, 1, 2
    b = make_request("b", list(range(9)) + [77, 78])  # shares 9 tokens: 2 full blocks
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1]
    assert num_hit_tokens == 8
    assert kv.allocate_slots(b, b.num_tokens - 8, 8, hits) == [0, 1, 3]
    b.num_computed_tokens = b.num_tokens
    assert ref_counts(kv)[:4] == [2, 2, 1, 1]
    kv.free(a)
    assert ref_counts(kv)[:4] == [1, 1, 0, 1]
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 2]  # only a's private block was freed
    kv.free(b)
    assert ref_counts(kv) == [0] * NUM_BLOCKS
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    kv.check_integrity()


def test_no_hits_for_a_request_that_wants_prompt_logprobs():
    # Every prompt position needs its logits: cached KV would leave them uncomputed.
    kv = make_manager()
    admit(kv, make_request("a", list(range(10))))
    b = Request("b", list(range(10)), SamplingParams(max_tokens=8, prompt_logprobs=0))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert admit(kv, b) == [3, 4, 5]
    c = make_request("c", list(range(10)))  # b's blocks are cached for later requests
    assert [h.block_id for h in kv.get_computed_blocks(c)[0]] == [0, 1]
    kv.check_integrity()


def test_never_hit_the_last_token():
    kv = make_manager()
    a = make_request("a", list(range(8)))  # exactly 2 full blocks
    admit(kv, a)
    same = make_request("same", list(range(8)))
    hits, num_hit_tokens = kv.get_computed_blocks(same)
    # At most 7 of 8 tokens may hit: the last one is recomputed for its logits.
    assert [h.block_id for h in hits] == [0]
    assert num_hit_tokens == 4
    assert kv.allocate_slots(same, 4, 4, hits) == [0, 2]
    same.num_computed_tokens = 8
    # Block 2 holds the same tokens as block 1; block 1 stays the cached one.
    assert kv.req_to_blocks["same"][1].block_hash is None
    longer = make_request("longer", list(range(9)))
    hits, num_hit_tokens = kv.get_computed_blocks(longer)
    assert [h.block_id for h in hits] == [0, 1]
    assert num_hit_tokens == 8
    kv.check_integrity()


def test_evicts_cached_blocks_lru_tail_first():
    kv = make_manager()
    a = make_request("a", list(range(8)))
    b = make_request("b", list(range(100, 108)))
    assert admit(kv, a) == [0, 1]
    assert admit(kv, b) == [2, 3]
    kv.free(a)
    kv.free(b)
    assert free_ids(kv) == [4, 5, 6, 7, 8, 9, 1, 0, 3, 2]
    # 7 new blocks: the 6 never-used ones, then a's tail block (evicted).
    c = make_request("c", list(range(200, 228)))
    assert admit(kv, c) == [4, 5, 6, 7, 8, 9, 1]
    again = make_request("again", list(range(9)))
    hits, _ = kv.get_computed_blocks(again)
    assert [h.block_id for h in hits] == [0]  # a's first block survived, its second did not
    b_again = make_request("b_again", list(range(100, 109)))
    hits, _ = kv.get_computed_blocks(b_again)
    assert [h.block_id for h in hits] == [2, 3]
    kv.check_integrity()


def test_cache_salt_separates_requests():
    kv = make_manager()
    prompt = list(range(9))
    admit(kv, make_request("a", prompt, cache_salt="alice"))
    for req_id, salt, expected in [
        ("b", "bob", []),
        ("c", None, []),
        ("d", "alice", [0, 1]),
    ]:
        hits, _ = kv.get_computed_blocks(make_request(req_id, prompt, cache_salt=salt))
        assert [h.block_id for h in hits] == expected, salt
    unsalted = make_request("e", prompt)
    salted = make_request("f", prompt, cache_salt="alice")
    kv.get_computed_blocks(unsalted)
    kv.get_computed_blocks(salted)
    # The salt changes the first hash and, through the chain, every later one.
    assert all(x != y for x, y in zip(unsalted.block_hashes, salted.block_hashes, strict=True))


def test_prefix_cache_counters():
    kv = make_manager()
    admit(kv, make_request("a", list(range(10))))
    admit(kv, make_request("b", list(range(9)) + [99]))
    stats = kv.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    stats = kv.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)
    quiet = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, 40, log_stats=False)
    admit(quiet, make_request("a", list(range(10))))
    assert quiet.make_prefix_cache_stats().queries == 0


def snapshot(kv: KVCacheManager):
    return (
        free_ids(kv),
        ref_counts(kv),
        [b.block_hash for b in kv.block_pool.blocks],
        {k: list(v) for k, v in kv.req_to_blocks.items()},
    )


def test_allocation_failure_counts_free_hits_and_changes_nothing():
    kv = make_manager()
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)  # blocks 0, 1: free but cached, at the tail
    filler = make_request("filler", list(range(100, 128)))
    assert admit(kv, filler) == [2, 3, 4, 5, 6, 7, 8]
    assert free_ids(kv) == [9, 1, 0]
    # Hitting free blocks 0 and 1 takes them from the pool: 2 hits + 2 new > 3 free.
    too_big = make_request("too_big", list(range(8)) + list(range(300, 308)))
    before = snapshot(kv)
    assert admit(kv, too_big) is None
    assert snapshot(kv) == before
    assert too_big.num_computed_tokens == 0
    kv.check_integrity()
    # 2 hits + 1 new block == 3 free: fits exactly.
    fits = make_request("fits", list(range(8)) + [300, 301, 302, 303])
    assert admit(kv, fits) == [0, 1, 9]
    assert kv.num_free_blocks == 0
    kv.check_integrity()


def test_decode_failure_changes_nothing():
    kv = make_manager(num_blocks=2)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    before = snapshot(kv)
    assert decode(kv, a, 1) is None
    assert snapshot(kv) == before
    kv.check_integrity()


def test_caching_disabled():
    kv = make_manager(enable_caching=False)
    a = make_request("a", list(range(10)))
    assert admit(kv, a) == [0, 1, 2]
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    kv.free(a)
    b = make_request("b", list(range(10)))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert admit(kv, b) == [3, 4, 5]
    assert kv.make_prefix_cache_stats().queries == 0
    kv.check_integrity()


def test_free_uncaches_blocks_whose_kv_was_never_computed():
    kv = make_manager()
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 4)
    a.num_computed_tokens = 4  # one block computed
    kv.allocate_slots(a, 8)  # two more scheduled (and cached), then a is preempted
    kv.free(a)
    cached = [kv.block_pool.get_cached_block(h) for h in a.block_hashes]
    assert [b.block_id if b else None for b in cached] == [0, None, None]
    kv.check_integrity()


def test_allocate_slots_rejects_bad_arguments():
    kv = make_manager()
    a = make_request("a", list(range(10)))
    with pytest.raises(ValueError):
        kv.allocate_slots(a, -1)
    with pytest.raises(ValueError):
        kv.allocate_slots(a, 41)  # more than max_model_len
    admit(kv, a)
    b = make_request("b", list(range(10)))
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    with pytest.raises(ValueError):
        kv.allocate_slots(b, 2, num_hit_tokens - 1, hits)  # hits do not match blocks
    kv.allocate_slots(b, 2, num_hit_tokens, hits)
    with pytest.raises(ValueError):
        kv.allocate_slots(b, 1, num_hit_tokens, hits)  # hits for a request with blocks
    kv.check_integrity()


def test_reset_prefix_cache():
    kv = make_manager()
    a = make_request("a", list(range(9)))
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_check_integrity_catches_block_table_errors():
    kv = make_manager()
    a = make_request("a", list(range(6)))
    admit(kv, a)
    kv.check_integrity()
    kv.req_to_blocks["a"].append(kv.block_pool.blocks[5])  # one block too many
    with pytest.raises(AssertionError):
        kv.check_integrity()
    kv.req_to_blocks["a"].pop()
    kv.req_to_num_allocated_tokens["a"] = 4  # table too long for its tokens
    with pytest.raises(AssertionError):
        kv.check_integrity()
    kv.req_to_num_allocated_tokens["a"] = 6
    kv.block_pool.blocks[0].ref_cnt += 1  # a reference nobody holds
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_free_unknown_request_is_ignored():
    kv = make_manager()
    kv.free(make_request("ghost", [1, 2, 3]))
    assert kv.num_free_blocks == NUM_BLOCKS
    assert kv.get_block_ids("ghost") == []


def test_reads_step_kv_marks_hits_on_blocks_filled_in_the_same_step():
    kv = make_manager()
    kv.begin_step()
    a = make_request("a", list(range(10)))
    admit(kv, a)  # fills blocks 0 and 1 in this step
    b = make_request("b", list(range(9)))
    assert not kv.reads_step_kv
    admit(kv, b)  # hits them before they are written
    assert kv.reads_step_kv
    kv.begin_step()
    assert not kv.reads_step_kv
    c = make_request("c", list(range(9)))
    admit(kv, c)  # the same hits, now on blocks an earlier step wrote
    assert not kv.reads_step_kv
    kv.check_integrity()

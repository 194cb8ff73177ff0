"""Scheduler: preemption by recompute (victim choice, undoing the victim's step, resuming)."""

from __future__ import annotations

from tests.core.test_scheduler import (
    FakeWorker,
    make_request,
    make_scheduler,
    run_to_finish,
    step,
    worker_for,
)
from tokenmill.core.request import RequestStatus
from tokenmill.core.scheduler import Scheduler

# ------------------------------------------------------------------------- preemption


def test_preemption_fcfs_preempts_the_newest_and_resumes_it_in_full():
    sched = make_scheduler(budget=32, num_blocks=4, caching=False)
    worker = worker_for(sched)
    sched.add_request(make_request("a", 8, max_tokens=4, first_token=0))
    sched.add_request(make_request("b", 6, max_tokens=4, first_token=100))
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 8, "b": 6}
    assert sched.kv_cache_manager.get_block_ids("a") == [0, 1]
    assert sched.kv_cache_manager.get_block_ids("b") == [2, 3]
    b = sched.requests["b"]
    # a's 9th token needs a third block: none is free, so b (the newest) is preempted.
    so, out = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.scheduled_cached_reqs.new_block_ids == [[3]]  # b's tail block, freed first
    assert so.finished_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert list(sched.waiting) == [b]
    assert out.scheduler_stats.num_preemptions == 1
    b_output = list(b.output_token_ids)
    assert len(b_output) == 1
    for _ in range(2):  # a decodes; b does not fit back yet (needs 2 blocks, 1 free)
        so, _ = step(sched, worker)
        assert so.num_scheduled_tokens == {"a": 1}
    # a is done and freed; b comes back in full and recomputes prompt + output.
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"b": 7}
    [new] = so.scheduled_new_reqs
    assert new.req_id == "b" and new.output_token_ids == b_output
    assert new.num_computed_tokens == 0
    assert so.finished_req_ids == {"a"}
    tokens, _ = run_to_finish(sched, worker)
    assert len(b.output_token_ids) == 4
    assert sched.kv_cache_manager.num_free_blocks == 4


def test_preempted_request_goes_first_once_it_fits():
    sched = make_scheduler(budget=32, max_num_seqs=2, num_blocks=3, caching=False, max_model_len=12)
    worker = worker_for(sched)
    sched.add_request(make_request("a", 4, max_tokens=8, first_token=0))
    sched.add_request(make_request("b", 8, max_tokens=8, first_token=100))
    sched.add_request(make_request("c", 2, max_tokens=1, first_token=200))
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 4, "b": 8}  # c waits: max_num_seqs
    # a needs a second block: b is preempted and goes back ahead of c.
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.finished_req_ids == {"b"}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    scheduled = []
    while sched.has_unfinished_requests():
        scheduled.append(step(sched, worker)[0].num_scheduled_tokens)
    # a runs alone to its 8th token (b does not fit back, and c queues behind b) ...
    assert scheduled[:6] == [{"a": 1}] * 6
    # ... then b recomputes its prompt and first token, and c runs once b is done.
    assert scheduled[6] == {"b": 9}
    assert scheduled[7:] == [{"b": 1}] * 2 + [{"c": 2}]  # b stops at max_model_len
    assert sched.kv_cache_manager.num_free_blocks == 3


def _priority_setup(policy: str) -> tuple[Scheduler, FakeWorker]:
    """x (low priority, admitted first) then y (high priority); the next step y needs a
    block while x, scheduled before it in the same step, does not."""
    sched = make_scheduler(budget=32, num_blocks=4, policy=policy, caching=False)
    worker = worker_for(sched)
    sched.add_request(make_request("x", 5, priority=5, arrival_time=0.0, first_token=0))
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"x": 5}
    sched.add_request(make_request("y", 8, priority=0, arrival_time=1.0, first_token=100))
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"x": 1, "y": 8}
    assert sched.kv_cache_manager.get_block_ids("x") == [0, 1]
    assert sched.kv_cache_manager.get_block_ids("y") == [2, 3]
    return sched, worker


def test_preemption_priority_undoes_the_victims_step():
    sched, worker = _priority_setup("priority")
    x = sched.requests["x"]
    so, _ = step(sched, worker)
    # x was scheduled first, then preempted for y: its part of the step is undone.
    assert so.num_scheduled_tokens == {"y": 1}
    assert so.total_num_scheduled_tokens == 1
    assert so.scheduled_cached_reqs.req_ids == ["y"]
    assert so.scheduled_cached_reqs.new_block_ids == [[1]]  # x's tail block, freed first
    assert so.finished_req_ids == {"x"}
    assert x.status == RequestStatus.PREEMPTED and x.num_computed_tokens == 0
    assert [r.request_id for r in sched.running] == ["y"]


def test_preemption_fcfs_same_setup_preempts_the_newest():
    sched, worker = _priority_setup("fcfs")
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"x": 1}
    assert so.finished_req_ids == {"y"}
    assert sched.requests["y"].status == RequestStatus.PREEMPTED


def test_undone_victim_leaves_no_uncomputed_block_in_the_prefix_cache():
    sched = make_scheduler(budget=32, block_size=2, num_blocks=7, policy="priority", threshold=3)
    worker = worker_for(sched)
    sched.add_request(make_request("x", 10, priority=5, arrival_time=0.0, first_token=0))
    step(sched, worker)  # x: 3 tokens in blocks 0, 1
    sched.add_request(make_request("y", 5, max_tokens=2, arrival_time=1.0, first_token=100))
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"x": 3, "y": 3}
    x = sched.requests["x"]
    # x's next chunk takes blocks 5, 6 (block 5 fills up and is cached at allocation);
    # then y finds no block, x is the victim and its part of the step is undone.
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"y": 2}
    assert so.scheduled_cached_reqs.new_block_ids == [[6]]
    assert so.finished_req_ids == {"x"}
    # Block 5 never got its KV: it must not be found by x (or anyone) later.
    assert sched.kv_cache_manager.block_pool.get_cached_block(x.block_hashes[3]) is None
    assert sched.kv_cache_manager.block_pool.get_cached_block(x.block_hashes[2]) is not None
    resumed = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, worker)  # the worker checks every KV slot x reads
        resumed += [n.num_computed_tokens for n in so.scheduled_new_reqs if n.req_id == "x"]
    assert resumed == [6]


def test_resumed_request_hits_its_own_cached_blocks():
    sched = make_scheduler(budget=32, num_blocks=5)
    worker = worker_for(sched)
    sched.add_request(make_request("a", 8, max_tokens=2, first_token=0))
    sched.add_request(make_request("b", 8, max_tokens=5, first_token=100))
    step(sched, worker)
    so, _ = step(sched, worker)  # a takes the last block; b preempts itself; a finishes
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.finished_req_ids == {"b"}
    so, _ = step(sched, worker)
    [new] = so.scheduled_new_reqs
    assert new.req_id == "b"
    assert new.block_ids == [2, 3, 4]  # its two cached prompt blocks + a new one
    assert new.num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"b": 1}
    assert sched.requests["b"].num_cached_tokens == 0  # set once, at first schedule
    run_to_finish(sched, worker)

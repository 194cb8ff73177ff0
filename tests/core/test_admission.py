"""Admission headroom: a KV-bound load waits for room instead of preempting."""

from __future__ import annotations

import math

from tests.core.test_scheduler import (
    make_request,
    make_scheduler,
    run_to_finish,
    step,
    worker_for,
)
from tokenmill.core.admission import MAX_RATIO, PREEMPTION_RATIO_STEP, AdmissionHeadroom
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams


def _overcommitting_pair(headroom: bool):
    # a (8 + 4 tokens) and b (6 + 4) fit by prompt (4 blocks of 4) but not when grown.
    sched = make_scheduler(budget=32, num_blocks=4, caching=False, headroom=headroom)
    worker = worker_for(sched)
    sched.add_request(make_request("a", 8, max_tokens=4, first_token=0))
    sched.add_request(make_request("b", 6, max_tokens=4, first_token=100))
    return sched, worker


def test_headroom_defers_admission_instead_of_preempting():
    sched, worker = _overcommitting_pair(headroom=True)
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 8}  # b would need a's growth blocks
    preemptions = 0
    for _ in range(20):
        so, out = step(sched, worker)
        preemptions += out.scheduler_stats.num_preemptions
        if not sched.has_unfinished_requests():
            break
    assert preemptions == 0
    assert sched.kv_cache_manager.num_free_blocks == 4


def test_without_headroom_the_same_load_preempts():
    sched, worker = _overcommitting_pair(headroom=False)
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 8, "b": 6}
    _, out = step(sched, worker)
    assert out.scheduler_stats.num_preemptions == 1


def test_lone_request_is_admitted_even_when_its_growth_does_not_fit():
    sched = make_scheduler(budget=32, num_blocks=3, max_model_len=64, headroom=True)
    worker = worker_for(sched)
    sched.add_request(make_request("a", 8, max_tokens=None))
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 8}
    run_to_finish(sched, worker)
    assert sched.kv_cache_manager.num_free_blocks == 3


def _finished(prompt_len: int, max_tokens: int, outputs: int) -> Request:
    request = Request("r", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), 0.0)
    request.append_output_token_ids(list(range(outputs)))
    return request


def test_ratio_learns_budget_use_and_rises_after_preemption():
    headroom = AdmissionHeadroom(block_size=16, max_context_len=4096)
    assert headroom.ratio == MAX_RATIO
    for _ in range(200):  # requests that stop after a tenth of their max_tokens
        headroom.on_finished(_finished(10, 1000, 100))
    assert 0.09 < headroom.ratio < 0.15
    low = headroom.ratio
    headroom.on_preempted()
    assert headroom.ratio == low + PREEMPTION_RATIO_STEP
    # The expected growth follows the ratio: prompt tokens not yet computed count in full.
    running = _finished(40, 1000, 0)
    running.num_computed_tokens = 8
    expected = (32 + math.ceil(headroom.ratio * 1000)) // 16
    assert headroom.growth_blocks(running) == expected

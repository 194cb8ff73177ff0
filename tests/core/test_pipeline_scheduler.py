"""Pipeline micro-batches: requests spread over the stages' micro-batches, a request that
samples waits for its token, prompt chunks follow each other, the stages that do not sample
get the new tokens in the step's plan."""

from __future__ import annotations

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.pipeline_scheduler import PipelineScheduler
from tokenmill.core.request import Request
from tokenmill.core.step_plan import StepPlan
from tokenmill.sampling_params import SamplingParams


def _scheduler(max_tokens: int = 64) -> PipelineScheduler:
    return PipelineScheduler(
        SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=8, max_model_len=128),
        CacheConfig(block_size=4, enable_prefix_caching=False),
        num_blocks=64,
        log_stats=False,
    )


def _add(scheduler, req_id: str, prompt_len: int, max_tokens: int = 4) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    scheduler.add_request(Request(req_id, list(range(1, prompt_len + 1)), params))


def _sample(so, token: int = 7) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(ids, [[token] for _ in ids])


def test_requests_spread_over_two_micro_batches():
    s = _scheduler()
    for i in range(4):
        _add(s, f"r{i}", 5)
    first = s.schedule(num_free_slots=2)
    second = s.schedule(num_free_slots=1)
    assert list(first.num_scheduled_tokens) == ["r0", "r1"]
    assert list(second.num_scheduled_tokens) == ["r2", "r3"]
    # Every request's step samples: nothing more is ready until a micro-batch returns.
    assert s.schedule(num_free_slots=1).total_num_scheduled_tokens == 0
    s.update_from_output(first, _sample(first, 11))
    third = s.schedule(num_free_slots=1)
    assert third.num_scheduled_tokens == {"r0": 1, "r1": 1}
    # The stages before the last never sampled token 11: the plan carries it.
    assert third.new_token_ids == {"r0": [11], "r1": [11]}
    assert s.in_flight == {"r2": 1, "r3": 1, "r0": 1, "r1": 1}


def test_prompt_chunks_follow_each_other_in_flight():
    s = _scheduler(max_tokens=16)
    _add(s, "long", 40)
    chunks = [s.schedule(num_free_slots=2 - i) for i in range(2)]
    assert [c.num_scheduled_tokens["long"] for c in chunks] == [16, 16]
    assert s.in_flight == {"long": 2}
    assert all(not c.new_token_ids for c in chunks)  # prompt tokens: the stages have them
    for c in chunks:
        s.update_from_output(c, ModelRunnerOutput(["long"], [[]]))
    last = s.schedule(num_free_slots=2)
    assert last.num_scheduled_tokens == {"long": 8}
    s.update_from_output(last, _sample(last, 5))
    decode = s.schedule(num_free_slots=2)
    assert decode.new_token_ids == {"long": [5]}
    assert s.in_flight == {"long": 1}


def test_preempted_request_waits_for_its_step_in_flight():
    s = _scheduler()
    _add(s, "a", 5)
    step = s.schedule(num_free_slots=2)
    request = s.requests["a"]
    s._preempt(request, StepPlan(token_budget=64))
    assert s.schedule(num_free_slots=1).total_num_scheduled_tokens == 0  # still in flight
    s.update_from_output(step, _sample(step))  # its stale token is dropped
    assert request.num_output_tokens == 0
    again = s.schedule(num_free_slots=2)
    assert again.num_scheduled_tokens == {"a": 5}

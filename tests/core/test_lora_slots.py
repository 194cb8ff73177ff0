"""Admission under LoRA slots (``core/lora_slots.py``) and the adapter in prefix-cache keys:
never more distinct adapters running than ``max_loras``, the requests of other adapters wait
in order and all finish, and two adapters never share KV blocks."""

from __future__ import annotations

from tests.core.test_scheduler import VOCAB_SIZE, make_scheduler, step, worker_for
from tokenmill.core.request import Request
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams


def lora_request(req_id: str, lora_id: int, prompt_len: int = 6, max_tokens: int = 3,
                 first_token: int = 0) -> Request:
    prompt = [(first_token + i) % VOCAB_SIZE for i in range(prompt_len)]
    lora = LoRARequest(f"adapter{lora_id}", lora_id, "/adapters") if lora_id else None
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), lora_request=lora)


def test_one_slot_two_adapters_all_finish_in_order():
    sched = make_scheduler(budget=64, max_num_seqs=8)
    sched.max_loras = 1
    worker = worker_for(sched)
    for req_id, lora_id in [("a1", 1), ("b1", 2), ("a2", 1), ("base", 0), ("b2", 2)]:
        sched.add_request(lora_request(req_id, lora_id))
    first_step: dict[str, int] = {}
    finished: set[str] = set()
    for i in range(50):
        if not sched.has_unfinished_requests():
            break
        so, out = step(sched, worker)
        running = {r.lora_int_id for r in sched.running if r.lora_int_id}
        stepped = {sched.requests[r].lora_int_id for r in so.num_scheduled_tokens
                   if r in sched.requests and sched.requests[r].lora_int_id}
        assert len(running) <= 1 and len(stepped) <= 1
        for req_id in so.num_scheduled_tokens:
            first_step.setdefault(req_id, i)
        finished |= {o.request_id for o in out.outputs if o.finish_reason is not None}
    assert finished == {"a1", "b1", "a2", "base", "b2"}
    # The base request does not wait for slots; adapter requests keep their order, so b1
    # (blocked first) runs before a2, which came after it.
    assert first_step["base"] == 0
    assert first_step["a1"] < first_step["b1"] < first_step["a2"] <= first_step["b2"]


def test_prefix_cache_is_per_adapter():
    sched = make_scheduler(budget=64, max_num_seqs=8)
    sched.max_loras = 2
    worker = worker_for(sched)

    def run(req_id: str, lora_id: int) -> int:
        sched.add_request(lora_request(req_id, lora_id, prompt_len=12, max_tokens=1))
        request = sched.requests[req_id]
        while sched.has_unfinished_requests():
            step(sched, worker)
        return request.num_cached_tokens

    assert run("first", 1) == 0
    assert run("other adapter", 2) == 0
    assert run("base", 0) == 0
    assert run("same adapter", 1) > 0


def test_every_pipeline_stages_failed_requests_reach_the_core():
    """A step's answer from every stage (stage order) is the last stage's tokens with the
    requests any stage failed; the last stage's reason wins; nothing to add: its own."""
    from tokenmill.core.model_runner_output import ModelRunnerOutput, merge_stage_outputs

    first = ModelRunnerOutput(["a", "b"], [[], []], failed_requests={"a": "stage 0", "b": "s0"})
    last = ModelRunnerOutput(["a", "b"], [[1], [2]], failed_requests={"b": "last stage"})
    merged = merge_stage_outputs([first, last])
    assert merged.sampled_token_ids == [[1], [2]]
    assert merged.failed_requests == {"a": "stage 0", "b": "last stage"}
    alone = ModelRunnerOutput(["a"], [[3]])
    assert merge_stage_outputs([ModelRunnerOutput(["a"], [[]]), alone]) is alone

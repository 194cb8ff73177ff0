"""The encoder budget and the encoder cache as the scheduler plans them: exact chunks
around images, which images a step encodes, evictions, cache hits, and block hashes that
tell images apart."""

from __future__ import annotations

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.kv_cache_utils import update_block_hashes
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.multimodal.inputs import MultiModalFeature
from tokenmill.sampling_params import SamplingParams

IMAGE_TOKEN = 7


def make_scheduler(budget: int, num_blocks: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4, max_model_len=256,
                        admission_headroom=False),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        num_blocks=num_blocks,
    )  # fmt: skip


def image_request(req_id: str, layout: list[int | tuple[str, int]]) -> Request:
    """A prompt from ``layout``: ints are runs of text tokens, ``(hash, n)`` an image of
    ``n`` placeholders."""
    ids: list[int] = []
    features = []
    for part in layout:
        if isinstance(part, int):
            ids.extend(range(100 + len(ids), 100 + len(ids) + part))
        else:
            digest, n = part
            features.append(MultiModalFeature("image", digest, len(ids), n))
            ids.extend([IMAGE_TOKEN] * n)
    params = SamplingParams(max_tokens=2, temperature=0)
    return Request(req_id, ids, params, mm_features=features)


MM_STATS: list[tuple[int, int]] = []  # (queries, hits) of each step run


def run_step(sched: Scheduler):
    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [
        [1] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
        for r in ids
    ]
    out = sched.update_from_output(so, ModelRunnerOutput(ids, sampled, {}, {}))
    stats = out.scheduler_stats
    MM_STATS.append((stats.mm_cache_queries, stats.mm_cache_hits))
    return so


def mm_stats(num_steps: int) -> tuple[int, int]:
    """(queries, hits) of the encoder cache over the last ``num_steps`` steps."""
    last = MM_STATS[-num_steps:]
    return sum(q for q, _ in last), sum(h for _, h in last)


def test_chunk_stops_before_an_image_that_does_not_fit_and_takes_it_whole_next():
    sched = make_scheduler(budget=32)
    sched.add_request(image_request("a", [10, ("img", 30), 10]))
    so = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 10} and so.scheduled_encoder_inputs == {}
    so = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 32}
    assert so.scheduled_encoder_inputs == {"a": [0]}
    so = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 8} and so.scheduled_encoder_inputs == {}


def test_an_image_larger_than_the_budget_is_encoded_once_and_read_from_the_cache():
    sched = make_scheduler(budget=16)
    sched.add_request(image_request("a", [("big", 40), 4]))
    plans = [run_step(sched) for _ in range(3)]
    assert [p.num_scheduled_tokens["a"] for p in plans] == [16, 16, 12]
    assert [p.scheduled_encoder_inputs for p in plans] == [{"a": [0]}, {}, {}]
    assert mm_stats(3) == (1, 0)


def test_one_image_in_two_requests_of_a_step_is_encoded_once_and_hit_once():
    sched = make_scheduler(budget=64)
    sched.add_request(image_request("a", [3, ("same", 12), 2]))
    sched.add_request(image_request("b", [5, ("same", 12), 1]))
    so = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 17, "b": 18}
    assert so.scheduled_encoder_inputs == {"a": [0]}
    assert mm_stats(1) == (2, 1)


def test_the_step_budget_limits_the_images_encoded_and_old_outputs_are_evicted():
    sched = make_scheduler(budget=24)
    sched.add_request(image_request("a", [("x", 16), 1]))
    sched.add_request(image_request("b", [("y", 16), 1]))
    so = run_step(sched)
    # b's image would take the step past 24 encoder tokens: b waits.
    assert so.num_scheduled_tokens == {"a": 17}
    assert so.scheduled_encoder_inputs == {"a": [0]}
    so = run_step(sched)
    assert so.scheduled_encoder_inputs == {"b": [0]}
    assert so.free_encoder_ids == ["x"]  # 16 + 16 > the cache's 24 tokens


def test_block_hashes_differ_by_image_from_the_first_block_holding_it():
    a = image_request("a", [6, ("one", 8), 6])
    b = image_request("b", [6, ("two", 8), 6])
    assert a.all_token_ids == b.all_token_ids
    for r in (a, b):
        update_block_hashes(r, 4)
    assert a.block_hashes[0] == b.block_hashes[0]  # text only
    assert all(x != y for x, y in zip(a.block_hashes[1:], b.block_hashes[1:], strict=True))


def test_an_image_encoded_in_a_chunk_does_not_evict_a_cached_one_the_chunk_reads():
    """A chunk that encodes one image and reads another from the cache keeps the one it
    reads: encoding may evict only entries the step does not use (evicting it crashed the
    scheduler, and the worker would have had no output for its placeholders)."""
    sched = make_scheduler(budget=24)
    sched.add_request(image_request("a", [("old", 10), 1]))
    while sched.requests:
        run_step(sched)
    sched.add_request(image_request("b", [("new", 16), ("old", 10), 1]))
    so = run_step(sched)
    encoded = [sched.requests["b"].mm_features[i].identifier
               for i in so.scheduled_encoder_inputs.get("b", [])]  # fmt: skip
    assert "old" not in so.free_encoder_ids or "old" in encoded
    while sched.requests:
        run_step(sched)


def _preempting_step(with_bystander: bool):
    """w (text), x (low priority) and y running; this step x starts encoding "img" and y's
    chunk reads it, then a request needs a block and x, the lowest priority, is
    preempted. The allocating request is y itself, or (``with_bystander``) z after it."""
    from tests.core.test_scheduler import make_scheduler as make_priority_scheduler

    sched = make_priority_scheduler(budget=32, num_blocks=9 if with_bystander else 7,
                                    policy="priority", threshold=4, caching=False)  # fmt: skip
    x = image_request("x", [8, ("img", 8), 1])
    x.priority = 5
    sched.add_request(image_request("w", [8]))
    sched.add_request(x)
    run_step(sched)
    y = image_request("y", [4, ("img", 8), 1])
    y.arrival_time = x.arrival_time + 1
    sched.add_request(y)
    if with_bystander:
        z = image_request("z", [4])
        z.arrival_time = y.arrival_time + 1
        sched.add_request(z)
    run_step(sched)
    return sched, run_step(sched)


def test_the_image_of_a_preempted_request_is_encoded_for_the_request_that_reads_it():
    """An image that a preempted request was to encode in the step is encoded for the
    request of the step that reads it, whether that one was planned before the preemption
    or triggered it (the scheduler crashed, or the worker had no output to read)."""
    for with_bystander in (False, True):
        sched, so = _preempting_step(with_bystander)
        assert "x" in so.finished_req_ids and "y" in so.num_scheduled_tokens
        assert so.scheduled_encoder_inputs == {"y": [0]}
        while sched.requests:
            run_step(sched)


def whole_image_scheduler(budget: int, **config) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4, max_model_len=256,
                        admission_headroom=False, disable_chunked_mm_input=True, **config),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        num_blocks=64,
    )  # fmt: skip


def test_whole_images_are_never_split_even_when_cached():
    # Split: the cached image's placeholders read the cache from any chunk.
    sched = make_scheduler(budget=32)
    sched.add_request(image_request("a", [2, ("img", 30)]))
    while sched.requests:
        run_step(sched)
    sched.add_request(image_request("b", [10, ("img", 30), 10]))
    assert run_step(sched).num_scheduled_tokens == {"b": 32}
    # Whole: the chunk stops before the image, then takes it in one step.
    sched = whole_image_scheduler(budget=32)
    sched.add_request(image_request("a", [2, ("img", 30)]))
    while sched.requests:
        run_step(sched)
    sched.add_request(image_request("b", [10, ("img", 30), 10]))
    plans = [run_step(sched) for _ in range(3)]
    assert [p.num_scheduled_tokens["b"] for p in plans] == [10, 32, 8]
    assert [p.scheduled_encoder_inputs for p in plans] == [{}, {}, {}]  # cached


def test_a_chunk_starting_inside_an_image_takes_the_rest_of_it_past_the_chunk_limit():
    # Chunks of one token; the second request's prefix-cache hit (24 tokens, whole blocks)
    # ends 2 tokens before its image does.
    sched = whole_image_scheduler(budget=32, long_prefill_token_threshold=1)
    sched.add_request(image_request("a", [6, ("img", 20)]))
    chunks = []
    while sched.requests:
        chunks.append(run_step(sched).num_scheduled_tokens.get("a"))
    assert chunks[:7] == [1] * 6 + [20]  # text, then the image whole
    sched.add_request(image_request("b", [6, ("img", 20), 3]))
    assert run_step(sched).num_scheduled_tokens == {"b": 2}
    assert sched.requests["b"].num_computed_tokens == 26  # 24 hit + the image's last 2
    assert [run_step(sched).num_scheduled_tokens["b"] for _ in range(3)] == [1, 1, 1]


def test_a_chunk_inside_an_image_waits_for_a_step_with_room_for_its_rest():
    sched = whole_image_scheduler(budget=32)
    req = image_request("a", [6, ("img", 20)])
    sched.add_request(req)
    enc = sched.encoder_cache
    step = enc.begin_step()
    assert enc.clip(req, 24, 1, step, token_budget=1) == (0, [])
    assert enc.clip(req, 24, 1, step, token_budget=2) == (2, [0])
    assert enc.clip(req, 4, 10, step, token_budget=32) == (2, [])  # stops before it

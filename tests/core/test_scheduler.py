"""Scheduler: exact per-step plans for chunked prefill, caps, stops, preemption and aborts.

``FakeWorker`` plays the worker's side of the contract: it applies each SchedulerOutput
diff to its own per-request state (and checks that the diff is consistent), "computes"
KV into a fake cache by writing a fingerprint of each token's prefix into its slot, checks
that every context slot a request reads holds its own prefix, and samples a deterministic
token once a request's prompt is done.
"""

from __future__ import annotations

import subprocess
import sys
import zlib
from dataclasses import dataclass, field

import pytest

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.engine_io import EngineCoreOutputs, FinishReason, LogprobsLists
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduler_output import SchedulerOutput
from tokenmill.sampling_params import SamplingParams

VOCAB_SIZE = 1000


def fake_token(req_id: str, position: int, vocab_size: int = VOCAB_SIZE) -> int:
    """The token a request 'samples' at ``position``: a fixed function of both."""
    return zlib.crc32(f"{req_id}:{position}".encode()) % vocab_size


@dataclass
class _WorkerRequest:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    salt: str | None = None
    fingerprints: list[int] = field(default_factory=list)

    def prefix_fingerprints(self) -> list[int]:
        """fingerprints[p] stands for (salt, token_ids[: p + 1])."""
        fps = self.fingerprints
        prev = fps[-1] if fps else hash(("root", self.salt))
        for token in self.token_ids[len(fps) :]:
            prev = hash((prev, token))
            fps.append(prev)
        return fps


class FakeWorker:
    """The worker side of SchedulerOutput / ModelRunnerOutput, on a fake KV cache.

    Args:
        block_size: tokens per block.
        num_blocks: blocks in the cache.
        script: request id -> the output tokens to sample, by output index; beyond the
            script (or for other requests) ``fake_token`` is used.
        salts: request id -> cache salt (mixed into the KV fingerprints, so a hit
            across salts is caught as a wrong read).
        vocab_size: range of ``fake_token``.
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        script: dict[str, list[int]] | None = None,
        salts: dict[str, str | None] | None = None,
        vocab_size: int = VOCAB_SIZE,
    ) -> None:
        self.block_size = block_size
        self.kv: list[int | None] = [None] * (block_size * num_blocks)
        self.script = script or {}
        self.salts = salts or {}
        self.vocab_size = vocab_size
        self.states: dict[str, _WorkerRequest] = {}
        # Reads of KV that another request wrote in the same step (flagged steps only).
        self.num_same_step_reads = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diff(so)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        batch = [(self.states[r], n) for r, n in so.num_scheduled_tokens.items()]
        # Every layer writes the KV of all scheduled tokens before attention reads.
        written: dict[int, int] = {}  # slot -> batch index of the request writing it
        for i, (state, n) in enumerate(batch):
            assert n > 0 and state.num_computed_tokens + n <= len(state.token_ids)
            assert len(state.block_ids) * self.block_size >= state.num_computed_tokens + n
            fps = state.prefix_fingerprints()
            for pos in range(state.num_computed_tokens, state.num_computed_tokens + n):
                self.kv[self._slot(state, pos)] = fps[pos]
                written[self._slot(state, pos)] = i
        for i, (state, n) in enumerate(batch):
            fps = state.prefix_fingerprints()
            for pos in range(state.num_computed_tokens + n):
                slot = self._slot(state, pos)
                assert self.kv[slot] == fps[pos], f"wrong KV at {pos}"
                # Kernels that read earlier tokens' KV ahead of the step's writes rely on it.
                if written.get(slot, i) != i:
                    assert so.reads_step_kv, f"reads KV written in the step, unflagged, at {pos}"
                    self.num_same_step_reads += 1
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id, (state, n) in zip(req_ids, batch, strict=True):
            state.num_computed_tokens += n
            if state.num_computed_tokens < len(state.token_ids):
                sampled.append([])  # a partial prefill chunk samples nothing
                continue
            token = self._next_token(req_id, state)
            state.token_ids.append(token)
            sampled.append([token])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def _apply_diff(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent twice in full"
            self.states[new.req_id] = _WorkerRequest(
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                salt=self.salts.get(new.req_id),
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.states[req_id]
            assert state.num_computed_tokens == cached.num_computed_tokens[i], req_id
            state.block_ids.extend(cached.new_block_ids[i])

    def _next_token(self, req_id: str, state: _WorkerRequest) -> int:
        index = len(state.token_ids) - state.num_prompt_tokens
        script = self.script.get(req_id, [])
        if index < len(script):
            return script[index]
        return fake_token(req_id, len(state.token_ids), self.vocab_size)

    def _slot(self, state: _WorkerRequest, pos: int) -> int:
        return state.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size


def make_scheduler(
    budget: int = 16,
    max_num_seqs: int = 4,
    max_model_len: int = 64,
    block_size: int = 4,
    num_blocks: int = 32,
    chunked: bool = True,
    policy: str = "fcfs",
    threshold: int = 0,
    caching: bool = True,
    headroom: bool = False,
    pacing: int = 0,
    pacing_mode: str = "prompt",
) -> Scheduler:
    """A scheduler over a small cache; admission headroom off unless asked for, so plans
    admit whatever fits (the mechanics these tests pin down)."""
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            scheduling_policy=policy,
            long_prefill_token_threshold=threshold,
            admission_headroom=headroom,
            prefill_pacing_tokens=pacing,
            prefill_pacing_mode=pacing_mode,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks=num_blocks,
    )


def make_request(
    req_id: str,
    prompt_len: int,
    max_tokens: int | None = 16,
    first_token: int = 0,
    priority: int = 0,
    arrival_time: float = 0.0,
    max_model_len: int | None = None,
    **params,
) -> Request:
    prompt = [(first_token + i) % VOCAB_SIZE for i in range(prompt_len)]
    return Request(
        req_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),
        arrival_time=arrival_time,
        priority=priority,
        max_model_len=max_model_len,
    )


def step(sched: Scheduler, worker: FakeWorker) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    so = sched.schedule()
    sched.kv_cache_manager.check_integrity()
    out = sched.update_from_output(so, worker.execute(so))
    sched.kv_cache_manager.check_integrity()
    return so, out


def worker_for(sched: Scheduler, **kwargs) -> FakeWorker:
    return FakeWorker(sched.block_size, sched.num_blocks, **kwargs)


# ----------------------------------------------------------------------- chunked prefill


def test_chunked_prefill_under_a_small_budget():
    sched = make_scheduler(budget=8)
    worker = worker_for(sched)
    sched.add_request(make_request("a", 20, first_token=0))
    sched.add_request(make_request("b", 6, first_token=100))
    so, out = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 8}
    [new] = so.scheduled_new_reqs
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("a", [0, 1], 0)
    assert out.outputs == []  # a partial prefill samples nothing
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 8}
    assert so.scheduled_cached_reqs.req_ids == ["a"]
    assert so.scheduled_cached_reqs.new_block_ids == [[2, 3]]
    assert so.scheduled_cached_reqs.num_computed_tokens == [8]
    so, out = step(sched, worker)
    assert list(so.num_scheduled_tokens.items()) == [("a", 4), ("b", 4)]
    assert so.scheduled_cached_reqs.new_block_ids == [[4]]
    assert [(n.req_id, n.block_ids) for n in so.scheduled_new_reqs] == [("b", [5])]
    assert [o.request_id for o in out.outputs] == ["a"]  # a's prompt is done
    so, out = step(sched, worker)
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 2)]
    assert so.scheduled_cached_reqs.new_block_ids == [[6], [7]]  # a's 21st token, b's 5th
    assert [o.request_id for o in out.outputs] == ["a", "b"]
    so, _ = step(sched, worker)
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 1)]
    assert so.total_num_scheduled_tokens == 2


def test_long_prefill_token_threshold_caps_chunks():
    sched = make_scheduler(budget=16, threshold=5)
    worker = worker_for(sched)
    sched.add_request(make_request("a", 12))
    sched.add_request(make_request("b", 3))
    plans = [step(sched, worker)[0].num_scheduled_tokens for _ in range(4)]
    assert plans == [{"a": 5, "b": 3}, {"a": 5, "b": 1}, {"a": 2, "b": 1}, {"a": 1, "b": 1}]


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(budget=64, max_num_seqs=2)
    worker = worker_for(sched)
    for i, req_id in enumerate("abc"):
        sched.add_request(make_request(req_id, 4, max_tokens=2 + i, first_token=10 * i))
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 4, "b": 4}
    so, out = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [o.request_id for o in out.outputs if o.finished] == ["a"]
    so, _ = step(sched, worker)
    assert list(so.num_scheduled_tokens.items()) == [("b", 1), ("c", 4)]
    assert so.finished_req_ids == {"a"}


def test_decode_after_prefill_one_token_per_step():
    sched = make_scheduler()
    worker = worker_for(sched)
    sched.add_request(make_request("a", 5, max_tokens=4))
    tokens = []
    for expected in [{"a": 5}, {"a": 1}, {"a": 1}, {"a": 1}]:
        so, out = step(sched, worker)
        assert so.num_scheduled_tokens == expected
        [o] = out.outputs
        tokens += o.new_token_ids
    assert tokens == [fake_token("a", n) for n in range(5, 9)]
    assert o.finish_reason == FinishReason.LENGTH
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == sched.num_blocks


def test_chunked_prefill_off_waits_for_the_whole_prompt():
    sched = make_scheduler(budget=16, max_model_len=16, chunked=False)
    worker = worker_for(sched)
    sched.add_request(make_request("a", 10, first_token=0))
    sched.add_request(make_request("b", 10, first_token=100))
    sched.add_request(make_request("c", 3, first_token=200))
    so, _ = step(sched, worker)
    # b does not fit the 6 tokens left and is not split; c, though it fits, queues behind b.
    assert so.num_scheduled_tokens == {"a": 10}
    so, _ = step(sched, worker)
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 10), ("c", 3)]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(budget=8, max_model_len=16, chunked=False)


# ------------------------------------------------------------------------------ stops


def run_to_finish(sched: Scheduler, worker: FakeWorker, max_steps: int = 100):
    """Step until nothing is left; returns (tokens, last output) per request id."""
    tokens: dict[str, list[int]] = {}
    last = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return tokens, last
        _, out = step(sched, worker)
        for o in out.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            last[o.request_id] = o
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize(
    "params, script, expected_tokens, reason, stop_reason",
    [
        (dict(eos_token_ids=[2]), [5, 2, 7], [5, 2], FinishReason.STOP, None),
        (dict(eos_token_ids=[2], ignore_eos=True, max_tokens=3), [2, 2, 2, 2], [2, 2, 2],
         FinishReason.LENGTH, None),
        (dict(stop_token_ids=[9]), [4, 9, 5], [4, 9], FinishReason.STOP, 9),
        (dict(eos_token_ids=[2], min_tokens=3), [2, 2, 7, 2], [2, 2, 7, 2],
         FinishReason.STOP, None),
        (dict(eos_token_ids=[2], min_tokens=3), [2, 2, 2], [2, 2, 2], FinishReason.STOP, None),
        (dict(stop_token_ids=[9], min_tokens=2), [9, 9], [9, 9], FinishReason.STOP, 9),
        (dict(max_tokens=3), [1, 2, 3, 4], [1, 2, 3], FinishReason.LENGTH, None),
    ],
)  # fmt: skip
def test_stop_conditions(params, script, expected_tokens, reason, stop_reason):
    sched = make_scheduler()
    worker = worker_for(sched, script={"r": script})
    params.setdefault("max_tokens", 10)
    sched.add_request(make_request("r", 6, **params))
    tokens, last = run_to_finish(sched, worker)
    assert tokens["r"] == expected_tokens
    assert last["r"].finish_reason == reason
    assert last["r"].stop_reason == stop_reason
    assert sched.kv_cache_manager.num_free_blocks == sched.num_blocks
    assert sched.schedule().finished_req_ids == {"r"}


def test_stop_at_max_model_len():
    sched = make_scheduler(max_model_len=13)
    worker = worker_for(sched)
    # Not clamped by the request itself: the scheduler's own check must end it.
    sched.add_request(make_request("r", 10, max_tokens=None))
    tokens, last = run_to_finish(sched, worker)
    assert len(tokens["r"]) == 3
    assert last["r"].finish_reason == FinishReason.LENGTH


def test_tokens_after_a_stop_are_dropped_and_logprobs_sliced():
    sched = make_scheduler()
    sched.add_request(make_request("r", 4, eos_token_ids=[2]))
    so = sched.schedule()
    logprobs = LogprobsLists([[4], [2], [6]], [[-0.1], [-0.2], [-0.3]], [1, 1, 1])
    runner_out = ModelRunnerOutput(["r"], [[4, 2, 6]], logprobs={"r": logprobs})
    [o] = sched.update_from_output(so, runner_out).outputs
    assert o.new_token_ids == [4, 2]
    assert o.new_logprobs.token_ids == [[4], [2]]
    assert o.finish_reason == FinishReason.STOP


# --------------------------------------------------------------------- aborts, policy


def test_abort_frees_blocks_at_once():
    sched = make_scheduler()
    worker = worker_for(sched)
    sched.add_request(make_request("a", 8, first_token=0))
    sched.add_request(make_request("b", 8, first_token=100))
    step(sched, worker)
    so = sched.schedule()  # both scheduled; then a is aborted before the step's output
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.get_block_ids("a") == []
    assert sched.kv_cache_manager.num_free_blocks == sched.num_blocks - 3
    assert [r.request_id for r in sched.running] == ["b"]
    out = sched.update_from_output(so, worker.execute(so))
    assert [o.request_id for o in out.outputs] == ["b"]
    sched.add_request(make_request("c", 4, first_token=200))
    sched.finish_requests(["c", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert len(sched.waiting) == 0
    so = sched.schedule()
    assert so.finished_req_ids == {"a", "c"}
    assert so.num_scheduled_tokens == {"b": 1}
    with pytest.raises(ValueError):
        sched.finish_requests("b", RequestStatus.RUNNING)
    sched.kv_cache_manager.check_integrity()


def test_priority_orders_waiting_requests():
    sched = make_scheduler(budget=64, max_num_seqs=1, policy="priority")
    worker = worker_for(sched)
    for req_id, priority, arrival in [("c", 2, 0.0), ("a", 0, 1.0), ("b", 1, 2.0), ("d", 0, 3.0)]:
        sched.add_request(
            make_request(req_id, 3, max_tokens=1, priority=priority, arrival_time=arrival)
        )
    assert [r.request_id for r in sched.waiting] == ["a", "d", "b", "c"]
    order = [next(iter(step(sched, worker)[0].num_scheduled_tokens)) for _ in range(4)]
    assert order == ["a", "d", "b", "c"]


def test_fcfs_orders_waiting_requests_by_arrival():
    sched = make_scheduler(budget=64, max_num_seqs=1)
    worker = worker_for(sched)
    for req_id in "cab":
        sched.add_request(make_request(req_id, 3, max_tokens=1))
    order = [next(iter(step(sched, worker)[0].num_scheduled_tokens)) for _ in range(3)]
    assert order == ["c", "a", "b"]


# ---------------------------------------------------------------- admission and stats


def test_add_request_rejects_what_can_never_run():
    sched = make_scheduler(max_model_len=64, block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="max_model_len=64"):
        sched.add_request(make_request("long", 65))
    with pytest.raises(ValueError, match="only 8 blocks"):
        sched.add_request(make_request("big", 33))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("empty", 0))
    sched.add_request(make_request("ok", 32))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", 3))
    assert sched.get_num_unfinished_requests() == 1


def test_stats_and_first_scheduled_events():
    sched = make_scheduler(budget=64)
    worker = worker_for(sched)
    sched.add_request(make_request("a", 9, first_token=0))
    _, out = step(sched, worker)
    assert set(out.first_scheduled) == {"a"}
    assert out.scheduler_stats.prefix_cache_queries == 9
    assert out.scheduler_stats.prefix_cache_hits == 0
    sched.add_request(make_request("b", 10, first_token=0))  # shares a's 2 full blocks
    _, out = step(sched, worker)
    assert set(out.first_scheduled) == {"b"}
    stats = out.scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10, 8)
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 0)
    assert stats.num_total_blocks == 32
    assert stats.num_free_blocks == 32 - 4  # a: 3 blocks; b: 1 more (2 shared)
    assert stats.kv_cache_usage == pytest.approx(4 / 32)
    assert sched.requests["b"].num_cached_tokens == 8
    [ob] = [o for o in out.outputs if o.request_id == "b"]
    assert ob.num_cached_tokens == 8
    _, out = step(sched, worker)
    assert out.first_scheduled == {}
    assert sched.requests["a"].first_scheduled_time is not None


def test_same_step_prefix_hit_for_parallel_samples():
    sched = make_scheduler(budget=64)
    worker = worker_for(sched)
    for i in range(3):  # how the front end submits n=3: same prompt, separate requests
        sched.add_request(make_request(f"s{i}", 10, first_token=0))
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"s0": 10, "s1": 2, "s2": 2}
    assert [n.block_ids for n in so.scheduled_new_reqs] == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert [b.ref_cnt for b in sched.kv_cache_manager.block_pool.blocks[:5]] == [3, 3, 1, 1, 1]
    # s1 and s2 read blocks 0 and 1, which s0 writes in this step.
    assert so.reads_step_kv and worker.num_same_step_reads > 0
    so, _ = step(sched, worker)  # decodes: every block read was written by an earlier step
    assert not so.reads_step_kv


def test_async_block_cached_a_step_after_its_write_is_not_a_same_step_read():
    """Under async scheduling a decode's block is cached once its last token reaches the
    host, a step after the step that wrote it: a hit on it then reads KV of an earlier step."""
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64,
                        async_scheduling=True, admission_headroom=False),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        num_blocks=32,
    )  # fmt: skip
    worker = worker_for(sched)
    sched.add_request(make_request("a", 7, max_tokens=8))
    so1 = sched.schedule()  # a's prompt, positions 0..6; samples position 7
    out1 = worker.execute(so1)
    so2 = sched.schedule()  # a writes position 7 (block 1 is full) with its token on the device
    out2 = worker.execute(so2)
    sched.update_from_output(so1, out1)  # the token of position 7 reaches the host
    sched.add_request(Request("b", sched.requests["a"].all_token_ids + [9], SamplingParams()))
    so3 = sched.schedule()  # a's block 1 enters the cache only now; b hits it
    assert so3.num_scheduled_tokens == {"a": 1, "b": 1}
    worker.execute(so3)
    assert not so3.reads_step_kv and worker.num_same_step_reads == 0
    sched.update_from_output(so2, out2)


def test_prefix_hit_on_an_earlier_step_is_not_a_same_step_read():
    sched = make_scheduler(budget=64)
    worker = worker_for(sched)
    sched.add_request(make_request("a", 10))
    so, _ = step(sched, worker)
    assert not so.reads_step_kv
    sched.add_request(make_request("b", 10))  # hits a's blocks 0 and 1, written last step
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 1, "b": 2}
    assert not so.reads_step_kv and worker.num_same_step_reads == 0


def test_decode_that_fills_a_block_another_request_hits_in_the_same_step():
    sched = make_scheduler(budget=64)
    worker = worker_for(sched, script={"a": [3, 4, 5, 6]})
    sched.add_request(make_request("a", 7))  # tokens 0..6, then samples 3: block 1 is full
    step(sched, worker)
    # b's prompt is a's context so far plus one token: its hits include block 1, whose
    # last slot a's decode writes in this step.
    sched.add_request(Request("b", list(range(7)) + [3, 9], SamplingParams(max_tokens=2)))
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}
    assert so.reads_step_kv and worker.num_same_step_reads == 1


def test_reset_prefix_cache_and_counts():
    sched = make_scheduler()
    worker = worker_for(sched)
    sched.add_request(make_request("a", 9, max_tokens=2))
    assert sched.has_unfinished_requests() and not sched.has_finished_requests()
    step(sched, worker)
    assert sched.reset_prefix_cache() is False  # a holds blocks
    step(sched, worker)
    assert sched.has_finished_requests() and not sched.has_unfinished_requests()
    assert sched.reset_prefix_cache() is True
    sched.add_request(make_request("b", 9, max_tokens=1))
    so, _ = step(sched, worker)
    assert so.num_scheduled_tokens == {"b": 9}  # no hit left


def test_core_does_not_import_torch():
    code = (
        "import sys\n"
        "import tokenmill.core.scheduler, tokenmill.core.kv_cache_manager\n"
        "assert 'torch' not in sys.modules, 'core imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

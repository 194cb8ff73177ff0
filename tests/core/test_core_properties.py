"""Property-based tests of the scheduler and KV cache manager (hypothesis).

Random arrivals (prompt lengths, shared prefixes, cache salts, output limits, priorities)
under random scheduler settings (prefill pacing and async scheduling included, the latter
planning each step before the previous step's output is applied, as the engine core does),
steps run by the fake worker, and aborts (between steps and between a step's plan and its
output) must never leak or double-free a block, exceed the token budget or the sequence
cap, schedule a non-positive token count, let a request read KV that is not its own, or
read KV written in the same step by another request without flagging the step;
every accepted request gets exactly its tokens and one finish; under fcfs every request
finishes within a bound of steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.test_scheduler import FakeWorker
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.engine_io import FinishReason
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_cache_utils import hash_block_tokens
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduler_output import SchedulerOutput
from tokenmill.math_utils import cdiv
from tokenmill.sampling_params import SamplingParams

VOCAB_SIZE = 24
EOS = 0
# Three shared prefixes that requests start from (token ids 1..: never EOS).
PREFIXES = [[1 + (7 * p + 3 * i) % (VOCAB_SIZE - 1) for i in range(40)] for p in range(3)]


@dataclass(frozen=True)
class Arrival:
    prefix: int  # which of PREFIXES the prompt starts with
    prefix_len: int
    suffix_len: int
    max_tokens: int
    min_tokens: int
    priority: int
    salt: str | None
    stop_token: int | None


@dataclass(frozen=True)
class Config:
    block_size: int
    num_blocks: int
    max_model_len: int
    budget: int
    max_num_seqs: int
    chunked: bool
    policy: str
    threshold: int
    caching: bool
    headroom: bool
    pacing: int
    pacing_mode: str
    async_sched: bool


@st.composite
def configs(draw) -> Config:
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(6, 28))
    # Around the size that holds one max_model_len request: smaller caches cap requests.
    min_blocks = cdiv(max_model_len, block_size)
    num_blocks = draw(st.integers(max(1, min_blocks - 4), min_blocks + 4))
    chunked = draw(st.booleans())
    budget = draw(st.integers(1 if chunked else max_model_len, 40))
    return Config(
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        budget=max(budget, 1 if chunked else max_model_len),
        max_num_seqs=draw(st.integers(1, 6)),
        chunked=chunked,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        threshold=draw(st.sampled_from([0, 0, 3, 7])),
        caching=draw(st.booleans()),
        headroom=draw(st.booleans()),
        pacing=draw(st.sampled_from([0, 0, 1, 3, 8])) if chunked else 0,
        pacing_mode=draw(st.sampled_from(["prompt", "step"])),
        async_sched=draw(st.booleans()),
    )


arrivals = st.builds(
    Arrival,
    prefix=st.integers(0, 2),
    prefix_len=st.integers(0, 24) | st.integers(8, 16),
    suffix_len=st.integers(0, 8),
    max_tokens=st.integers(1, 20),
    min_tokens=st.integers(0, 3),
    priority=st.integers(0, 2),
    salt=st.sampled_from([None, None, "s"]),
    stop_token=st.sampled_from([None, None, 5]),
)
operations = st.one_of(
    st.tuples(st.just("add"), st.lists(arrivals, min_size=1, max_size=4)),
    st.tuples(st.just("step"), st.none()),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("abort_mid_step"), st.integers(0, 40)),
)


class Harness:
    """Drives a Scheduler with a FakeWorker and checks invariants at every step."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.sched = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.budget,
                max_num_seqs=config.max_num_seqs,
                max_model_len=config.max_model_len,
                enable_chunked_prefill=config.chunked,
                scheduling_policy=config.policy,
                long_prefill_token_threshold=config.threshold,
                admission_headroom=config.headroom,
                prefill_pacing_tokens=config.pacing,
                prefill_pacing_mode=config.pacing_mode,
                async_scheduling=config.async_sched,
            ),
            CacheConfig(block_size=config.block_size, enable_prefix_caching=config.caching),
            num_blocks=config.num_blocks,
        )
        self.salts: dict[str, str | None] = {}
        self.worker = FakeWorker(
            config.block_size, config.num_blocks, salts=self.salts, vocab_size=VOCAB_SIZE
        )
        self.requests: dict[str, Request] = {}  # every accepted request
        self.aborted: set[str] = set()
        self.emitted: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, list[FinishReason]] = {}
        self.clock = 0.0
        # Async scheduling: the step whose output is not applied yet, and that output.
        self.pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None

    def add(self, arrival: Arrival) -> None:
        req_id = f"r{len(self.requests)}"
        suffix = [1 + (11 * len(self.requests) + j) % (VOCAB_SIZE - 1) for j in range(9)]
        prompt = PREFIXES[arrival.prefix][: arrival.prefix_len] + suffix[: arrival.suffix_len]
        prompt = prompt[: self.sched.max_context_len] or [1]
        params = SamplingParams(
            max_tokens=arrival.max_tokens,
            min_tokens=min(arrival.min_tokens, arrival.max_tokens),
            stop_token_ids=[arrival.stop_token] if arrival.stop_token is not None else None,
            eos_token_ids=[EOS],
        )
        self.clock += 1.0
        request = Request(
            req_id,
            prompt,
            params,
            arrival_time=self.clock,
            priority=arrival.priority,
            cache_salt=arrival.salt,
            max_model_len=self.config.max_model_len,
        )
        self.salts[req_id] = arrival.salt
        self.sched.add_request(request)
        self.requests[req_id] = request

    def abort(self, index: int) -> None:
        if not self.requests:
            return
        req_id = f"r{index % len(self.requests)}"
        if req_id in self.sched.requests:
            self.aborted.add(req_id)
        self.sched.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def step(self, abort_index: int | None = None) -> None:
        sched, cfg = self.sched, self.config
        so = sched.schedule()
        counts = so.num_scheduled_tokens
        assert so.total_num_scheduled_tokens == sum(counts.values()) <= cfg.budget
        assert len(counts) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
        assert all(n > 0 for n in counts.values())
        assert so.finished_req_ids.isdisjoint(counts)
        if not cfg.chunked:
            for new in so.scheduled_new_reqs:  # whole prompts only
                request = self.requests[new.req_id]
                assert new.num_computed_tokens + counts[new.req_id] == request.num_tokens
        sched.kv_cache_manager.check_integrity()
        # As the engine core: a step runs ahead of the previous one's output unless it is
        # empty or one of its requests needs every earlier token on the host.
        ahead = cfg.async_sched and bool(counts)
        ahead = ahead and not any(sched.requests[r].needs_sync_step for r in counts)
        if abort_index is not None:
            self.abort(abort_index)
        pending, self.pending = self.pending, None
        if pending is not None and not ahead:
            self.apply(*pending)
            pending = None
        runner_output = self.worker.execute(so)
        for req_id in counts:
            if req_id in sched.requests:  # the worker's block table matches the manager's
                blocks = sched.kv_cache_manager.get_block_ids(req_id)
                assert self.worker.states[req_id].block_ids == blocks
        if pending is not None:
            self.apply(*pending)
        if ahead:
            self.pending = (so, runner_output)
        else:
            self.apply(so, runner_output)

    def apply(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """The step's output reaches the scheduler: tokens emitted, finishes recorded."""
        sched = self.sched
        out = sched.update_from_output(so, runner_output)
        for o in out.outputs:
            self.emitted.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                self.finish_reasons.setdefault(o.request_id, []).append(o.finish_reason)
        sched.kv_cache_manager.check_integrity()
        assert len(sched.running) + len(sched.waiting) == len(sched.requests)

    def drain(self, max_steps: int) -> int:
        steps = 0
        while self.sched.has_unfinished_requests() or self.pending is not None:
            assert steps < max_steps, f"not finished after {max_steps} steps"
            self.step()
            steps += 1
        return steps

    def check_final_state(self) -> None:
        kv = self.sched.kv_cache_manager
        kv.check_integrity()
        assert kv.num_free_blocks == self.config.num_blocks
        assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
        assert not kv.req_to_blocks and not self.sched.requests
        so = self.sched.schedule()  # hands the last finished ids to the worker
        assert so.is_empty
        self.worker.execute(so)
        assert not self.worker.states
        for req_id, request in self.requests.items():
            if req_id in self.aborted:
                assert len(self.finish_reasons.get(req_id, [])) <= 1
                continue
            self.check_finished_request(request)

    def check_finished_request(self, request: Request) -> None:
        req_id = request.request_id
        # Every token is emitted exactly once, even across preemptions, and one finish.
        assert self.emitted.get(req_id, []) == request.output_token_ids
        [reason] = self.finish_reasons[req_id]
        n = request.num_output_tokens
        # A prompt of max_model_len tokens (max_tokens clamped to 0) still yields its one token.
        assert 1 <= n <= max(request.max_tokens, 1)
        assert request.num_tokens <= self.sched.max_context_len + 1
        if reason == FinishReason.STOP:
            assert request.output_token_ids[-1] in request.eos_and_stop_ids
            assert n >= request.sampling_params.min_tokens
        else:
            assert reason == FinishReason.LENGTH
            assert n == request.max_tokens or request.num_tokens >= self.sched.max_context_len


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(config=configs(), ops=st.lists(operations, min_size=1, max_size=40))
def test_random_workloads_keep_every_invariant(config: Config, ops):
    harness = Harness(config)
    for kind, arg in ops:
        if kind == "add":
            for arrival in arg:
                harness.add(arrival)
        elif kind == "step":
            harness.step()
        elif kind == "abort":
            harness.abort(arg)
        else:
            harness.step(abort_index=arg)
    num_live = len(harness.sched.requests)
    # Under fcfs the oldest running request is never a victim unless it runs alone (and
    # then it fits), so it gains >= 1 token per step: each request finishes within
    # max_model_len + 1 steps of reaching the head. Priority gets a looser bound.
    per_request = config.max_model_len + 1
    bound = num_live * per_request + 1
    if config.policy != "fcfs":
        bound *= 4
    harness.drain(bound)
    harness.check_final_state()


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    salt=st.sampled_from(["a", "b", "salt"]),
)
def test_block_hashes_are_stable_and_chained(tokens, block_size, salt):
    def hashes(cache_salt: str | None) -> list[bytes]:
        kv = KVCacheManager(64, block_size, max_model_len=64)
        request = Request("r", tokens, SamplingParams(), cache_salt=cache_salt)
        kv.get_computed_blocks(request)
        return request.block_hashes

    plain = hashes(None)
    assert len(plain) == len(tokens) // block_size
    assert plain == hashes(None)  # the same across managers
    assert hashes(salt) == hashes(salt)
    assert all(x != y for x, y in zip(plain, hashes(salt), strict=True))
    if plain and salt != "a":
        assert hashes("a")[0] != hashes(salt)[0]
    block = tokens[:block_size]
    parent = hash_block_tokens(None, block)
    assert hash_block_tokens(parent, block) != hash_block_tokens(None, block)
    assert hash_block_tokens(parent, block) == hash_block_tokens(parent, list(block))


def test_hash_encoding_is_unambiguous():
    assert hash_block_tokens(None, [1, 2], ("ab",)) != hash_block_tokens(None, [1, 2], ("a", "b"))
    assert hash_block_tokens(None, [1, 2], (3,)) != hash_block_tokens(None, [1, 2, 3])
    assert hash_block_tokens(None, [1], ("1",)) != hash_block_tokens(None, [1], (1,))
    assert hash_block_tokens(None, [1], None) == hash_block_tokens(None, [1], ())
    assert len(hash_block_tokens(None, [7, 8])) == 32

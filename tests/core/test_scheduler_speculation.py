"""The scheduler with speculative decoding: drafts count against the token budget, rejected
drafts are taken back from the computed tokens (their KV slots overwritten before anyone
reads them), lookahead slots, acceptance counters, preemption mid-speculation.

``SpecWorker`` verifies drafts against the fake target of ``tests/core/test_scheduler``
(``fake_token``: the token at each position) and proposes drafts that are right for the
first ``correct`` positions and wrong after; its fake KV cache holds a fingerprint of each
slot's prefix, drafts included, and every read is checked against the request's true prefix.
"""

from __future__ import annotations

from types import SimpleNamespace

from tests.core.test_scheduler import FakeWorker, fake_token, make_request, make_scheduler
from tokenmill.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from tokenmill.core.engine_io import SchedulerStats, SpecDecodingStats
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.request import RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduler_output import SchedulerOutput
from tokenmill.math_utils import cdiv


class SpecWorker(FakeWorker):
    """A fake worker that verifies drafts and proposes ``k`` new ones per request."""

    def __init__(self, *args, k: int = 3, correct: int = 2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.k = k
        self.correct = correct

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._apply_diff(so)
        req_ids = list(so.num_scheduled_tokens)
        sampled, drafts = [], []
        for req_id in req_ids:
            state, n = self.states[req_id], so.num_scheduled_tokens[req_id]
            spec = so.scheduled_spec_decode_tokens.get(req_id, [])
            inputs = state.token_ids + spec  # the drafts follow the known tokens
            start = state.num_computed_tokens
            assert start + n == len(inputs) or not spec, "drafts are the last scheduled tokens"
            assert len(state.block_ids) * self.block_size >= start + n
            # Write each slot's fingerprint (of the inputs, drafts included), then read back
            # the request's true context: every slot below start + n must be right, the
            # drafts' slots included only as far as the drafts are right.
            fps = _fingerprints(inputs, state.salt)
            for pos in range(start, start + n):
                self.kv[self._slot(state, pos)] = fps[pos]
            truth = _fingerprints(state.token_ids, state.salt)
            for pos in range(min(start + n, len(state.token_ids))):
                assert self.kv[self._slot(state, pos)] == truth[pos], f"{req_id}: wrong KV at {pos}"
            state.num_computed_tokens = start + n
            if start + n < len(state.token_ids):
                sampled.append([])
                drafts.append([])
                continue
            new = self._verify(req_id, state, spec)
            state.num_computed_tokens -= len(spec) - (len(new) - 1)
            state.token_ids.extend(new)
            sampled.append(new)
            drafts.append(self._propose(req_id, len(state.token_ids)))
        return ModelRunnerOutput(req_ids, sampled, spec_token_ids=drafts)

    def _verify(self, req_id, state, spec: list[int]) -> list[int]:
        out = []
        for d in spec:
            truth = fake_token(req_id, len(state.token_ids) + len(out), self.vocab_size)
            if d != truth:
                return [*out, truth]
            out.append(d)
        return [*out, fake_token(req_id, len(state.token_ids) + len(out), self.vocab_size)]

    def _propose(self, req_id: str, num_tokens: int) -> list[int]:
        return [
            fake_token(req_id, num_tokens + i, self.vocab_size) + (0 if i < self.correct else 1)
            for i in range(self.k)
        ]


def _fingerprints(tokens: list[int], salt) -> list[int]:
    fps, prev = [], hash(("root", salt))
    for token in tokens:
        prev = hash((prev, token))
        fps.append(prev)
    return fps


def spec_scheduler(k: int = 3, method: str = "ngram", **kwargs) -> Scheduler:
    base = make_scheduler(**kwargs)
    return Scheduler(
        base.scheduler_config,
        CacheConfig(block_size=base.block_size, enable_prefix_caching=kwargs.get("caching", True)),
        base.num_blocks,
        speculative_config=SpeculativeConfig(method, k),  # type: ignore[arg-type]
    )


def run(
    sched: Scheduler, worker: SpecWorker, max_steps: int = 500, totals: SchedulerStats | None = None
) -> dict[str, list[int]]:
    """Step until every request finished; their outputs by id. ``totals`` adds up the
    steps' preemptions and spec-decode counters."""
    done: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        sched.kv_cache_manager.check_integrity()
        out = sched.update_from_output(so, worker.execute(so))
        sched.kv_cache_manager.check_integrity()
        if totals is not None and out.scheduler_stats is not None:
            totals.num_preemptions += out.scheduler_stats.num_preemptions
            assert totals.spec_decoding_stats is not None
            assert out.scheduler_stats.spec_decoding_stats is not None
            totals.spec_decoding_stats.add(out.scheduler_stats.spec_decoding_stats)
        for o in out.outputs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                done[o.request_id] = outputs[o.request_id]
    assert not sched.has_unfinished_requests()
    return done


def truth(req_id: str, prompt_len: int, n: int) -> list[int]:
    return [fake_token(req_id, prompt_len + i) for i in range(n)]


def test_outputs_are_the_targets_and_drafts_speed_them_up():
    sched = spec_scheduler(k=3, budget=32)
    worker = SpecWorker(sched.block_size, sched.num_blocks, k=3, correct=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 5 + i, max_tokens=20, first_token=10 * i))
    totals = SchedulerStats(spec_decoding_stats=SpecDecodingStats())
    done = run(sched, worker, totals=totals)
    assert done == {f"r{i}": truth(f"r{i}", 5 + i, 20) for i in range(3)}
    stats = totals.spec_decoding_stats
    assert stats is not None and stats.num_drafts > 0
    # Two of every three drafts are right: position 0 and 1 always accepted, 2 never.
    assert stats.num_accepted_tokens_per_pos[2] == 0
    assert stats.num_accepted_tokens_per_pos[0] == stats.num_drafts
    assert sched.kv_cache_manager.usage == 0.0


def test_drafts_count_against_the_token_budget():
    sched = spec_scheduler(k=4, budget=8, max_num_seqs=4)
    worker = SpecWorker(sched.block_size, sched.num_blocks, k=4, correct=4)
    sched.add_request(make_request("a", 3, max_tokens=30))
    sched.add_request(make_request("b", 3, max_tokens=30, first_token=50))
    run_steps = []
    for _ in range(4):
        so = sched.schedule()
        run_steps.append(so)
        assert so.total_num_scheduled_tokens <= 8
        sched.update_from_output(so, worker.execute(so))
    # After the prompts: each decode computes its last token and its drafts, as many as
    # the budget leaves ("a" first in the batch, "b" what is left of 8).
    spec = run_steps[1].scheduled_spec_decode_tokens
    assert run_steps[1].num_scheduled_tokens == {"a": 5, "b": 3}
    assert [len(spec["a"]), len(spec["b"])] == [4, 2]


def test_lookahead_slots_for_proposers_with_a_kv_cache():
    sched = spec_scheduler(k=3, method="draft_model", block_size=4, budget=16)
    worker = SpecWorker(sched.block_size, sched.num_blocks, k=3, correct=1)
    request = make_request("a", 6, max_tokens=12)
    sched.add_request(request)
    for _ in range(3):
        so = sched.schedule()
        blocks = sched.kv_cache_manager.get_block_ids("a")
        need = request.num_computed_tokens + 3  # computed after the step + lookahead
        assert len(blocks) >= cdiv(min(need, sched.max_model_len), 4)
        sched.update_from_output(so, worker.execute(so))
    assert sched.speculation is not None and not sched.speculation.shifted_kv


def test_drafts_stop_at_max_tokens_and_structured_outputs_never_speculate():
    sched = spec_scheduler(k=4, budget=32)
    worker = SpecWorker(sched.block_size, sched.num_blocks, k=4, correct=4)
    short = make_request("short", 4, max_tokens=3)
    grammar = make_request("grammar", 4, max_tokens=5, first_token=40)
    grammar.grammar = SimpleNamespace(failure=None, accept=lambda t: True, is_complete=False)
    sched.add_request(short)
    sched.add_request(grammar)
    first = sched.update_from_output(so := sched.schedule(), worker.execute(so))  # prompts
    # one output so far, two to go: one draft and the target's own token
    assert len(short.spec_token_ids) == 1
    assert grammar.spec_token_ids == []
    done = run(sched, worker)
    firsts = {o.request_id: o.new_token_ids for o in first.outputs}
    assert firsts["short"] + done["short"] == truth("short", 4, 3)
    assert firsts["grammar"] + done["grammar"] == truth("grammar", 4, 5)


def test_preemption_mid_speculation_leaks_no_block():
    sched = spec_scheduler(k=3, method="draft_model", budget=24, num_blocks=14,
                           max_num_seqs=4, block_size=4)  # fmt: skip
    worker = SpecWorker(sched.block_size, sched.num_blocks, k=3, correct=1)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 6, max_tokens=14, first_token=7 * i))
    totals = SchedulerStats(spec_decoding_stats=SpecDecodingStats())
    done = run(sched, worker, totals=totals)
    assert done == {f"r{i}": truth(f"r{i}", 6, 14) for i in range(4)}
    assert totals.num_preemptions > 0
    kv = sched.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_a_preempted_request_drops_its_drafts():
    sched = spec_scheduler(k=2, budget=16)
    worker = SpecWorker(sched.block_size, sched.num_blocks, k=2)
    request = make_request("a", 4, max_tokens=10)
    sched.add_request(request)
    sched.update_from_output(so := sched.schedule(), worker.execute(so))
    assert request.spec_token_ids
    sched._preempt(request, SimpleNamespace(num_scheduled_tokens={}, preempted_ids=set()))
    assert request.status == RequestStatus.PREEMPTED and request.spec_token_ids == []


def test_eagle_style_proposers_recompute_the_last_hit_block():
    prompt = 13  # three full blocks of 4, then one token
    for method, hits in (("draft_model", 12), ("eagle", 8)):
        sched = spec_scheduler(k=2, method=method, budget=32, block_size=4)
        worker = SpecWorker(sched.block_size, sched.num_blocks, k=2)
        sched.add_request(make_request("a", prompt, max_tokens=2))
        run(sched, worker)
        sched.add_request(make_request("b", prompt, max_tokens=2))
        so = sched.schedule()
        assert so.scheduled_new_reqs[0].num_computed_tokens == hits, method


def test_config_of_the_scheduler_without_speculation_is_unchanged():
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2, max_model_len=32),
        CacheConfig(block_size=4),
        num_blocks=16,
    )
    assert sched.speculation is None and sched.make_stats().spec_decoding_stats is None

"""Beam search through the scheduler on a fake worker: the beams equal a direct run of
``BeamSearch`` on the same candidates, beams share blocks, the block they diverge in is
copied before it is written (the fake KV's fingerprints catch a wrong copy), and every block
is free again at the end, with preemption and tight caches included."""

from __future__ import annotations

import math
import random

import pytest

from tests.core.test_scheduler import FakeWorker, make_scheduler, step
from tokenmill.core.beam_search import BeamSearch
from tokenmill.core.engine_io import FinishReason, LogprobsLists
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.core.request import Request, RequestStatus
from tokenmill.sampling_params import BeamSearchParams

EOS = 7
VOCAB = 50


def candidates(tokens: list[int], k: int) -> list[tuple[int, float]]:
    """The top-k next tokens after ``tokens`` and their logprobs: a fixed function of them."""
    rng = random.Random(hash(tuple(tokens)))
    ids = rng.sample(range(VOCAB), k)
    probs = sorted((rng.random() for _ in ids), reverse=True)
    total = sum(probs) * 1.5
    return [(t, math.log(p / total)) for t, p in zip(ids, probs, strict=True)]


class BeamWorker(FakeWorker):
    """FakeWorker plus the beam-search side of the contract: block copies, tokens chosen by
    the scheduler, and the candidates' logprobs of requests that ask for logprobs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_logprobs: dict[str, int] = {}
        self.num_copies = 0

    def _apply_diff(self, so):
        for new in so.scheduled_new_reqs:
            if new.sampling_params.logprobs is not None:
                self.num_logprobs[new.req_id] = new.sampling_params.logprobs
        super()._apply_diff(so)
        for src, dst in so.block_copies:
            bs = self.block_size
            self.kv[dst * bs : (dst + 1) * bs] = self.kv[src * bs : (src + 1) * bs]
            self.num_copies += 1
        for req_id, tokens in so.scheduled_cached_reqs.new_token_ids.items():
            state = self.states[req_id]
            start = state.num_computed_tokens
            state.token_ids[start:] = tokens
            del state.fingerprints[start:]

    def execute(self, so) -> ModelRunnerOutput:
        out = super().execute(so)
        logprobs = {}
        for req_id, sampled in zip(out.req_ids, out.sampled_token_ids, strict=True):
            k = self.num_logprobs.get(req_id)
            if k is None or not sampled:
                continue
            # The context is everything before the token just sampled.
            cands = candidates(self.states[req_id].token_ids[:-1], k)
            logprobs[req_id] = LogprobsLists(
                [[sampled[0]] + [t for t, _ in cands]], [[0.0] + [lp for _, lp in cands]], [1]
            )
        return ModelRunnerOutput(out.req_ids, out.sampled_token_ids, logprobs)


def reference(prompt: list[int], params: BeamSearchParams, eos: list[int]):
    search = BeamSearch(
        params.beam_width, params.max_tokens, eos, params.length_penalty, params.early_stopping
    )
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    while True:
        k = search.num_candidates
        nxt = search.step(beams, [candidates(prompt + b, k) for b, _ in beams])
        if search.done:
            return search.results()
        beams = [(beams[n.parent][0] + [n.token_id], n.cum_logprob) for n in nxt]


def beam_request(req_id: str, prompt: list[int], params: BeamSearchParams) -> Request:
    num_candidates = max(2, 1 + (0 if params.ignore_eos else 1)) * params.beam_width
    sampling = params.engine_sampling_params(num_candidates)
    sampling.eos_token_ids = [EOS]
    return Request(req_id, prompt, sampling)


def run(sched, worker, max_steps=500):
    outputs = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        so, out = step(sched, worker)
        for o in out.outputs:
            assert o.request_id not in outputs
            outputs[o.request_id] = o
    assert not sched.has_unfinished_requests()
    return outputs


@pytest.mark.parametrize(
    ("width", "max_tokens", "length_penalty", "early_stopping"),
    [(1, 6, 1.0, False), (2, 9, 1.0, False), (3, 12, 0.5, "never"), (4, 10, 2.0, True)],
)
def test_beams_equal_a_direct_search(width, max_tokens, length_penalty, early_stopping):
    sched = make_scheduler(budget=32, max_num_seqs=8, max_model_len=64, num_blocks=64)
    worker = BeamWorker(sched.block_size, sched.num_blocks)
    params = BeamSearchParams(
        beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty,
        early_stopping=early_stopping,
    )  # fmt: skip
    prompts = {"a": list(range(10, 20)), "b": list(range(30, 36))}
    for req_id, prompt in prompts.items():
        sched.add_request(beam_request(req_id, prompt, params), params)
    outputs = run(sched, worker)
    for req_id, prompt in prompts.items():
        expected = reference(prompt, params, [EOS])
        got = outputs[req_id]
        assert got.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert [b.token_ids for b in got.beams] == [h.token_ids for h in expected]
        assert [b.score for b in got.beams] == pytest.approx([h.score for h in expected])
    assert sched.kv_cache_manager.num_free_blocks == sched.num_blocks
    if width > 1:
        assert worker.num_copies > 0


def test_beams_share_blocks_while_running():
    sched = make_scheduler(budget=64, max_num_seqs=8, max_model_len=64, num_blocks=64)
    worker = BeamWorker(sched.block_size, sched.num_blocks)
    params = BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True)
    sched.add_request(beam_request("a", list(range(10, 30)), params), params)  # 5 full blocks
    most_shared = 0
    while sched.has_unfinished_requests():
        step(sched, worker)
        refs = [b.ref_cnt for b in sched.kv_cache_manager.block_pool.blocks]
        most_shared = max(most_shared, max(refs))
        used = sum(r > 0 for r in refs)
        # Four beams over a 20-token prompt: the prompt's blocks are held once.
        assert used <= 5 + 4 * 3
    assert most_shared == 4
    assert sched.kv_cache_manager.num_free_blocks == sched.num_blocks


def test_beams_survive_preemption_and_a_tight_cache():
    # 14 blocks of 4: two searches of width 3 cannot all hold their blocks at once.
    sched = make_scheduler(budget=16, max_num_seqs=6, max_model_len=48, num_blocks=14)
    worker = BeamWorker(sched.block_size, sched.num_blocks)
    params = BeamSearchParams(beam_width=3, max_tokens=14, ignore_eos=True)
    prompts = {"a": list(range(10, 23)), "b": list(range(30, 41))}
    for req_id, prompt in prompts.items():
        sched.add_request(beam_request(req_id, prompt, params), params)
    outputs = run(sched, worker, max_steps=2000)
    for req_id, prompt in prompts.items():
        expected = reference(prompt, params, [EOS])
        assert [b.token_ids for b in outputs[req_id].beams] == [h.token_ids for h in expected]
    assert sched.kv_cache_manager.num_free_blocks == sched.num_blocks


def test_running_beams_never_exceed_max_num_seqs():
    sched = make_scheduler(budget=64, max_num_seqs=4, max_model_len=64, num_blocks=64)
    worker = BeamWorker(sched.block_size, sched.num_blocks)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    sched.add_request(beam_request("a", list(range(10, 20)), params), params)
    sched.add_request(beam_request("b", list(range(30, 40)), params), params)
    outputs = {}
    while sched.has_unfinished_requests():
        so, out = step(sched, worker)
        assert len(worker.states) <= 4
        outputs.update({o.request_id: o for o in out.outputs})
    assert set(outputs) == {"a", "b"}


def test_abort_frees_every_beam():
    sched = make_scheduler(budget=64, max_num_seqs=8, max_model_len=64, num_blocks=64)
    worker = BeamWorker(sched.block_size, sched.num_blocks)
    params = BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True)
    sched.add_request(beam_request("a", list(range(10, 20)), params), params)
    for _ in range(4):
        step(sched, worker)
    assert len(sched.running) == 4
    beam_ids = {r.request_id for r in sched.running}
    with pytest.raises(ValueError):  # the id stays taken while the search runs
        sched.add_request(beam_request("a", [1, 2, 3], params), params)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    sched.kv_cache_manager.check_integrity()
    assert sched.kv_cache_manager.num_free_blocks == sched.num_blocks
    so = sched.schedule()
    assert beam_ids <= so.finished_req_ids  # the worker drops them (and beams pruned before)


def test_beams_that_cannot_fit_the_cache_are_refused():
    # 14 blocks of 4: a 13-token prompt shares 3 full blocks, and each beam needs one more.
    sched = make_scheduler(budget=16, max_num_seqs=16, max_model_len=48, num_blocks=14)
    fits = BeamSearchParams(beam_width=11, max_tokens=4, ignore_eos=True)
    sched.add_request(beam_request("a", list(range(10, 23)), fits), fits)
    too_wide = BeamSearchParams(beam_width=12, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="width 12 needs at least 15 KV blocks"):
        sched.add_request(beam_request("b", list(range(10, 23)), too_wide), too_wide)
    assert sched.get_num_unfinished_requests() == 1

"""Embedding models behind an engine core: the pooling core's batches under the token
budget, its failures, and the offline and server front ends over it."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.model.minilm import SENTENCES, minilm_folder
from tokenmill.core.engine_io import EngineCoreRequest, FinishReason
from tokenmill.engine.embedding_engine import AsyncEmbeddingEngine, EmbeddingEngine
from tokenmill.engine.pooling_core import POOLING_FAILURE_PREFIX, PoolingEngineCore, next_batch
from tokenmill.engine_args import EngineArgs
from tokenmill.sampling_params import SamplingParams


@given(
    st.lists(st.integers(1, 300), max_size=40),
    st.integers(1, 1024),
    st.integers(1, 16),
)
def test_next_batch_respects_the_budget(lengths, max_tokens, max_seqs):
    count = next_batch(lengths, max_tokens, max_seqs)
    assert count == (1 if lengths else 0) or 1 <= count <= max_seqs
    if count > 1:
        assert count * max(lengths[:count]) <= max_tokens
    if count < len(lengths) and count:
        longest = max(lengths[: count + 1])
        assert (count + 1) * longest > max_tokens or count >= max_seqs


def test_next_batch_takes_arrival_order():
    assert next_batch([5, 100, 6, 90], max_tokens=200, max_seqs=8) == 2
    assert next_batch([300, 5], max_tokens=200, max_seqs=8) == 1  # too long: alone


@pytest.fixture(scope="module")
def config():
    # A small budget: the 10 sentences need several padded batches.
    args = EngineArgs(model=minilm_folder(), max_num_batched_tokens=64, max_num_seqs=4)
    return args.create_engine_config()


@pytest.fixture(scope="module")
def engine(config) -> EmbeddingEngine:
    return EmbeddingEngine(config)


def test_small_budget_gives_the_same_embeddings(engine):
    token_ids = [engine.front_end.tokenize(s) for s in SENTENCES]
    assert engine.engine_core.max_num_batched_tokens == 64
    together = engine.pool(token_ids)
    alone = torch.cat([engine.pool([t]) for t in token_ids])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)


class _Runner:
    """Stands in for the model: records each batch, fails the batches asked to."""

    def __init__(self, fail_first: int = 0) -> None:
        self.batches: list[list[int]] = []
        self.fail_first = fail_first

    def pool(self, token_ids):
        self.batches.append([len(t) for t in token_ids])
        if len(self.batches) <= self.fail_first:
            raise RuntimeError("out of memory")
        return torch.tensor([[float(len(t))] * 2 for t in token_ids])


def _request(request_id: str, length: int) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1] * length, SamplingParams(), 0.0)


def _core(config, runner: _Runner) -> PoolingEngineCore:
    return PoolingEngineCore(config, runner_factory=lambda _: runner)


def test_the_core_batches_in_arrival_order_and_finishes_each_input(config):
    runner = _Runner()
    core = _core(config, runner)
    for i, length in enumerate([10, 20, 30, 5, 5]):
        core.add_request(_request(f"r{i}", length))
    core.abort_requests(["r4"])
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step().outputs
    assert runner.batches == [[10, 20], [30, 5]]  # at most 64 padded tokens, in order
    assert [o.request_id for o in outputs] == ["r0", "r1", "r2", "r3"]
    assert all(o.finish_reason == FinishReason.STOP for o in outputs)
    assert [o.pooled for o in outputs][:2] == [[10.0, 10.0], [20.0, 20.0]]


def test_a_failed_batch_fails_its_requests_only(config):
    runner = _Runner(fail_first=1)
    core = _core(config, runner)
    for i in range(3):
        core.add_request(_request(f"r{i}", 30))
    first, second = core.step().outputs, core.step().outputs
    assert [o.request_id for o in first] == ["r0", "r1"]
    assert all(o.pooled is None and o.finish_reason == FinishReason.ABORT for o in first)
    assert first[0].stop_reason.startswith(POOLING_FAILURE_PREFIX + "RuntimeError: out of")
    assert second[0].pooled == [30.0, 30.0]  # the engine kept serving


def test_the_offline_engine_raises_a_failed_forward_pass(config):
    engine = EmbeddingEngine.__new__(EmbeddingEngine)
    engine.model_config = config.model_config
    engine.engine_core = _core(config, _Runner(fail_first=1))
    engine._counter = iter(range(100))
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.pool([[1, 2, 3]])
    assert not engine.engine_core.has_unfinished_requests()


@pytest.mark.slow
def test_the_server_engine_embeds_in_its_own_process(config, engine):
    """AsyncEmbeddingEngine's engine process pools what the offline core pools; a
    cancelled call is aborted there and the others are answered."""
    front = AsyncEmbeddingEngine(dataclasses.replace(config))
    try:
        assert front.engine_proc.is_alive()
        token_ids = [engine.front_end.tokenize(s) for s in SENTENCES[:5]]

        async def run():
            cancelled = asyncio.ensure_future(front.embed(token_ids))
            await asyncio.sleep(0)
            cancelled.cancel()
            return await asyncio.gather(*(front.embed([t]) for t in token_ids))

        results = asyncio.run(run())
        expected = engine.pool(token_ids)
        for i, rows in enumerate(results):
            assert rows.shape == (1, 384)
            torch.testing.assert_close(rows[0], expected[i], atol=1e-5, rtol=0)
    finally:
        front.shutdown()
    assert not front.engine_proc.is_alive()

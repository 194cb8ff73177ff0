"""The embedding engine: batch planning under the token budget, and the asyncio front that
batches concurrent requests into one forward pass."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.model.minilm import SENTENCES, minilm_folder
from tokenmill.engine.async_llm import EngineDeadError
from tokenmill.engine.embedding_engine import AsyncEmbeddingEngine, EmbeddingEngine, plan_batches
from tokenmill.engine_args import EngineArgs


@given(
    st.lists(st.integers(1, 300), max_size=40),
    st.integers(1, 1024),
    st.integers(1, 16),
)
def test_plan_batches_respects_the_budget(lengths, max_tokens, max_seqs):
    batches = plan_batches(lengths, max_tokens, max_seqs)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert 1 <= len(batch) <= max_seqs
        padded = len(batch) * max(lengths[i] for i in batch)
        assert padded <= max_tokens or len(batch) == 1


def test_plan_batches_groups_similar_lengths():
    assert plan_batches([5, 100, 6, 90], max_tokens=200, max_seqs=8) == [[1, 3], [2, 0]]


@pytest.fixture(scope="module")
def engine() -> EmbeddingEngine:
    # A small budget: the 10 sentences need several padded batches.
    args = EngineArgs(model=minilm_folder(), max_num_batched_tokens=64, max_num_seqs=4)
    return EmbeddingEngine(args.create_engine_config())


def test_small_budget_gives_the_same_embeddings(engine):
    token_ids = [engine.tokenize(s) for s in SENTENCES]
    assert len(plan_batches([len(t) for t in token_ids], 64, 4)) > 3
    together = engine.pool(token_ids)
    alone = torch.cat([engine.pool([t]) for t in token_ids])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)


class _CountingEngine:
    """Wraps an EmbeddingEngine, recording each pool() call's inputs."""

    def __init__(self, engine: EmbeddingEngine) -> None:
        self.inner = engine
        self.model_config = engine.model_config
        self.tokenizer = engine.tokenizer
        self.calls: list[int] = []

    def pool(self, token_ids):
        self.calls.append(len(token_ids))
        return self.inner.pool(token_ids)

    def shutdown(self) -> None:
        pass


def test_concurrent_requests_share_one_forward_pass(engine):
    counting = _CountingEngine(engine)
    front = AsyncEmbeddingEngine(engine.config, engine=counting)  # type: ignore[arg-type]
    token_ids = [engine.tokenize(s) for s in SENTENCES[:5]]

    async def run():
        return await asyncio.gather(*(front.embed([t]) for t in token_ids))

    results = asyncio.run(run())
    assert counting.calls == [5]
    expected = engine.pool(token_ids)
    for i, rows in enumerate(results):
        assert rows.shape == (1, 384)
        torch.testing.assert_close(rows[0], expected[i])
    front.shutdown()
    with pytest.raises(EngineDeadError):
        front.check_health()


def test_cancelled_request_is_skipped(engine):
    counting = _CountingEngine(engine)
    front = AsyncEmbeddingEngine(engine.config, engine=counting)  # type: ignore[arg-type]
    ids = engine.tokenize("hello")

    async def run():
        cancelled = asyncio.ensure_future(front.embed([ids, ids]))
        kept = asyncio.ensure_future(front.embed([ids]))
        await asyncio.sleep(0)  # both queued, the batch not yet run
        cancelled.cancel()
        return await kept

    rows = asyncio.run(run())
    assert counting.calls == [1] and rows.shape == (1, 384)
    front.shutdown()


def test_failed_forward_fails_its_requests_only(engine):
    class Failing(_CountingEngine):
        def pool(self, token_ids):
            raise RuntimeError("out of memory")

    front = AsyncEmbeddingEngine(engine.config, engine=Failing(engine))  # type: ignore[arg-type]

    async def run():
        with pytest.raises(RuntimeError, match="out of memory"):
            await front.embed([engine.tokenize("hello")])
        front.check_health()  # the engine keeps serving

    asyncio.run(run())
    front.shutdown()

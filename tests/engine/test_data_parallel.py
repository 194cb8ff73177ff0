"""Data parallelism: ``-dp 2`` runs two engine cores behind one front end; concurrent
requests are spread over both and each gets the tokens one engine gives it."""

from __future__ import annotations

import asyncio

import pytest

from tests.distributed.models import ENGINE, PROMPTS, save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.async_llm import AsyncLLM, merge_engine_stats
from tokenmill.engine_args import EngineArgs

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_merged_stats_sum_the_cores_gauges():
    from tokenmill.core.engine_io import SchedulerStats

    a = SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.5,
                       num_free_blocks=10, num_total_blocks=20, prefix_cache_queries=7)
    b = SchedulerStats(num_running_reqs=3, kv_cache_usage=0.25, num_free_blocks=15,
                       num_total_blocks=20, prefix_cache_queries=4)
    merged = merge_engine_stats([a, b], b)
    assert (merged.num_running_reqs, merged.num_waiting_reqs) == (5, 1)
    assert merged.kv_cache_usage == 0.375 and merged.num_free_blocks == 25
    assert merged.prefix_cache_queries == 4  # a delta: this step's only


def test_two_engine_cores_serve_concurrent_requests(tmp_path, smollm2_gguf_path):
    path = save_tiny_model("llama", tmp_path)
    one = LLM(path, tokenizer=smollm2_gguf_path, **ENGINE)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS * 2]
    expected = [list(o.outputs[0].token_ids) for o in one.generate(prompts, GREEDY)]
    one.llm_engine.shutdown()

    config = EngineArgs(
        model=path, tokenizer=smollm2_gguf_path, data_parallel_size=2, **ENGINE
    ).create_engine_config("server")
    engine = AsyncLLM(config)
    served_by: dict[str, set[int]] = {}
    process = engine._process_outputs

    def record(outputs):
        for out in outputs.outputs:
            served_by.setdefault(out.request_id, set()).add(outputs.engine_index)
        process(outputs)

    engine._process_outputs = record

    async def run_one(i: int, prompt) -> list[int]:
        final = None
        async for out in engine.generate(prompt, GREEDY, request_id=f"r{i}"):
            final = out
        return list(final.outputs[0].token_ids)

    async def run_all() -> list[list[int]]:
        try:
            return await asyncio.gather(*(run_one(i, p) for i, p in enumerate(prompts)))
        finally:
            engine.shutdown()

    assert asyncio.run(run_all()) == expected
    engines = set().union(*served_by.values())
    assert engines == {0, 1}, f"requests went to engine cores {engines} only"
    assert all(len(e) == 1 for e in served_by.values())  # a request stays on its core

"""The Ray executor: tensor parallelism over two Ray actors of a local Ray cluster that the
test starts, generating the greedy tokens of one process."""

from __future__ import annotations

import pytest

from tests.distributed.models import ENGINE, PROMPTS, save_tiny_model
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_ray_tensor_parallel_generates_the_tokens_of_one_process(
    tmp_path, smollm2_gguf_path, monkeypatch
):
    path = save_tiny_model("qwen3", tmp_path)
    one = LLM(path, tokenizer=smollm2_gguf_path, **ENGINE)
    expected = _tokens(one)
    one.llm_engine.shutdown()

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    try:
        llm = LLM(
            path, tokenizer=smollm2_gguf_path, tensor_parallel_size=2,
            distributed_executor_backend="ray", **ENGINE,
        )  # fmt: skip
        try:
            assert _tokens(llm) == expected
            # One bundle (CPU) per rank, in one placement group.
            executor = llm.llm_engine.engine_core.executor
            assert executor.placement_group.bundle_specs == [{"CPU": 1}, {"CPU": 1}]
        finally:
            llm.llm_engine.shutdown()
    finally:
        ray.shutdown()

"""The Ray executor on a local Ray cluster that the tests start: tensor parallelism over two
Ray actors generates the greedy tokens of one process, and an actor that dies mid-generation
fails the generation with the engine's error within seconds instead of leaving the other
rank waiting in a collective."""

from __future__ import annotations

import threading
import time

import pytest

from tests.distributed.models import ENGINE, PROMPTS, save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.executor.multiproc import WorkerDiedError

pytestmark = pytest.mark.slow

ray = pytest.importorskip("ray")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _tokens(llm: LLM, params: SamplingParams = GREEDY, copies: int = 1) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS * copies]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def ray_cluster():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("RAY_ADDRESS", raising=False)
        ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
        try:
            yield
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory) -> str:
    return save_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"))


def _ray_llm(path: str, tokenizer: str) -> LLM:
    return LLM(
        path, tokenizer=tokenizer, tensor_parallel_size=2, distributed_executor_backend="ray",
        **ENGINE,
    )  # fmt: skip


def test_ray_tensor_parallel_generates_the_tokens_of_one_process(
    qwen3_path, smollm2_gguf_path, ray_cluster
):
    one = LLM(qwen3_path, tokenizer=smollm2_gguf_path, **ENGINE)
    expected = _tokens(one)
    one.llm_engine.shutdown()
    llm = _ray_llm(qwen3_path, smollm2_gguf_path)
    try:
        assert _tokens(llm) == expected
        # One bundle (CPU) per rank, in one placement group.
        executor = llm.llm_engine.engine_core.executor
        assert executor.placement_group.bundle_specs == [{"CPU": 1}, {"CPU": 1}]
    finally:
        llm.llm_engine.shutdown()


def test_a_dead_actor_fails_generation_within_seconds(qwen3_path, smollm2_gguf_path, ray_cluster):
    llm = _ray_llm(qwen3_path, smollm2_gguf_path)
    try:
        _tokens(llm)  # warm: both ranks have run steps
        actor = llm.llm_engine.engine_core.executor.actors[1]
        killer = threading.Timer(1.0, lambda: ray.kill(actor, no_restart=True))
        long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        killer.start()
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="Ray actor of the engine died"):
            _tokens(llm, long, copies=4)
        assert time.monotonic() - start < 30.0
        with pytest.raises(WorkerDiedError):  # and every later call, at once
            _tokens(llm)
    finally:
        llm.llm_engine.shutdown()

"""Tensor, pipeline and expert parallelism on CUDA (NCCL, one process per GPU): greedy
tokens equal one GPU's, in float32, with CUDA graphs (their captures hold the all-reduces)
and eagerly.

Needs 2 CUDA devices, and ``M135`` (SmolLM2-135M's config and tokenizer folder; its
tokenizer decodes the tiny models' ids).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed.models import ENGINE, PROMPTS, save_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "tp2-eager": dict(tensor_parallel_size=2, enforce_eager=True),
    "pp2": dict(pipeline_parallel_size=2),
    "tp2-ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
}
CASES = [
    ("llama", "tp2"), ("llama", "tp2-eager"), ("llama", "pp2"),
    ("qwen3", "tp2"), ("mixtral", "tp2"), ("mixtral", "tp2-ep"), ("qwen3_moe", "tp2-ep"),
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer() -> str:
    path = os.environ.get("M135")
    if not path or not os.path.isdir(path):
        pytest.skip("set M135 to a SmolLM2-135M config + tokenizer folder")
    return path


def _generate(path: str, tokenizer: str, **layout) -> list[list[int]]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(path, tokenizer=tokenizer, device="cuda", **ENGINE, **layout)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("model, layout", CASES, ids=[f"{m}-{lay}" for m, lay in CASES])
def test_layout_generates_the_tokens_of_one_gpu(model, layout, tokenizer, tmp_path):
    path = save_tiny_model(model, tmp_path)
    assert _generate(path, tokenizer, **LAYOUTS[layout]) == _generate(path, tokenizer)

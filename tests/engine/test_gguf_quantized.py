"""The embedded SmolLM2 (Q4_1 GGUF) with its weights kept in their blocks against the float32
path (weights dequantized at load): greedy output, and the weights' memory."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Write a sentence about the sea. Please be brief and clear.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
ENGINE = dict(kv_cache_memory=64 << 20, max_model_len=512, max_num_seqs=8)


def _weight_bytes(llm: LLM) -> int:
    return llm.llm_engine.engine_core.executor.worker.model_runner.model_weight_bytes()


@pytest.fixture(scope="module")
def float_path(smollm2_gguf_path):
    llm = LLM(smollm2_gguf_path, gguf_dequantize=True, **ENGINE)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    weights = _weight_bytes(llm)
    llm.llm_engine.shutdown()
    return tokens, weights


@pytest.fixture(scope="module")
def quantized(smollm2_gguf_path):
    return LLM(smollm2_gguf_path, **ENGINE)


def test_greedy_output_equals_float_path(quantized, float_path):
    """At least 30 of 32 greedy tokens equal, position by position, on each prompt (the
    products run in bfloat16: a position whose two best float32 logits are closer than
    bfloat16's rounding may differ, and the text after it)."""
    reference, _ = float_path
    out = quantized.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, o, ref in zip(PROMPTS, out, reference, strict=True):
        same = sum(a == b for a, b in zip(o.outputs[0].token_ids, ref, strict=True))
        assert same >= 30, (prompt, same)


def test_weights_stay_near_the_file_size(quantized, float_path, smollm2_gguf_path):
    import os

    _, float_bytes = float_path
    quant_bytes = _weight_bytes(quantized)
    assert quant_bytes < 0.25 * float_bytes
    assert quant_bytes < 1.5 * os.path.getsize(smollm2_gguf_path)
    assert quantized.llm_engine.engine_core.config.model_config.quantization == "gguf"

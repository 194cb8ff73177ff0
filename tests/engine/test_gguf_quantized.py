"""The embedded SmolLM2 (Q4_1 GGUF) with its weights kept in their blocks against the float32
path (weights dequantized at load): greedy output, and the weights' memory; with and without
the bfloat16 copy that products of many rows (the prompts here) run on, and on the native
block product where it runs."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu import block_gemm

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Write a sentence about the sea. Please be brief and clear.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
ENGINE = dict(kv_cache_memory=64 << 20, max_model_len=512, max_num_seqs=8)
# bfloat16 products against float32 ones (activations rounded to bfloat16, and either the
# group scales or, in the bfloat16 copy, the weights themselves: relative error 2^-9): the
# chosen token's log-probability moves by a few hundredths; two candidates closer than
# NEAR_TIE may swap.
LOGPROB_TOL = 0.15
NEAR_TIE = 0.1


def _weight_bytes(llm: LLM) -> int:
    return llm.llm_engine.engine_core.executor.worker.model_runner.model_weight_bytes()


@pytest.fixture(scope="module")
def float_path(smollm2_gguf_path):
    llm = LLM(smollm2_gguf_path, gguf_dequantize=True, **ENGINE)
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    weights = _weight_bytes(llm)
    llm.llm_engine.shutdown()
    return outputs, weights


@pytest.fixture(scope="module", params=["off", "on"])
def quantized(request, smollm2_gguf_path):
    llm = LLM(smollm2_gguf_path, kernel_config={"cpu_bf16_weights": request.param}, **ENGINE)
    yield llm
    llm.llm_engine.shutdown()


def _top2(logprobs: dict) -> list[tuple[int, float]]:
    return sorted(((t, lp.logprob) for t, lp in logprobs.items()), key=lambda kv: -kv[1])[:2]


def test_greedy_output_equals_float_path(quantized, float_path):
    """Greedy tokens equal the float32 path's until a position where the float path's two
    best candidates are within NEAR_TIE nats (bfloat16 rounding may swap them; the text after
    it then differs). There the quantized path picks the float path's runner-up; before it
    each chosen token's log-probability is within LOGPROB_TOL of the float path's."""
    reference, _ = float_path
    out = quantized.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, o, ref in zip(PROMPTS, out, reference, strict=True):
        got = o.outputs[0]
        for i, (a, b) in enumerate(zip(got.token_ids, ref.token_ids, strict=True)):
            (best, lp_best), (second, lp_second) = _top2(ref.logprobs[i])
            if a != b:
                assert lp_best - lp_second < NEAR_TIE and a == second, (prompt, i)
                break
            assert abs(got.logprobs[i][a].logprob - lp_best) < LOGPROB_TOL, (prompt, i)


@pytest.mark.skipif(not block_gemm.available(), reason="native block product not built here")
def test_native_block_product_gives_the_float_path_greedy_output(quantized, float_path):
    """The native block product (two int8 digits per activation, exact to ~2^-16 of a
    block's largest) keeps every greedy token of the float32 path and each chosen token's
    log-probability within 0.02 of it; without the bfloat16 copy nothing rounds to
    bfloat16."""
    if quantized.llm_engine.engine_core.config.kernel_config.cpu_bf16_weights != "off":
        pytest.skip("the bfloat16 copy rounds the prompt's products")
    reference, _ = float_path
    out = quantized.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, o, ref in zip(PROMPTS, out, reference, strict=True):
        got = o.outputs[0]
        assert got.token_ids == ref.token_ids, prompt
        for i, a in enumerate(got.token_ids):
            assert abs(got.logprobs[i][a].logprob - ref.logprobs[i][a].logprob) < 0.02, prompt


def test_weights_stay_near_the_file_size(quantized, float_path, smollm2_gguf_path):
    import os

    _, float_bytes = float_path
    quant_bytes = _weight_bytes(quantized)
    if quantized.llm_engine.engine_core.config.kernel_config.cpu_bf16_weights == "on":
        # The blocks' int4 planes plus two bytes per weight, all counted.
        assert 0.5 * float_bytes < quant_bytes < 0.25 * float_bytes + 0.5 * float_bytes + 1e6
        return
    assert quant_bytes < 0.25 * float_bytes
    assert quant_bytes < 1.5 * os.path.getsize(smollm2_gguf_path)
    assert quantized.llm_engine.engine_core.config.model_config.quantization == "gguf"


def test_output_does_not_depend_on_the_batch(quantized):
    """Each prompt alone and beside a longer one (whose context is longer at every decode
    step): the same tokens with the same log-probabilities, to the bit."""
    companion = "Hello there, how are you doing today my friend? " * 3
    alone = [quantized.generate(p, GREEDY, use_tqdm=False)[0].outputs[0] for p in PROMPTS]
    for prompt, ref in zip(PROMPTS, alone, strict=True):
        got = quantized.generate([prompt, companion], GREEDY, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == ref.token_ids, prompt
        assert got.logprobs == ref.logprobs, prompt

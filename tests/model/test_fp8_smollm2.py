"""The real SmolLM2-135M-Instruct with ``--quantization fp8`` (its GGUF weights dequantized,
then quantized to FP8 per channel at load) and with an FP8 KV cache: greedy choices agree
with the float32 model's at most of 32 positions."""

from __future__ import annotations

import pytest
import torch

from tests.model.paged import PagedRunner

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]

pytestmark = pytest.mark.slow


def _greedy(model, hf_config, prompts: dict[str, list[int]], steps: int) -> dict[str, list[int]]:
    runner = PagedRunner(model, hf_config, num_blocks=64)
    seqs = {p: list(v) for p, v in prompts.items()}
    chunks = dict(seqs)
    for _ in range(steps):
        logits = runner.step(chunks, seqs)
        ends = torch.tensor([len(c) for c in chunks.values()]).cumsum(0) - 1
        next_ids = logits[ends].argmax(-1).tolist()
        chunks = {}
        for p, tok in zip(list(seqs), next_ids, strict=True):
            seqs[p] = seqs[p] + [tok]
            chunks[p] = [tok]
    return {p: seqs[p][len(prompts[p]):] for p in seqs}


def _agreement(model, hf_config, prompts, expected, **runner_kwargs) -> dict[str, int]:
    """Positions of ``expected`` (continuations of ``prompts``) where ``model``'s greedy
    choice, given the tokens before, is the expected token."""
    full = {p: prompts[p] + expected[p][:-1] for p in prompts}
    logits = PagedRunner(model, hf_config, num_blocks=64, **runner_kwargs).step(full, full)
    start, agree = 0, {}
    for p in prompts:
        n = len(prompts[p])
        chosen = logits[start + n - 1 : start + len(full[p])].argmax(-1).tolist()
        start += len(full[p])
        agree[p] = sum(a == b for a, b in zip(chosen, expected[p], strict=True))
    return agree


@pytest.fixture(scope="module")
def float_continuations(smollm2_model, smollm2_tokenizer):
    model, model_config = smollm2_model
    prompts = {p: smollm2_tokenizer(p)["input_ids"] for p in PROMPTS}
    return prompts, _greedy(model, model_config.hf_config, prompts, 32)


def test_fp8_weights_greedy_agrees_with_float32(smollm2_gguf_path, float_continuations):
    """The float32 model's greedy continuations, fed to the FP8 model: its own greedy choice
    agrees at most of the 32 positions (a continuation compared token by token would drift
    apart after the first near-tie that FP8 rounding flips)."""
    from tokenmill.config import LoadConfig
    from tokenmill.engine_args import EngineArgs
    from tokenmill.model.attention.torch_ref import TorchAttentionBackend
    from tokenmill.model.loader.model_loader import get_model

    cfg = EngineArgs(model=smollm2_gguf_path, dtype="float32", device="cpu",
                     quantization="fp8").create_engine_config()
    fp8 = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend)
    assert any(type(m.quant_method).__name__ == "Fp8LinearMethod" for m in fp8.modules()
               if getattr(m, "quant_method", None) is not None)
    prompts, expected = float_continuations
    agree = _agreement(fp8, cfg.model_config.hf_config, prompts, expected)
    assert min(agree.values()) >= 28, agree


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_cache_greedy_agrees_with_float32(smollm2_model, float_continuations, kv_dtype):
    model, model_config = smollm2_model
    prompts, expected = float_continuations
    try:
        agree = _agreement(model, model_config.hf_config, prompts, expected, kv_dtype=kv_dtype)
    finally:
        PagedRunner(model, model_config.hf_config, num_blocks=1)  # float caches for the rest
    assert min(agree.values()) >= 28, agree

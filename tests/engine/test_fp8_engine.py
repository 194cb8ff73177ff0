"""The engine on CPU with FP8 weights (a vLLM ``fp8`` checkpoint carrying per-layer KV-cache
scales) and an FP8 KV cache: the scales reach the attention layers, the cache holds four times
the float32 cache's tokens in the same memory, and requests run to the end with prefix
caching and every block freed."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model.fp8_checkpoints import make_fp8_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.model.layers.attention import Attention

pytestmark = pytest.mark.slow

ENGINE = dict(kv_cache_memory=8 << 20, max_model_len=256, max_num_seqs=4, dtype="float32",
              device="cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(100, 140))},
           {"prompt_token_ids": list(range(100, 120)) + list(range(300, 310))}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_tokenizer) -> str:
    folder = tmp_path_factory.mktemp("fp8-kv")
    quant, _ = make_fp8_checkpoint(str(folder), "fp8-dynamic", vocab_size=49152)
    path = f"{quant}/model.safetensors"
    tensors = load_file(path)
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(2.0)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.5)
        tensors[f"model.layers.{layer}.self_attn.q_scale"] = torch.tensor(1.0)
    save_file(tensors, path, metadata={"format": "pt"})
    smollm2_tokenizer.save_pretrained(quant)
    return quant


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def _manager(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.kv_cache_manager


def test_fp8_kv_cache_end_to_end(checkpoint):
    auto = LLM(checkpoint, **ENGINE)
    reference = [o.outputs[0].token_ids for o in auto.generate(PROMPTS, GREEDY, use_tqdm=False)]
    auto_blocks = auto.llm_engine.engine_core.config.cache_config.num_blocks
    auto.llm_engine.shutdown()

    llm = LLM(checkpoint, kv_cache_dtype="fp8", **ENGINE)
    layers = [m for m in _runner(llm).model.modules() if isinstance(m, Attention)]
    assert [(m.k_scale, m.v_scale) for m in layers] == [(2.0, 0.5)] * 2
    assert all(m.kv_cache.dtype == torch.float8_e4m3fn for m in layers)
    # One byte per element instead of float32's four, in the same memory.
    assert llm.llm_engine.engine_core.config.cache_config.num_blocks == 4 * auto_blocks
    for _ in range(2):  # the second pass hits the prefix cache
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [12, 12]
        manager = _manager(llm)
        manager.check_integrity()
        assert manager.usage == 0.0
    # A random model's logits are nearly flat: FP8 rounding may flip some greedy choices.
    same = sum(a == b for o, ref in zip(out, reference, strict=True)
               for a, b in zip(o.outputs[0].token_ids, ref, strict=True))
    assert same >= 12, (same, [o.outputs[0].token_ids for o in out], reference)
    llm.llm_engine.shutdown()

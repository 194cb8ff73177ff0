"""Cascade attention end to end on CPU: the engine with the Triton attention backend (run by
Triton's interpreter) on a tiny random Llama (SmolLM2's tokenizer; prompts as token ids).
Requests share a cached prompt prefix, and chunked prefill mixes prompt chunks with decodes.
Greedy tokens equal those with cascade off and those of the torch reference backend
(float32)."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter only (tests/gpu covers CUDA)", allow_module_level=True)

from tests.engine.prefix_probe import record_common_prefix_lens  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.model.attention import selector  # noqa: E402
from tokenmill.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tokenmill.worker import cascade, model_runner  # noqa: E402


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def _generate(path, tokenizer, prompts, backend, monkeypatch, **kwargs):
    monkeypatch.setattr(model_runner, "get_attn_backend", lambda device, use_mla=False: backend)
    llm = LLM(
        path, tokenizer=tokenizer, max_model_len=256, max_num_seqs=16,
        max_num_batched_tokens=32, kv_cache_memory=16 << 20, **kwargs,
    )  # fmt: skip
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompts[0][:PREFIX]}, params, use_tqdm=False)  # cached
    seen = record_common_prefix_lens(runner, monkeypatch)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], seen


PREFIX = 72  # tokens: 4 full blocks and a partial one


@pytest.mark.slow
def test_cascade_attention_in_the_engine(tiny_llama, smollm2_gguf_path, monkeypatch):
    # This prefix and batch are far below the GPU's profitability bars.
    monkeypatch.setattr(cascade, "CASCADE_MIN_DECODES", 4)
    monkeypatch.setattr(cascade, "CASCADE_MIN_PREFIX_TOKENS", 32)
    monkeypatch.setattr(cascade, "CASCADE_MIN_SAVED_TOKENS", 0)
    monkeypatch.setattr(cascade, "CASCADE_MIN_SAVED_TOKENS_WITHOUT_GRAPH", 0)
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(5, 320, (PREFIX,), generator=gen).tolist()
    prompts = [prefix + torch.randint(5, 320, (2 + i,), generator=gen).tolist()
               for i in range(6)]  # fmt: skip
    triton = TritonAttentionBackend
    args = (tiny_llama, smollm2_gguf_path, prompts)
    cascade_out, seen = _generate(*args, triton, monkeypatch)
    plain_out, seen_plain = _generate(*args, triton, monkeypatch, disable_cascade_attn=True)
    torch_out, _ = _generate(*args, selector.get_attn_backend("cpu"), monkeypatch)
    assert any(seen) and not any(seen_plain)
    assert max(seen) == 64  # the prefix's full blocks
    assert cascade_out == plain_out == torch_out

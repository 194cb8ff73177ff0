"""Lazily zeroed CPU tensors (the CPU KV cache's storage)."""

from __future__ import annotations

import gc

import pytest
import torch

from tokenmill.worker.host_memory import lazily_zeroed_cpu_tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zeros_of_the_shape_and_dtype_that_outlive_their_map(dtype: torch.dtype) -> None:
    shape = (2, 7, 16, 3, 64)
    t = lazily_zeroed_cpu_tensor(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0
    gc.collect()
    assert not t.any()
    t[1, 6, 15] = 1.5
    other = lazily_zeroed_cpu_tensor(shape, dtype)
    assert t.sum().item() == 1.5 * 3 * 64 and not other.any()


def test_empty_shape() -> None:
    assert lazily_zeroed_cpu_tensor((0, 4), torch.float32).shape == (0, 4)


def test_a_cpu_kv_cache_larger_than_the_memory_is_refused_at_start(tmp_path, smollm2_gguf_path):
    import json

    from tokenmill import LLM
    from tokenmill.config import ConfigError

    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vocab_size": 49152,
        "intermediate_size": 32,
        "max_position_embeddings": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="memory is available; lower --kv-cache-memory"):
        LLM(str(tmp_path), tokenizer=smollm2_gguf_path, load_format="dummy", kv_cache_memory=2**50)

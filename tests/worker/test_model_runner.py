"""ModelRunner set-up: the profiling pass leaves no scratch KV cache behind."""

from __future__ import annotations

import torch

from tokenmill.engine_args import EngineArgs
from tokenmill.model.layers.attention import Attention
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.start_up_passes import profile_run


def _runner(tmp_path) -> ModelRunner:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    engine = EngineArgs(
        model=str(tmp_path), max_num_batched_tokens=512, max_num_seqs=4
    ).create_engine_config()
    runner = ModelRunner(engine, torch.device("cpu"))
    runner.load_model()
    return runner


def test_profile_run_releases_its_scratch_cache(tmp_path):
    runner = _runner(tmp_path)
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    assert profile_run(runner) == 0  # no peak accounting off CUDA
    assert all(layer.kv_cache is None for layer in layers)
    assert runner.kv_caches == []

    runner.initialize_kv_cache(8)
    caches = list(runner.kv_caches)
    profile_run(runner)
    assert [layer.kv_cache for layer in layers] == caches
    assert runner.model_weight_bytes() > 0

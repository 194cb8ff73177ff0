"""ModelRunner set-up: the profiling pass leaves no scratch KV cache behind; when cascade
attention is on."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine_args import EngineArgs
from tokenmill.model.attention.torch_ref import TorchAttentionBackend
from tokenmill.model.layers.attention import Attention
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.start_up_passes import profile_run


def _runner(tmp_path, sliding_window: int | None = None, **engine_kwargs) -> ModelRunner:
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    shape = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=256,
    )  # fmt: skip
    if sliding_window:
        config = MistralConfig(sliding_window=sliding_window, **shape)
    else:
        config = LlamaConfig(**shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    engine = EngineArgs(
        model=str(tmp_path), max_num_batched_tokens=512, max_num_seqs=4, **engine_kwargs
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


@pytest.mark.parametrize(
    "kwargs,expected",
    [({}, True), ({"disable_cascade_attn": True}, False), ({"sliding_window": 64}, False)],
)
def test_cascade_attention_needs_backend_flag_and_a_full_attention_layer(
    tmp_path, monkeypatch, kwargs, expected
):
    monkeypatch.setattr(TorchAttentionBackend, "supports_cascade", True)
    assert _runner(tmp_path, **kwargs).cascade_attn is expected
    monkeypatch.setattr(TorchAttentionBackend, "supports_cascade", False)
    assert _runner(tmp_path / "plain").cascade_attn is False

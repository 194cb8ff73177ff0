"""Llama 4 text against transformers on tiny random configs (float32, CPU): chunked local
attention on the RoPE layers (chunks of 16, shorter than the prompts), a NoPE layer with
attention temperature tuning (a floor scale of 8, so the scale changes within a prompt),
QK-norm, interleaved MoE layers with a shared expert and sigmoid routing (top-1 as
released, and top-2), llama3 RoPE scaling. Logits of a mixed paged batch, and greedy
decoding through the engine (prefix caching, preemption); a Llama4ForConditionalGeneration
checkpoint loads its language model."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.model.engine_parity import assert_engine_greedy_matches
from tests.model.test_qwen3_parity import TINY, mixed_batch_logits, save_random_model
from tests.model.tolerance import assert_logits_close

LLAMA4 = dict(
    TINY, num_hidden_layers=4, head_dim=16, intermediate_size=32, intermediate_size_mlp=96,
    num_local_experts=4, interleave_moe_layer_step=2, no_rope_layers=[1, 1, 1, 0],
    attention_chunk_size=16, use_qk_norm=True, attn_temperature_tuning=True, floor_scale=8,
    attn_scale=0.1,
    rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                     "rope_theta": 5e5},
)  # fmt: skip
SCALE = {"router.weight": 40.0, "lm_head": 20.0}


def _configs():
    from transformers import Llama4TextConfig

    return {
        "llama4-top1": Llama4TextConfig(**LLAMA4, num_experts_per_tok=1),
        "llama4-top2-no-qk-norm": Llama4TextConfig(
            **dict(LLAMA4, use_qk_norm=False, interleave_moe_layer_step=1),
            num_experts_per_tok=2,
        ),
    }


@pytest.fixture(scope="module", params=list(_configs()))
def saved_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return save_random_model(_configs()[request.param], path, SCALE), str(path)


def _load(path: str):
    from tokenmill.config import LoadConfig
    from tokenmill.engine_args import EngineArgs
    from tokenmill.model.attention.torch_ref import TorchAttentionBackend
    from tokenmill.model.loader.model_loader import get_model

    cfg = EngineArgs(model=path, dtype="float32", device="cpu").create_engine_config()
    return get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend)


def test_mixed_batch_matches_transformers(saved_model):
    hf, path = saved_model
    logits, expected = mixed_batch_logits(hf, path)
    assert_logits_close(logits, expected)


def test_layer_structure(saved_model):
    from tokenmill.model.models.llama4 import Llama4MoE

    hf, path = saved_model
    layers = _load(path).model.layers
    assert [layer.self_attn.attn.attention_chunk_size for layer in layers] == [16, 16, 16, None]
    assert [layer.self_attn.use_rope for layer in layers] == [True, True, True, False]
    moe = [isinstance(layer.feed_forward, Llama4MoE) for layer in layers]
    assert moe == [i in hf.config.moe_layers for i in range(4)]
    assert any(moe) and (hf.config.interleave_moe_layer_step == 1 or not all(moe))


def test_conditional_generation_checkpoint_loads_its_language_model(saved_model, tmp_path):
    """The text weights under ``language_model.``, a vision tower beside them (skipped),
    the text settings in ``text_config``."""
    from safetensors.torch import load_file, save_file

    from tests.model.paged import PagedRunner

    hf, path = saved_model
    tensors = {f"language_model.{k}": v
               for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    tensors["vision_model.patch_embedding.linear.weight"] = torch.zeros(8, 4)
    tensors["multi_modal_projector.linear_1.weight"] = torch.zeros(8, 8)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)
    del text["architectures"]  # as in the released checkpoints' text_config
    config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
              "text_config": text, "vision_config": {"hidden_size": 8}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = _load(str(tmp_path))
    ids = {"a": list(range(5, 40))}
    logits = PagedRunner(model, model.config, num_blocks=8).step(ids, ids)
    with torch.no_grad():
        expected = hf(torch.tensor([ids["a"]])).logits[0]
    assert_logits_close(logits, expected)


@pytest.mark.slow
def test_engine_greedy_equals_transformers(saved_model, smollm2_gguf_path):
    hf, path = saved_model
    assert_engine_greedy_matches(hf, path, smollm2_gguf_path)

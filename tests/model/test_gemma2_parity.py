"""Gemma and Gemma 2: logits equal transformers' on random tiny configs (float32, CPU) —
Gemma 2 with attention and final soft caps, alternating sliding-window layers with a
window shorter than the prompts, and ``query_pre_attn_scalar`` — and greedy decoding
through the engine (prefix caching, preemption) equals transformers'."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.model.engine_parity import assert_engine_greedy_matches
from tests.model.test_qwen3_parity import TINY, mixed_batch_logits, save_random_model
from tests.model.tolerance import assert_logits_close


def _configs():
    from transformers import Gemma2Config, GemmaConfig

    return {
        # Multi-query attention, as Gemma 2B.
        "gemma": GemmaConfig(**dict(TINY, head_dim=16, num_key_value_heads=1)),
        "gemma2": Gemma2Config(
            **dict(TINY, num_hidden_layers=3), head_dim=16, sliding_window=8,
            query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        ),
    }


def _as_released_gemma_config(path: str) -> None:
    """Gemma's released configs say ``hidden_act: "gelu"`` and mean tanh GELU."""
    with open(os.path.join(path, "config.json")) as f:
        data = json.load(f)
    data["hidden_act"] = "gelu"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(data, f)


@pytest.fixture(scope="module", params=["gemma", "gemma2"])
def saved_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random_model(_configs()[request.param], path)
    if request.param == "gemma":
        _as_released_gemma_config(str(path))
    return hf, str(path)


def test_mixed_batch_matches_transformers(saved_model):
    hf, path = saved_model
    logits, expected = mixed_batch_logits(hf, path)
    assert_logits_close(logits, expected)


def test_layers_alternate_windows_and_cap_scores(saved_model):
    from tokenmill.config import LoadConfig
    from tokenmill.engine_args import EngineArgs
    from tokenmill.model.attention.torch_ref import TorchAttentionBackend
    from tokenmill.model.loader.model_loader import get_model

    hf, path = saved_model
    cfg = EngineArgs(model=path, dtype="float32", device="cpu").create_engine_config()
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend)
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    caps = [layer.self_attn.attn.impl.logits_soft_cap for layer in model.model.layers]
    if hf.config.model_type == "gemma2":
        assert windows == [8, None, 8]
        assert caps == [2.0, 2.0, 2.0]
    else:
        assert windows == [None, None] and caps == [None, None]


@pytest.mark.slow
def test_engine_greedy_equals_transformers(saved_model, smollm2_gguf_path):
    hf, path = saved_model
    assert_engine_greedy_matches(hf, path, smollm2_gguf_path)

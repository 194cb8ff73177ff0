"""Phi-3 logits equal transformers' on the same random weights (float32, CPU): fused qkv and
gate_up checkpoint tensors, LongRoPE with its short and long factors, and the older
``su``-typed config layout."""

from __future__ import annotations

import json
import os

import pytest

from tests.model.test_qwen3_parity import TINY, mixed_batch_logits, save_random_model
from tests.model.tolerance import assert_logits_close

HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]
# Phi3Config's default special-token ids (32000) lie outside the tiny vocabulary.
PHI3 = dict(TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _longrope(original: int) -> dict:
    half = HEAD_DIM // 4  # rotary_dim / 2 with partial_rotary_factor 0.5
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(half)],
        "long_factor": [1.5 + 0.5 * i for i in range(half)],
        "original_max_position_embeddings": original,
    }


def _config(name: str):
    from transformers import Phi3Config

    if name == "phi3":
        return Phi3Config(**PHI3, tie_word_embeddings=False)
    # Test sequences are 20..50 tokens. transformers picks the long factors when a sequence
    # is longer than the original context, tokenmill when max_model_len is: with an original
    # context of 64 (and max_model_len 64) both use the short factors, with 16 the long ones.
    original = 64 if name == "phi3-longrope-short" else 16
    return Phi3Config(
        **PHI3,
        original_max_position_embeddings=original,
        rope_scaling=_longrope(original),
        partial_rotary_factor=0.5,
        sliding_window=24 if name == "phi3-su-legacy-config" else None,
    )


def _rewrite_as_legacy_config(path: str) -> None:
    """Phi-3's pre-transformers-5 layout: ``rope_scaling`` of type "su" without the original
    context length, which sits at the top level only."""
    with open(os.path.join(path, "config.json")) as f:
        data = json.load(f)
    rope = data.pop("rope_parameters")
    data["rope_theta"] = rope["rope_theta"]
    data["rope_scaling"] = {
        "type": "su", "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(data, f)


CASES = {
    "phi3": {},
    "phi3-longrope-short": {"max_model_len": 64},
    "phi3-longrope-long": {},
    "phi3-su-legacy-config": {},
}


@pytest.fixture(scope="module", params=list(CASES))
def saved_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random_model(_config(request.param), path)
    if request.param == "phi3-su-legacy-config":
        _rewrite_as_legacy_config(str(path))
    return request.param, hf, str(path)


def test_checkpoint_has_fused_tensors(saved_model):
    from safetensors import safe_open

    _, _, path = saved_model
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)


def test_mixed_batch_matches_transformers(saved_model):
    name, hf, path = saved_model
    logits, expected = mixed_batch_logits(hf, path, **CASES[name])
    assert logits.shape == expected.shape
    assert_logits_close(logits, expected)

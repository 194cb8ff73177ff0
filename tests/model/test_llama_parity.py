"""Llama-family logits equal transformers' on the same weights (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.model.paged import PagedRunner
from tests.model.tolerance import assert_logits_close
from tokenmill.config import LoadConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.model.attention.torch_ref import TorchAttentionBackend
from tokenmill.model.loader.model_loader import get_model

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def _hf_configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    return {
        "llama3-rope": LlamaConfig(
            **TINY,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        "llama-tied-bias": LlamaConfig(**TINY, tie_word_embeddings=True, attention_bias=True),
        "mistral-sliding": MistralConfig(**TINY, sliding_window=24, head_dim=16),
        "qwen2": Qwen2Config(**TINY, tie_word_embeddings=False),
    }


@pytest.fixture(
    scope="module", params=["llama3-rope", "llama-tied-bias", "mistral-sliding", "qwen2"]
)
def saved_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    config = _hf_configs()[request.param]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, str(path)


def test_mixed_batch_matches_transformers(saved_model):
    hf, path = saved_model
    cfg = EngineArgs(model=path, dtype="float32", device="cpu").create_engine_config()
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend)
    runner = PagedRunner(model, cfg.model_config.hf_config, num_blocks=32)
    gen = torch.Generator().manual_seed(1)
    seqs = {
        "fresh": torch.randint(0, 320, (20,), generator=gen).tolist(),
        "decode": torch.randint(0, 320, (31,), generator=gen).tolist(),
        "chunk": torch.randint(0, 320, (50,), generator=gen).tolist(),
    }
    # Earlier steps: the decode sequence's first 30 tokens, the chunked one's first 37.
    runner.step({"decode": seqs["decode"][:30]}, seqs)
    runner.step({"chunk": seqs["chunk"][:37]}, seqs)
    # The mixed step: a fresh prompt, one decode token, a 13-token chunk after 37 cached.
    logits = runner.step(
        {"fresh": seqs["fresh"], "decode": seqs["decode"][30:], "chunk": seqs["chunk"][37:]}, seqs
    )
    with torch.no_grad():
        ref = {k: hf(torch.tensor([v])).logits[0] for k, v in seqs.items()}
    expected = torch.cat([ref["fresh"], ref["decode"][30:], ref["chunk"][37:]])
    assert logits.shape == expected.shape
    assert_logits_close(logits, expected)

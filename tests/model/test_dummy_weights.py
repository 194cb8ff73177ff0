"""``--load-format dummy`` for the architectures with sinks, soft caps, local attention and
experts: each builds from its config.json alone (no weight file), with random weights that
keep the logits finite; MXFP4 experts get valid FP4 codes and small scales."""

from __future__ import annotations

import json

import pytest
import torch

from tests.model.paged import PagedRunner

BASE = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=256,
            rms_norm_eps=1e-5)  # fmt: skip
CONFIGS = {
    "gpt-oss-mxfp4": dict(
        BASE, architectures=["GptOssForCausalLM"], model_type="gpt_oss", sliding_window=8,
        num_local_experts=4, num_experts_per_tok=2,
        quantization_config={"quant_method": "mxfp4"},
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
    ),
    "llama4": dict(
        BASE, architectures=["Llama4ForCausalLM"], model_type="llama4_text",
        intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, attention_chunk_size=16, no_rope_layers=[1, 0],
    ),
    "gemma": dict(BASE, architectures=["GemmaForCausalLM"], model_type="gemma",
                  hidden_act="gelu"),
    "gemma2": dict(BASE, architectures=["Gemma2ForCausalLM"], model_type="gemma2",
                   sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dummy_weights_run(name, tmp_path):
    from tokenmill.config import LoadConfig
    from tokenmill.engine_args import EngineArgs
    from tokenmill.model.attention.torch_ref import TorchAttentionBackend
    from tokenmill.model.loader.model_loader import get_model

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[name]))
    cfg = EngineArgs(model=str(tmp_path), load_format="dummy", device="cpu",
                     dtype="float32").create_engine_config()  # fmt: skip
    model = get_model(cfg.model_config, LoadConfig("dummy"), torch.device("cpu"),
                      TorchAttentionBackend)  # fmt: skip
    names = [n for n, _ in model.named_parameters()]
    assert any(n.endswith("experts.w13.blocks") for n in names) == ("mxfp4" in name)
    for param_name, param in model.named_parameters():
        if param_name.endswith(".scales"):
            assert 117 <= int(param.min()) and int(param.max()) < 120, param_name
    ids = {"a": list(range(1, 41)), "b": list(range(7, 30))}
    logits = PagedRunner(model, cfg.model_config.hf_config, num_blocks=16).step(ids, ids)
    assert logits.shape == (63, 320) and bool(logits.isfinite().all())

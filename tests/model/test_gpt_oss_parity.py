"""gpt-oss against transformers on tiny random checkpoints (float32, CPU): attention sinks,
alternating sliding-window layers (a window of 8, shorter than the prompts), YaRN RoPE,
biased router and experts with the clamped SwiGLU (a clamp of 0.5, which the activations
reach). Two checkpoints: unquantized experts (transformers' own save), and MXFP4 experts in
the released layout (``*_blocks [E, rows, K/32, 16]``, ``*_scales [E, rows, K/32]``,
``quantization_config.quant_method: mxfp4``), which transformers loads by dequantizing
them on the CPU. Logits of a mixed paged batch, the experts as loaded, and greedy decoding
through the engine (prefix caching, preemption) must all match.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.kernels.test_moe_mxfp4 import random_mxfp4
from tests.model.engine_parity import assert_engine_greedy_matches
from tests.model.test_qwen3_parity import mixed_batch_logits
from tests.model.tolerance import assert_logits_close

EXPERTS = 4


def _config():
    from transformers import GptOssConfig

    return GptOssConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=320, max_position_embeddings=256,
        sliding_window=8, num_local_experts=EXPERTS, num_experts_per_tok=2, swiglu_limit=0.5,
        rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0,
        },
    )  # fmt: skip


def _randomize(hf) -> None:
    """Norms, biases and sinks away from their constant inits; decisive routers."""
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.add_(noise * 0.1)
            elif name.endswith("sinks"):
                param.copy_(noise * 2)
            elif "bias" in name:
                param.copy_(noise * 0.05)
            elif "router.weight" in name:
                param.mul_(40.0)
            elif "lm_head" in name:
                param.mul_(20.0)


def save_dense(path: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_config(), attn_implementation="eager").float().eval()
    _randomize(hf)
    hf.save_pretrained(path)
    return hf


def save_mxfp4(dense_path: str, path: str):
    """The dense checkpoint with its experts replaced by random MXFP4 ones, saved as the
    released gpt-oss checkpoints are; transformers' model loaded back from it."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Mxfp4Config

    tensors = load_file(os.path.join(dense_path, "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows_k = tensors.pop(name).transpose(1, 2).shape  # [E, rows, K] as nn.Linear
        blocks, scales = random_mxfp4(*rows_k, gen=gen)
        tensors[f"{name}_blocks"] = blocks.view(*rows_k[:2], -1, 16)
        tensors[f"{name}_scales"] = scales
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dense_path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    # Dequantized on load: transformers' CPU path (its MXFP4 kernels come from the Hub).
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager",
        quantization_config=Mxfp4Config(dequantize=True),
    )  # fmt: skip
    return hf.eval()


@pytest.fixture(scope="module", params=["dense", "mxfp4"])
def saved_model(request, tmp_path_factory):
    dense = str(tmp_path_factory.mktemp("gpt-oss-dense"))
    hf = save_dense(dense)
    if request.param == "dense":
        return hf, dense
    path = str(tmp_path_factory.mktemp("gpt-oss-mxfp4"))
    return save_mxfp4(dense, path), path


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


def test_experts_load_as_transformers_dequantizes_them(saved_model):
    """Our gate rows then up rows (decoded, for MXFP4) equal transformers' interleaved
    ``gate_up_proj [E, H, 2I]`` columns; ``down_proj`` likewise; biases and sinks too."""
    from tokenmill.kernels.moe.mxfp4 import dequantize_mxfp4
    from tokenmill.model.layers.fused_moe import FusedMoE

    hf, path = saved_model
    model = _load(path)
    ours = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(ours) == 3
    for layer, moe in zip(hf.model.layers, ours, strict=True):
        ref = layer.mlp.experts
        w13, w2 = moe.w13, moe.w2
        if w13.mxfp4:
            w13_dense = dequantize_mxfp4(w13.blocks, w13.scales, torch.float32)
            w2_dense = dequantize_mxfp4(w2.blocks, w2.scales, torch.float32)
        else:
            w13_dense, w2_dense = w13.weight, w2.weight
        interleaved = torch.stack(w13_dense.chunk(2, dim=1), dim=2).flatten(1, 2)
        assert torch.equal(interleaved.transpose(1, 2), ref.gate_up_proj)
        assert torch.equal(w2_dense.transpose(1, 2), ref.down_proj)
        bias = torch.stack(w13.bias.chunk(2, dim=1), dim=2).flatten(1, 2)
        assert torch.equal(bias, ref.gate_up_proj_bias)
        assert torch.equal(w2.bias, ref.down_proj_bias)
    for ours_layer, ref_layer in zip(model.model.layers, hf.model.layers, strict=True):
        assert torch.equal(ours_layer.self_attn.sinks, ref_layer.self_attn.sinks)


def test_layer_types_windows_and_sinks(saved_model):
    _, path = saved_model
    model = _load(path)
    layers = model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [8, None, 8]
    assert all(layer.self_attn.attn.impl.sinks is layer.self_attn.sinks for layer in layers)


def test_other_quantization_is_refused(tmp_path):
    from tokenmill.hf_config import HFConfig, ModelLoadError
    from tokenmill.model.models.gpt_oss import experts_are_mxfp4

    with pytest.raises(ModelLoadError, match="'fp8' are not supported"):
        experts_are_mxfp4(HFConfig({"quantization_config": {"quant_method": "fp8"}}))
    assert experts_are_mxfp4(HFConfig({"quantization_config": {"quant_method": "mxfp4"}}))
    assert not experts_are_mxfp4(HFConfig({}))


@pytest.mark.slow
def test_engine_greedy_equals_transformers(saved_model, smollm2_gguf_path):
    hf, path = saved_model
    assert_engine_greedy_matches(hf, path, smollm2_gguf_path)

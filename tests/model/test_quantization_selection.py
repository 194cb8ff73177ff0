"""Which quantization runs: --quantization against the checkpoint's quantization_config; a
method or layout that is not implemented is refused at start-up in one line naming it."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill.config import ConfigError
from tokenmill.engine_args import EngineArgs

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
          "vocab_size": 320, "max_position_embeddings": 128}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
CT_W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
    "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                   "strategy": "group", "group_size": 128,
                                                   "symmetric": True},
                "input_activations": None}}}
FP8_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
               "dynamic": False}
FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
             "symmetric": True}


def _ct_fp8(weights=None, activations=FP8_TOKEN, fmt="float-quantized") -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {**FP8_WEIGHTS, **(weights or {})},
                    "input_activations": activations, "format": fmt}}, "ignore": ["lm_head"]}


def _folder(tmp_path, quantization_config=None) -> str:
    config = dict(CONFIG)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _resolve(tmp_path, qc=None, flag=None) -> str | None:
    args = EngineArgs(model=_folder(tmp_path, qc), quantization=flag, device="cpu")
    return args.create_engine_config().model_config.quantization


def _refused(tmp_path, qc=None, flag=None) -> str:
    with pytest.raises(ConfigError) as e:
        _resolve(tmp_path, qc, flag)
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("qc, expected", [
    (None, None),
    (GPTQ, "gptq"),
    ({**GPTQ, "checkpoint_format": "gptq_v2", "group_size": -1}, "gptq"),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
      "version": "gemm"}, "awq"),
    (CT_W4A16, "compressed-tensors"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "fp8"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
     "fp8"),
    (_ct_fp8(), "compressed-tensors"),
    (_ct_fp8({"strategy": "tensor"}, {**FP8_TOKEN, "strategy": "tensor", "dynamic": False}),
     "compressed-tensors"),
    (_ct_fp8({"strategy": "block", "block_structure": [128, 128]},
             {**FP8_TOKEN, "strategy": "group", "group_size": 128}), "compressed-tensors"),
    (_ct_fp8(activations=None), "compressed-tensors"),
])
def test_detected_from_the_checkpoint(tmp_path, qc, expected):
    assert _resolve(tmp_path, qc) == expected


@pytest.mark.parametrize("flag, expected", [("gptq", "gptq"), ("gptq_marlin", "gptq")])
def test_flag_agrees_with_the_checkpoint(tmp_path, flag, expected):
    assert _resolve(tmp_path, GPTQ, flag) == expected


def test_bitsandbytes_quantizes_an_unquantized_checkpoint(tmp_path):
    assert _resolve(tmp_path, None, "bitsandbytes") == "bitsandbytes"


def test_fp8_quantizes_an_unquantized_checkpoint(tmp_path):
    assert _resolve(tmp_path, None, "fp8") == "fp8"
    assert _resolve(tmp_path, {"quant_method": "fp8"}, "fp8") == "fp8"


def test_fp8_on_a_gguf_file_quantizes_its_dequantized_weights(smollm2_gguf_path):
    args = EngineArgs(model=smollm2_gguf_path, device="cpu", quantization="fp8")
    assert args.create_engine_config().model_config.quantization == "fp8"


def test_fp8_checkpoints_of_moe_models_refused(tmp_path):
    config = dict(CONFIG, architectures=["MixtralForCausalLM"], num_local_experts=4,
                  num_experts_per_tok=2,
                  quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="MoE models") as e:
        EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()
    assert "\n" not in str(e.value)
    # A 16-bit MoE checkpoint is quantized while loading.
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = EngineArgs(model=str(tmp_path), quantization="fp8", device="cpu")
    assert args.create_engine_config().model_config.quantization == "fp8"


@pytest.mark.parametrize("qc, flag, words", [
    (None, "fbgemm_fp8", "this FP8/FP4 method is not implemented yet"),
    (None, "modelopt", "this FP8/FP4 method is not implemented yet"),
    (None, "squeezellm", "unknown method"),
    (None, "awq", "has no quantization_config"),
    (None, "gguf", "needs a .gguf model file"),
    (GPTQ, "awq", "quantized with gptq"),
    ({"quant_method": "fbgemm_fp8"}, None, "'fbgemm_fp8' (FP8) is not implemented yet"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     None, "fp8 block-wise weights need activation_scheme dynamic"),
    (_ct_fp8(fmt="naive-quantized"), None, "format naive-quantized"),
    (_ct_fp8({"symmetric": False}), None, "is not supported; supported: compressed-tensors FP8"),
    (_ct_fp8(activations={**FP8_TOKEN, "dynamic": False}), None, "static per token"),
    (_ct_fp8({"num_bits": 4}), None, "4-bit float weights"),
    ({**GPTQ, "bits": 8}, None, "gptq bits 8 is not supported"),
    ({**GPTQ, "checkpoint_format": "marlin"}, None, "checkpoint_format 'marlin'"),
    ({**GPTQ, "group_size": 256}, None, "group_size 256"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, None,
     "awq version 'gemv'"),
    ({"quant_method": "hqq"}, None, "'hqq' is not supported"),
    ({**GPTQ, "bits": "4"}, None, "gptq bits '4' is not supported (the integer 4 only)"),
    ({**GPTQ, "lm_head": True}, None, "gptq lm_head: true (a quantized LM head) is not supported"),
    ({**GPTQ, "dynamic": {"-:model\\.layers\\.1\\..*": {}}}, None, "gptq dynamic"),
    (["gptq"], None, "quantization_config must be a JSON object, got ['gptq']"),
    ({**CT_W4A16, "config_groups": {"g": {**CT_W4A16["config_groups"]["group_0"],
                                          "input_activations": {"num_bits": 8}}}}, None,
     "activations quantized"),
])
def test_refused_in_one_line(tmp_path, qc, flag, words):
    message = _refused(tmp_path, qc, flag)
    assert words in message
    if "not implemented" in words or "not supported" in words or "unknown" in words:
        assert "supported" in message


def test_gguf_files_default_to_their_blocks(smollm2_gguf_path):
    args = EngineArgs(model=smollm2_gguf_path, device="cpu")
    assert args.create_engine_config().model_config.quantization == "gguf"
    args = EngineArgs(model=smollm2_gguf_path, device="cpu", gguf_dequantize=True)
    assert args.create_engine_config().model_config.quantization is None
    with pytest.raises(ConfigError, match="GGUF file"):
        EngineArgs(model=smollm2_gguf_path, quantization="awq").create_engine_config()
    with pytest.raises(ConfigError, match="fp8 and --gguf-dequantize contradict"):
        EngineArgs(model=smollm2_gguf_path, quantization="fp8",
                   gguf_dequantize=True).create_engine_config()  # fmt: skip


def test_gguf_dequantize_is_a_flag():
    from tokenmill.entrypoints.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "m.gguf", "--gguf-dequantize"]).gguf_dequantize is True
    assert parser.parse_args(["serve", "m.gguf"]).gguf_dequantize is False


@pytest.mark.parametrize("kwargs,words", [
    ({"gguf_dequantize": True}, "--gguf-dequantize applies to .gguf model files"),
    ({"gguf_dequantize": True, "quantization": "gguf"}, "--gguf-dequantize applies"),
])
def test_gguf_dequantize_refused_without_gguf_blocks(tmp_path, kwargs, words):
    args = EngineArgs(model=_folder(tmp_path), device="cpu", **kwargs)
    with pytest.raises(ConfigError) as e:
        args.create_engine_config()
    assert words in str(e.value) and "\n" not in str(e.value)


def test_gguf_dequantize_refused_beside_quantization_gguf(smollm2_gguf_path):
    args = EngineArgs(model=smollm2_gguf_path, device="cpu", quantization="gguf",
                      gguf_dequantize=True)
    with pytest.raises(ConfigError, match="contradict each other"):
        args.create_engine_config()
    dummy = EngineArgs(model=smollm2_gguf_path, device="cpu", load_format="dummy",
                       gguf_dequantize=True)
    with pytest.raises(ConfigError, match="--load-format auto or gguf"):
        dummy.create_engine_config()


GPT_OSS = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "intermediate_size": 64, "num_local_experts": 4,
           "num_experts_per_tok": 2, "vocab_size": 320, "max_position_embeddings": 128,
           "sliding_window": 8, "quantization_config": {"quant_method": "mxfp4"}}


def test_mxfp4_is_gpt_oss_experts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS))
    for flag in (None, "mxfp4"):
        args = EngineArgs(model=str(tmp_path), quantization=flag, device="cpu")
        assert args.create_engine_config().model_config.quantization == "mxfp4"
    assert "GptOssForCausalLM" in _refused(tmp_path, {"quant_method": "mxfp4"})


def test_modules_to_not_convert_match_as_substrings():
    """As vLLM: an entry skips every layer whose name contains it ("model.layers.1."
    keeps that layer's projections in float)."""
    from tokenmill.model.layers.quantization.int4 import Int4Config
    from tokenmill.model.layers.quantization.unquantized import UnquantizedLinearMethod

    config = Int4Config("awq", 128, ["model.layers.1."])
    layer = torch.nn.Linear(4, 4)
    assert isinstance(config.get_linear_method(layer, "model.layers.1.mlp.down_proj"),
                      UnquantizedLinearMethod)  # fmt: skip
    assert not isinstance(config.get_linear_method(layer, "model.layers.2.mlp.down_proj"),
                          UnquantizedLinearMethod)  # fmt: skip

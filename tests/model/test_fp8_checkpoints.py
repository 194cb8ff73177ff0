"""FP8 weights on the CPU: compressed-tensors FP8 and vLLM ``fp8`` checkpoints, and
``--quantization fp8`` on a 16-bit checkpoint, against float32 references running the same
scheme (dequantized weights, inputs quantized by forward hooks; see ``fp8_checkpoints``);
compressed-tensors checkpoints also against transformers loading them itself.

The CPU emulates the scheme in float32, so logits agree to float32 rounding, apart from the
odd activation that lands on the other side of an FP8 rounding boundary."""

from __future__ import annotations

import pytest
import torch

from tests.model.fp8_checkpoints import SCHEMES, hook_reference, make_fp8_checkpoint
from tests.model.paged import PagedRunner
from tokenmill.config import LoadConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.model.attention.torch_ref import TorchAttentionBackend
from tokenmill.model.loader.model_loader import get_model

IDS = list(range(3, 40))
# Max |difference| relative to the largest |logit|.
RELATIVE = 2e-3


def _load(path: str, **kwargs):
    cfg = EngineArgs(model=path, dtype="float32", device="cpu", **kwargs).create_engine_config()
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend)
    return cfg, model


def _logits(model, cfg, ids=IDS):
    runner = PagedRunner(model, cfg.model_config.hf_config, num_blocks=32)
    return runner.step({"a": ids}, {"a": ids})


def _close(logits: torch.Tensor, expected: torch.Tensor, relative: float = RELATIVE) -> None:
    diff = (logits - expected).abs().max().item()
    assert diff <= relative * expected.abs().max().item(), diff


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_fp8_checkpoint_matches_the_scheme_on_dequantized_weights(tmp_path, scheme):
    from transformers import AutoModelForCausalLM

    quant, reference = make_fp8_checkpoint(str(tmp_path), scheme)
    cfg, model = _load(quant)
    kinds = {type(m.quant_method).__name__ for m in model.modules()
             if getattr(m, "quant_method", None) is not None}
    assert "Fp8LinearMethod" in kinds
    ref = AutoModelForCausalLM.from_pretrained(reference).eval()
    hook_reference(ref, SCHEMES[scheme][2])
    with torch.no_grad():
        expected = ref(torch.tensor([IDS])).logits[0]
    _close(_logits(model, cfg), expected)


@pytest.mark.parametrize("scheme", ["ct-channel-token", "ct-tensor-static", "ct-block"])
def test_compressed_tensors_fp8_matches_transformers_loading_it(tmp_path, scheme):
    """transformers decompresses the checkpoint with the compressed-tensors package and
    runs its float weights; the activations stay float32 there, so the tolerance is FP8's."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    quant, _ = make_fp8_checkpoint(str(tmp_path), scheme)
    cfg, model = _load(quant)
    hf = AutoModelForCausalLM.from_pretrained(quant, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([IDS])).logits[0].float()
    _close(_logits(model, cfg), expected, 5e-2)


def test_online_fp8_quantizes_per_channel_and_per_token(tmp_path):
    """``--quantization fp8`` on a float checkpoint: the reference quantizes each weight
    per output channel and each projection input per token."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.model.fp8_checkpoints import TINY_LLAMA, quantize_weight

    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).float().eval()
    hf.save_pretrained(tmp_path / "float")
    cfg, model = _load(str(tmp_path / "float"), quantization="fp8")
    assert cfg.model_config.quantization == "fp8"
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                           "up_proj", "down_proj"):
                p.copy_(quantize_weight(p.float(), "channel")[2])
    hook_reference(hf, "token")
    with torch.no_grad():
        expected = hf(torch.tensor([IDS])).logits[0]
    _close(_logits(model, cfg), expected)


def test_ignored_layers_stay_unquantized(tmp_path):
    """A layer the checkpoint names in ``ignored_layers`` keeps its 16-bit weight."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    quant, reference = make_fp8_checkpoint(str(tmp_path), "fp8-dynamic")
    name = "model.layers.1.mlp.down_proj"
    tensors = load_file(f"{quant}/model.safetensors")
    ref = AutoModelForCausalLM.from_pretrained(reference).eval()
    tensors[f"{name}.weight"] = ref.state_dict()[f"{name}.weight"].clone()
    del tensors[f"{name}.weight_scale"]
    save_file(tensors, f"{quant}/model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "quant" / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] = [name]
    (tmp_path / "quant" / "config.json").write_text(json.dumps(config))
    cfg, model = _load(quant)
    methods = {n: type(m.quant_method).__name__ for n, m in model.named_modules()
               if getattr(m, "quant_method", None) is not None}
    assert methods[name] == "UnquantizedLinearMethod"
    assert methods["model.layers.0.mlp.down_proj"] == "Fp8LinearMethod"
    hook_reference(ref, "tensor")
    ref.model.layers[1].mlp.down_proj._forward_pre_hooks.clear()
    with torch.no_grad():
        expected = ref(torch.tensor([IDS])).logits[0]
    _close(_logits(model, cfg), expected)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3-moe"])
def test_online_fp8_moe_experts(tmp_path, kind):
    """``--quantization fp8`` on an MoE checkpoint: every expert's products FP8 (routers stay
    16-bit), against transformers with the same per-channel FP8 weights
    (``quantize_moe_reference``: the experts' inputs stay float32 there, hence FP8's
    tolerance)."""
    from tests.model.fp8_checkpoints import make_moe_float, quantize_moe_reference

    hf = make_moe_float(tmp_path / "float", kind)
    cfg, model = _load(str(tmp_path / "float"), quantization="fp8")
    moe = [m for m in model.modules() if type(m).__name__ == "FusedMoE"]
    assert moe and all(type(m.quant_method).__name__ == "Int4MoEMethod" for m in moe)
    assert all(type(e.quant_method).__name__ == "Fp8LinearMethod"
               for e in moe[0].quant_method.w13)
    quantize_moe_reference(hf)
    with torch.no_grad():
        expected = hf(torch.tensor([IDS])).logits[0]
    _close(_logits(model, cfg), expected, 5e-2)

"""bitsandbytes 4-bit and 8-bit through the bitsandbytes library: a checkpoint transformers
quantized and saved, and an unquantized one quantized while loading, against transformers
running the same bitsandbytes layers."""

from __future__ import annotations

import pytest
import torch

from tests.model.paged import PagedRunner
from tests.model.quant_checkpoints import TINY_LLAMA
from tokenmill.config import LoadConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.model.attention.torch_ref import TorchAttentionBackend
from tokenmill.model.loader.model_loader import get_model

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).float().eval()
    path = str(tmp_path_factory.mktemp("bnb") / "float")
    hf.save_pretrained(path)
    return path


def _hf_bnb(path: str, **kw):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(bnb_4bit_compute_dtype=torch.float32, **kw)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config,
                                                device_map="cpu", dtype=torch.float32).eval()


def _logits(path: str, **engine) -> torch.Tensor:
    cfg = EngineArgs(model=path, dtype="float32", device="cpu", **engine).create_engine_config()
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend)
    runner = PagedRunner(model, cfg.model_config.hf_config, num_blocks=32)
    return runner.step({"a": IDS}, {"a": IDS})


IDS = list(range(7, 40))


def _expected(hf, float_folder: str) -> torch.Tensor:
    """transformers' float32 model carrying the bitsandbytes layers' dequantized weights
    (transformers' own 4-bit product on the CPU runs in bfloat16, which tokenmill's does
    not: it agrees with that one to bfloat16 precision only)."""
    import bitsandbytes.functional as F
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval()
    modules = dict(hf.named_modules())
    with torch.no_grad():
        for name, module in ref.named_modules():
            layer = modules.get(name)
            if isinstance(layer, bnb.nn.Linear4bit):
                state = layer.weight.quant_state
                module.weight.copy_(F.dequantize_4bit(layer.weight.data, state).float())
        expected = ref(torch.tensor([IDS])).logits[0]
        bnb_logits = hf(torch.tensor([IDS])).logits[0].float()
    assert (bnb_logits - expected).abs().max() <= 2e-2 * expected.abs().max()
    return expected


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_prequantized_4bit_checkpoint(float_folder, tmp_path, quant_type):
    hf = _hf_bnb(float_folder, load_in_4bit=True, bnb_4bit_quant_type=quant_type)
    hf.save_pretrained(tmp_path / "q")
    torch.testing.assert_close(_logits(str(tmp_path / "q")), _expected(hf, float_folder),
                               rtol=1e-4, atol=1e-4)


def test_online_4bit_from_an_unquantized_checkpoint(float_folder):
    hf = _hf_bnb(float_folder, load_in_4bit=True, bnb_4bit_quant_type="nf4")
    logits = _logits(float_folder, quantization="bitsandbytes")
    torch.testing.assert_close(logits, _expected(hf, float_folder), rtol=1e-4, atol=1e-4)


def test_prequantized_8bit_checkpoint(float_folder, tmp_path):
    """LLM.int8() rows and their absmax: tokenmill multiplies the int8 weights exactly
    (transformers' Linear8bitLt also quantizes the activations, so it agrees to ~1%)."""
    from transformers import AutoModelForCausalLM

    hf = _hf_bnb(float_folder, load_in_8bit=True)
    hf.save_pretrained(tmp_path / "q8")
    ref = AutoModelForCausalLM.from_pretrained(float_folder, dtype=torch.float32).eval()
    modules = dict(hf.named_modules())
    with torch.no_grad():
        for name, module in ref.named_modules():
            layer = modules.get(name)
            if isinstance(layer, bnb.nn.Linear8bitLt):
                w = layer.weight.data.float() * layer.weight.SCB.float()[:, None] / 127
                module.weight.copy_(w)
        expected = ref(torch.tensor([IDS])).logits[0]
        int8_logits = hf(torch.tensor([IDS])).logits[0].float()
    logits = _logits(str(tmp_path / "q8"))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert (logits - int8_logits).abs().max() <= 3e-2 * int8_logits.abs().max()

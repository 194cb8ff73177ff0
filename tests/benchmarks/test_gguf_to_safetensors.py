"""The GGUF -> Hugging Face folder converter of the device benchmarks: transformers reads the
folder and computes the logits it computes from the GGUF file itself."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "device" / "gguf_to_safetensors.py"


def test_the_folder_holds_the_gguf_weights(tmp_path, smollm2_gguf_path, smollm2_hf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.spec_from_file_location("gguf_to_safetensors", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.convert(smollm2_gguf_path, str(tmp_path / "smollm2"), "float32")
    config = json.loads((Path(out) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, smollm2_hf(ids).logits, atol=1e-4, rtol=0)

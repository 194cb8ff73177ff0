"""Fixtures of the LoRA tests: SmolLM2's real weights as a float32 transformers folder, and
PEFT adapters on it written by peft itself (random, non-zero A and B)."""

from __future__ import annotations

import json

import pytest
import torch

# name -> (target modules, rank, lora_alpha, rsLoRA)
ADAPTERS = {
    "qv": (["q_proj", "v_proj"], 8, 16, False),
    "all": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            16, 32, True),
    "mlp": (["o_proj", "gate_proj", "up_proj", "down_proj"], 4, 8, False),
}


@pytest.fixture(scope="session")
def smollm2_float_dir(tmp_path_factory, smollm2_hf, smollm2_tokenizer) -> str:
    """SmolLM2-135M-Instruct dequantized from the GGUF fixture, saved by transformers as a
    float32 safetensors folder with its tokenizer."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("smollm2-f32")
    # save_pretrained refuses a model read from GGUF; its weights are plain floats now.
    state = {k: v.contiguous() for k, v in smollm2_hf.state_dict().items()}
    if smollm2_hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"))
    config = smollm2_hf.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    config["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    smollm2_tokenizer.save_pretrained(path)
    return str(path)


def write_peft_adapter(base_dir: str, out: str, targets, r, alpha, rslora, seed: int) -> None:
    """Save a peft LoRA adapter of the model in ``base_dir`` to ``out``, its A and B random
    (``init_lora_weights=False``; B scaled down so that the adapter changes the outputs
    without drowning the base model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
        init_lora_weights=False,
    )  # fmt: skip
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.2)
    model.save_pretrained(out)


@pytest.fixture(scope="session")
def adapter_dirs(smollm2_float_dir, tmp_path_factory) -> dict[str, str]:
    """{name: PEFT adapter folder} for ``ADAPTERS``."""
    root = tmp_path_factory.mktemp("adapters")
    folders = {}
    for seed, (name, (targets, r, alpha, rslora)) in enumerate(ADAPTERS.items()):
        folders[name] = str(root / name)
        write_peft_adapter(smollm2_float_dir, folders[name], targets, r, alpha, rslora, seed)
    return folders


@pytest.fixture(scope="session")
def peft_model(smollm2_float_dir, adapter_dirs):
    """The reference: transformers' SmolLM2 with every adapter of ``ADAPTERS`` loaded from
    its folder by peft (``set_adapter`` picks one, ``disable_adapter`` none)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(smollm2_float_dir, dtype=torch.float32)
    model = None
    for name, folder in adapter_dirs.items():
        if model is None:
            model = PeftModel.from_pretrained(base, folder, adapter_name=name)
        else:
            model.load_adapter(folder, adapter_name=name)
    return model.eval()

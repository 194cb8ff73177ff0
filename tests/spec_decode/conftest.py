"""Fixtures of the speculative decoding tests: a tiny random Llama target (SmolLM2's
tokenizer, prompts as token ids) and EAGLE / EAGLE-3 heads written in the layouts their
authors publish (``pytorch_model.bin`` and ``model.safetensors``), with random weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.entrypoints.conftest import tiny_model_dir  # noqa: F401 (a fixture)

HIDDEN, LAYERS, VOCAB, HEADS, KV_HEADS, FFN = 64, 4, 320, 4, 2, 128
DRAFT_VOCAB = 100


def llama_config(**overrides):
    from transformers import LlamaConfig

    fields = dict(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
        max_position_embeddings=1024, rms_norm_eps=1e-5,
    )  # fmt: skip
    fields.update(overrides)
    return LlamaConfig(**fields)


def save_llama(path: Path, seed: int, scale: float = 1.0, **overrides) -> str:
    """A random Llama saved by transformers; ``scale`` multiplies its weights' spread (peaked
    distributions for the sampling tests)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(llama_config(**overrides))
    if scale != 1.0:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" not in name:
                    param.mul_(scale)
    model.save_pretrained(path)
    return str(path)


def head_layer(prefix: str, qkv_in: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A Llama decoder layer's tensors under ``prefix`` (q/k/v of input ``qkv_in``)."""
    hd = HIDDEN // HEADS

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    return {
        f"{prefix}.self_attn.q_proj.weight": w(HEADS * hd, qkv_in),
        f"{prefix}.self_attn.k_proj.weight": w(KV_HEADS * hd, qkv_in),
        f"{prefix}.self_attn.v_proj.weight": w(KV_HEADS * hd, qkv_in),
        f"{prefix}.self_attn.o_proj.weight": w(HIDDEN, HEADS * hd),
        f"{prefix}.mlp.gate_proj.weight": w(FFN, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": w(FFN, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": w(HIDDEN, FFN),
        f"{prefix}.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=g),
        f"{prefix}.input_layernorm.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=g),
    }


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> str:
    return save_llama(tmp_path_factory.mktemp("spec-target"), seed=0)


@pytest.fixture(scope="session")
def eagle_head(tmp_path_factory) -> str:
    """EAGLE (1) as the EAGLE authors publish it: ``pytorch_model.bin`` with ``fc`` (and its
    bias), one layer (its unused input norm included) and a copy of the embedding."""
    path = tmp_path_factory.mktemp("EAGLE-tiny")
    g = torch.Generator().manual_seed(1)
    weights = {
        "fc.weight": torch.randn(HIDDEN, 2 * HIDDEN, generator=g) * 0.05,
        "fc.bias": torch.randn(HIDDEN, generator=g) * 0.05,
        "embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
        **head_layer("layers.0", HIDDEN, g),
    }
    torch.save(weights, path / "pytorch_model.bin")
    config = llama_config(num_hidden_layers=1).to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="session")
def eagle3_head(tmp_path_factory) -> str:
    """EAGLE-3: ``fc`` over three target layers, ``midlayer`` with q/k/v of input 2H and a
    ``hidden_norm``, ``norm``, ``lm_head`` over a draft vocabulary and ``d2t``/``t2d``."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("tiny-eagle3")
    g = torch.Generator().manual_seed(2)
    weights = {
        "fc.weight": torch.randn(HIDDEN, 3 * HIDDEN, generator=g) * 0.05,
        "norm.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=g),
        "lm_head.weight": torch.randn(DRAFT_VOCAB, HIDDEN, generator=g) * 0.1,
        "d2t": torch.randint(0, VOCAB - DRAFT_VOCAB, (DRAFT_VOCAB,), generator=g),
        "t2d": torch.zeros(VOCAB, dtype=torch.bool),
        "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(HIDDEN, generator=g),
        **head_layer("midlayer", 2 * HIDDEN, g),
    }
    save_file(weights, path / "model.safetensors")
    config = llama_config(num_hidden_layers=1).to_dict()
    config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)

"""Gemma and Gemma 2 from GGUF files: a tiny random model written as llama.cpp's converter
writes it (llama.cpp's tensor names, RMSNorm weights stored as ``1 + w``, the soft caps and
window in the metadata, F32 tensors) loads with the settings llama.cpp's graphs fix
(Gemma 2's even layers sliding, tanh GELU, the softmax scale) and gives transformers'
logits on the same weights."""

from __future__ import annotations

import pytest
import torch

from tests.model.gguf_files import decoder_writer, finish
from tests.model.paged import PagedRunner
from tests.model.test_qwen3_parity import TINY, save_random_model
from tests.model.tolerance import assert_logits_close


def write_gguf(hf, path: str, arch: str) -> None:
    """``hf``'s weights and settings as a llama.cpp GGUF file of architecture ``arch``."""
    import gguf

    c = hf.config
    writer = decoder_writer(path, arch, c)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    if arch == "gemma2":
        writer.add_sliding_window(c.sliding_window)
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), c.num_hidden_layers
    )
    for name, param in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embedding: llama.cpp writes no output tensor
        data = param.detach().float().numpy()
        if name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp multiplies by the stored weight as is
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), data)
    finish(writer)


def _configs():
    from transformers import Gemma2Config, GemmaConfig

    return {
        "gemma": GemmaConfig(**dict(TINY, head_dim=16, num_key_value_heads=1)),
        "gemma2": Gemma2Config(
            **dict(TINY, num_hidden_layers=3), head_dim=16, sliding_window=8,
            query_pre_attn_scalar=16, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        ),
    }


@pytest.mark.parametrize("arch", ["gemma", "gemma2"])
def test_gguf_file_matches_transformers(arch, tmp_path):
    from tokenmill.config import LoadConfig
    from tokenmill.engine_args import EngineArgs
    from tokenmill.model.attention.torch_ref import TorchAttentionBackend
    from tokenmill.model.loader.model_loader import get_model

    hf = save_random_model(_configs()[arch], tmp_path / "hf")
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(hf, path, arch)
    cfg = EngineArgs(model=path, tokenizer=None, dtype="float32", device="cpu",
                     max_model_len=128).create_engine_config()  # fmt: skip
    config = cfg.model_config.hf_config
    if arch == "gemma2":
        assert config.layer_types == hf.config.layer_types
        assert config.query_pre_attn_scalar == hf.config.query_pre_attn_scalar
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend)
    gen = torch.Generator().manual_seed(2)
    ids = {"a": torch.randint(0, 320, (40,), generator=gen).tolist(), "b": [5, 9, 2]}
    logits = PagedRunner(model, config, num_blocks=16).step(ids, ids)
    with torch.no_grad():
        expected = torch.cat([hf(torch.tensor([v])).logits[0] for v in ids.values()])
    assert_logits_close(logits, expected)


@pytest.mark.parametrize(
    "layers,hidden,heads,scalar", [(42, 3584, 16, 256), (46, 4608, 32, 144)], ids=["9B", "27B"]
)
def test_gemma2_27b_scales_queries_by_hidden_per_head(layers, hidden, heads, scalar):
    from tokenmill.gguf_config import _derive_gemma_config

    data = dict(num_hidden_layers=layers, head_dim=256, hidden_size=hidden,
                num_attention_heads=heads)  # fmt: skip
    _derive_gemma_config(data, "gemma2")
    assert data["query_pre_attn_scalar"] == scalar
    assert data["layer_types"][:3] == ["sliding_attention", "full_attention", "sliding_attention"]

"""Llama 3.1-style RoPE scaling in llama.cpp's ``llama`` GGUF files: the converter stores the
llama3 scaling only as a ``rope_freqs`` tensor of per-frequency divisors (no scaling type in
the metadata), and llama.cpp's graph divides each frequency by its factor; a tiny Llama with
llama3 scaling, written so, gives transformers' logits."""

from __future__ import annotations

import numpy as np
import torch

from tests.model.gguf_files import decoder_writer, finish
from tests.model.paged import PagedRunner
from tests.model.test_gguf_moe import _permute
from tests.model.test_llama4_gguf import llama3_rope_factors
from tokenmill.config import LoadConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.model.attention.torch_ref import TorchAttentionBackend
from tokenmill.model.loader.model_loader import get_model


def test_rope_freqs_of_a_llama_file_scale_its_frequencies(tmp_path):
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    # RoPE base 1e4 and an original context of 32: one frequency in llama3's blended band,
    # one kept, the rest divided by the factor.
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32},
    )  # fmt: skip
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).float().eval()
    path = str(tmp_path / "llama31.gguf")
    writer = decoder_writer(path, "llama", config)
    writer.add_rope_dimension_count(16)
    factors = llama3_rope_factors(hf.config)
    assert len(set(factors.tolist())) == 3  # kept, blended, divided
    writer.add_tensor("rope_freqs.weight", factors)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in hf.state_dict().items():
        w = tensor.numpy()
        if ".q_proj." in name or ".k_proj." in name:
            heads = config.num_attention_heads if ".q_proj." in name else 2
            w = _permute(w, heads)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)),
                          np.ascontiguousarray(w, dtype=np.float32))  # fmt: skip
    finish(writer)

    ids = list(range(3, 60))  # past the original context of 32
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    cfg = EngineArgs(model=path, dtype="float32", device="cpu").create_engine_config()
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend)
    logits = PagedRunner(model, cfg.model_config.hf_config, num_blocks=16).step(
        {"a": ids}, {"a": ids}
    )
    assert (logits - expected).abs().max() <= 1e-4

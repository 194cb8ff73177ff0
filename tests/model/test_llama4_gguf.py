"""Llama 4 text from GGUF files (llama.cpp's ``llama4`` architecture): a tiny random model
written as llama.cpp's converter writes it -- Q/K rows as the checkpoint has them (no
permutation: llama.cpp rotates adjacent pairs, as Llama 4 does), the experts' ``gate_up_proj
[E, H, 2I]`` split into ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]`` and ``down_proj``
transposed to ``ffn_down_exps [E, H, I]``, the shared expert as ``ffn_*_shexp``, the router
as ``ffn_gate_inp``, the dense layers' MLP size as ``feed_forward_length`` and the experts'
as ``expert_feed_forward_length``, the llama3 RoPE scaling as a ``rope_freqs`` tensor of
per-frequency factors -- loads with the settings llama.cpp's graph fixes and gives
transformers' logits on the same weights.

llama.cpp fixes the attention chunk (8192 tokens) and the NoPE layers' temperature floor
scale (8192); the logit and greedy tests override both (``hf_overrides``) to the tiny
model's 16 and 8, so prompts of 20-60 tokens cross chunk boundaries and change scale.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from tests.model.engine_parity import assert_engine_greedy_matches
from tests.model.gguf_files import decoder_writer, finish
from tests.model.test_llama4_parity import LLAMA4, SCALE
from tests.model.test_qwen3_parity import mixed_batch_logits, save_random_model
from tests.model.tolerance import assert_logits_close

# RoPE base 1e4: with an original context of 32, one frequency falls in llama3's blended
# band, one is kept and the rest are divided by the factor.
CONFIG = dict(LLAMA4, rope_parameters=dict(LLAMA4["rope_parameters"], rope_theta=1e4))
# The tiny model's chunk and floor scale in place of the 8192 llama.cpp fixes.
OVERRIDES = {"attention_chunk_size": 16, "floor_scale": 8}
Q8_0_LEAVES = (".self_attn.", ".experts.", ".shared_expert.", "feed_forward.gate_proj",
               "feed_forward.up_proj", "feed_forward.down_proj")  # fmt: skip


def llama3_rope_factors(config) -> np.ndarray:
    """The converter's ``rope_freqs``: per frequency of ``head_dim / 2``, the divisor that
    llama3 scaling applies (1 for short wavelengths, ``factor`` for long ones, blended in
    between), float32."""
    rope = config.rope_parameters
    dim, base = config.head_dim, rope["rope_theta"]
    old, low, high = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                      rope["high_freq_factor"])  # fmt: skip
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(rope["factor"])
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_llama4_gguf(hf, path: str, q8_0: bool = False) -> None:
    """``hf``'s weights as llama.cpp's converter writes a ``llama4`` file. ``q8_0``: the
    projections, experts and MLPs in Q8_0 blocks, and ``hf``'s weights set to their
    dequantized values."""
    import gguf

    c = hf.config
    writer = decoder_writer(path, "llama4", c, feed_forward_length=c.intermediate_size_mlp)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.intermediate_size)
    writer.add_interleave_moe_layer_step(c.interleave_moe_layer_step)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA4, c.num_hidden_layers)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def add(hf_name: str, data: torch.Tensor) -> torch.Tensor:
        """Write one tensor; returns the values the file holds."""
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        values = data.detach().float().contiguous().numpy()
        if q8_0 and any(leaf in hf_name for leaf in Q8_0_LEAVES):
            blocks = gguf.quants.quantize(values, q8)
            writer.add_tensor(name, blocks, raw_dtype=q8)
            return torch.from_numpy(gguf.quants.dequantize(blocks, q8)).reshape(data.shape)
        writer.add_tensor(name, values)
        return data.detach().float()

    writer.add_tensor("rope_freqs.weight", llama3_rope_factors(c))
    for name, param in list(hf.named_parameters()):
        if name.endswith("experts.gate_up_proj"):  # [E, H, 2I]: gate columns, then up
            rows = param.transpose(1, 2)
            half = rows.shape[1] // 2
            base = name.removesuffix("gate_up_proj")
            gate = add(base + "gate_proj.weight", rows[:, :half])
            up = add(base + "up_proj.weight", rows[:, half:])
            stored = torch.cat((gate, up), dim=1).transpose(1, 2)
        elif name.endswith("experts.down_proj"):  # [E, I, H]
            stored = add(name + ".weight", param.transpose(1, 2)).transpose(1, 2)
        else:
            stored = add(name, param)
        with torch.no_grad():
            param.copy_(stored)
    finish(writer)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from transformers import Llama4TextConfig

    config = Llama4TextConfig(**CONFIG, num_experts_per_tok=1)
    return save_random_model(config, tmp_path_factory.mktemp("llama4-hf"), SCALE)


@pytest.fixture(scope="module")
def float_file(hf_model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "llama4-f32.gguf")
    write_llama4_gguf(hf_model, path)
    return path


@pytest.fixture(scope="module")
def q8_0_model(hf_model, tmp_path_factory):
    """(transformers' model on the dequantized Q8_0 weights, the Q8_0 file)."""
    hf = copy.deepcopy(hf_model)
    path = str(tmp_path_factory.mktemp("gguf") / "llama4-q8_0.gguf")
    write_llama4_gguf(hf, path, q8_0=True)
    return hf, path


def test_config_from_metadata(hf_model, float_file):
    """The sizes from the file's keys; chunked attention, NoPE layers, temperature tuning
    and QK-norm as llama.cpp's graph fixes them; the RoPE factors from ``rope_freqs``."""
    from tokenmill.hf_config import load_hf_config

    config, _ = load_hf_config(float_file)
    c = hf_model.config
    assert config.architectures == ["Llama4ForCausalLM"]
    assert (config.intermediate_size, config.intermediate_size_mlp) == (32, 96)
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 1)
    assert config.interleave_moe_layer_step == 2
    assert config.no_rope_layers == c.no_rope_layers == [1, 1, 1, 0]
    assert (config.attention_chunk_size, config.floor_scale, config.attn_scale) == (
        8192, 8192, 0.1)  # fmt: skip
    assert config.attn_temperature_tuning and config.use_qk_norm
    assert config.head_dim == 16 and not config.tie_word_embeddings
    scaling = config.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["attention_factor"] == 1.0
    assert np.allclose(scaling["short_factor"], llama3_rope_factors(c))
    kept, blended, *divided = sorted(set(np.round(scaling["short_factor"], 4)))
    assert kept == 1.0 and 1.0 < blended < 8.0 and divided == [8.0]


def test_128_experts_turn_qk_norm_off(hf_model, tmp_path):
    """llama.cpp's graph normalises Q and K on the RoPE layers except for the 128-expert
    model (Maverick)."""
    import gguf

    from tokenmill.gguf_config import read_gguf_config

    path = str(tmp_path / "maverick-shape.gguf")
    c = hf_model.config
    writer = decoder_writer(path, "llama4", c, feed_forward_length=c.intermediate_size_mlp)
    writer.add_expert_count(128)
    writer.add_expert_used_count(1)
    writer.add_expert_feed_forward_length(c.intermediate_size)
    writer.add_interleave_moe_layer_step(2)
    writer.add_tensor("token_embd.weight", np.zeros((c.vocab_size, c.hidden_size), np.float32))
    finish(writer)
    assert read_gguf_config(path)["use_qk_norm"] is False
    assert gguf.GGUFReader(path).fields["llama4.expert_count"].contents() == 128


def test_float_file_matches_transformers(hf_model, float_file):
    logits, expected = mixed_batch_logits(hf_model, float_file, hf_overrides=OVERRIDES)
    assert_logits_close(logits, expected)


def _load(path: str, dequantize: bool):
    from tokenmill.config import LoadConfig
    from tokenmill.engine_args import EngineArgs
    from tokenmill.model.attention.torch_ref import TorchAttentionBackend
    from tokenmill.model.loader.model_loader import get_model

    cfg = EngineArgs(model=path, dtype="float32", device="cpu", max_model_len=128,
                     gguf_dequantize=dequantize, hf_overrides=OVERRIDES).create_engine_config()
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend)
    return model, cfg.model_config.hf_config


@pytest.mark.parametrize("dequantize", [False, True])
def test_q8_0_file_matches_transformers(q8_0_model, dequantize):
    """Blocks kept (the default: experts and projections stay Q8_0, products on the CPU's
    kernels, within 2% of the largest logit) or dequantized at load (transformers' logits
    on the same dequantized weights)."""
    from tests.model.paged import PagedRunner

    hf, path = q8_0_model
    model, config = _load(path, dequantize)
    moe = model.model.layers[1].feed_forward.experts
    assert (moe.quant_method is None) == dequantize
    gen = torch.Generator().manual_seed(2)
    ids = {"a": torch.randint(0, config.vocab_size, (40,), generator=gen).tolist(), "b": [5, 9]}
    logits = PagedRunner(model, config, num_blocks=16).step(ids, ids)
    with torch.no_grad():
        expected = torch.cat([hf(torch.tensor([v])).logits[0] for v in ids.values()])
    if dequantize:
        assert_logits_close(logits, expected)
    else:
        assert (logits - expected).abs().max() <= 2e-2 * expected.abs().max()


@pytest.mark.slow
def test_engine_greedy_equals_transformers(hf_model, float_file, smollm2_gguf_path):
    assert_engine_greedy_matches(hf_model, float_file, smollm2_gguf_path, hf_overrides=OVERRIDES)

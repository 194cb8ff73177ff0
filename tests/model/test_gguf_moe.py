"""Mixture-of-experts GGUF files (llama.cpp's stacked ``ffn_*_exps`` tensors): a tiny
Qwen3-MoE and a tiny Mixtral written with the gguf package (Q8_0 blocks from its
quantizer), against transformers on the same dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model.gguf_files import decoder_writer, finish
from tests.model.paged import PagedRunner
from tokenmill.config import LoadConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.model.attention.torch_ref import TorchAttentionBackend
from tokenmill.model.loader.model_loader import get_model

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-5,
              tie_word_embeddings=False, num_experts_per_tok=2)


def _hf_model(kind: str):
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    torch.manual_seed(0)
    if kind == "qwen3moe":
        config = Qwen3MoeConfig(**COMMON, head_dim=16, intermediate_size=64,
                                moe_intermediate_size=64, num_experts=4, norm_topk_prob=True)
    else:
        config = MixtralConfig(**COMMON, intermediate_size=64, num_local_experts=4)
    return AutoModelForCausalLM.from_config(config).float().eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row permutation (Llama-architecture files)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(hf, kind: str, path: str) -> dict[str, torch.Tensor]:
    """Write ``hf`` as a GGUF file (2D weights Q8_0); return the dequantized state dict."""
    import gguf

    arch = "qwen3moe" if kind == "qwen3moe" else "llama"
    c = hf.config
    writer = decoder_writer(path, arch, c)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    if kind == "qwen3moe":
        writer.add_key_length(16)
        writer.add_value_length(16)
        writer.add_expert_feed_forward_length(64)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE if kind == "qwen3moe"
                                        else gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    state = hf.state_dict()
    reference: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        w = tensor.numpy()
        if name.endswith(".experts.gate_up_proj"):  # transformers' fused [E, 2I, H]
            layer = name.split(".")[2]
            half = w.shape[1] // 2
            gate = _add(writer, f"blk.{layer}.ffn_gate_exps.weight", w[:, :half])
            up = _add(writer, f"blk.{layer}.ffn_up_exps.weight", w[:, half:])
            reference[name] = torch.cat([gate, up], dim=1)
            continue
        if name.endswith(".experts.down_proj"):
            layer = name.split(".")[2]
            reference[name] = _add(writer, f"blk.{layer}.ffn_down_exps.weight", w)
            continue
        if kind != "qwen3moe" and (".q_proj." in name or ".k_proj." in name):
            heads = c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads
            w = _permute(w, heads)
        gguf_name = name_map.get_name(name.replace(".mlp.gate.", ".block_sparse_moe.gate."),
                                      try_suffixes=(".weight",))
        reference[name] = _add(writer, gguf_name, w)
    finish(writer)
    return reference


def _add(writer, gguf_name: str, w: np.ndarray) -> torch.Tensor:
    import gguf

    if w.ndim == 1:
        writer.add_tensor(gguf_name, w.astype(np.float32))
        return torch.from_numpy(w.copy())
    qtype = gguf.GGMLQuantizationType.Q8_0
    q = gguf.quants.quantize(w.astype(np.float32), qtype)
    writer.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=qtype)
    return torch.from_numpy(gguf.quants.dequantize(q, qtype).reshape(w.shape).copy())


@pytest.mark.parametrize("kind", ["qwen3moe", "mixtral"])
def test_moe_gguf_matches_transformers(tmp_path, kind):
    hf = _hf_model(kind)
    path = str(tmp_path / "moe.gguf")
    reference = write_gguf(hf, kind, path)
    if kind != "qwen3moe":  # undo the converter's permutation for the reference weights
        c = hf.config
        for name in list(reference):
            if ".q_proj." in name or ".k_proj." in name:
                heads = c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads
                w = reference[name].numpy()
                reference[name] = torch.from_numpy(w.reshape(
                    heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
                    w.shape).copy())
    hf.load_state_dict(reference)
    ids = list(range(3, 30))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    for dequantize in (True, False):
        cfg = EngineArgs(
            model=path, dtype="float32", device="cpu", gguf_dequantize=dequantize
        ).create_engine_config()
        assert cfg.model_config.architecture == ("Qwen3MoeForCausalLM" if kind == "qwen3moe"
                                                 else "MixtralForCausalLM")
        model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"),
                          TorchAttentionBackend)
        runner = PagedRunner(model, cfg.model_config.hf_config, num_blocks=16)
        logits = runner.step({"a": ids}, {"a": ids})
        tolerance = 1e-4 if dequantize else 2e-2 * expected.abs().max().item()
        assert (logits - expected).abs().max() <= tolerance, dequantize


def test_unknown_gguf_architecture_is_refused_by_name(tmp_path):
    import gguf

    from tokenmill.config import ConfigError
    from tokenmill.hf_config import ModelLoadError

    path = str(tmp_path / "x.gguf")
    writer = gguf.GGUFWriter(path, "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    finish(writer)
    with pytest.raises((ModelLoadError, ConfigError), match="'mamba'"):
        EngineArgs(model=path).create_engine_config()


def test_a_layer_past_the_block_count_is_refused(tmp_path):
    """A file whose block_count is below its layers' indices would lose those layers: the
    loader names the tensor instead of skipping it."""
    import gguf

    from tokenmill.hf_config import ModelLoadError
    from tokenmill.model.loader.gguf_loader import iterate_gguf

    path = str(tmp_path / "x.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    for i in (0, 1):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(8, dtype=np.float32))
    finish(writer)
    names = [f"model.layers.{i}.input_layernorm.weight" for i in (0, 1)]
    with pytest.raises(ModelLoadError, match=r"'blk\.1\.attn_norm\.weight' belongs to no layer"):
        list(iterate_gguf(path, names, num_heads=1, num_kv_heads=1))


def test_a_truncated_gguf_is_named_truncated(tmp_path, smollm2_gguf_path):
    """A file cut short (an interrupted download) is refused as truncated, not with the
    array error the gguf reader hits."""
    from tokenmill.hf_config import ModelLoadError

    path = tmp_path / "cut.gguf"
    with open(smollm2_gguf_path, "rb") as src:
        path.write_bytes(src.read(4_000_000))
    with pytest.raises(ModelLoadError, match=r"cut\.gguf is truncated: its 4000000 bytes"):
        EngineArgs(model=str(path)).create_engine_config()


def test_q_rows_that_are_not_whole_heads_are_refused():
    from tokenmill.model.loader.gguf_loader import unpermute_qk

    with pytest.raises(ValueError, match="192 rows are not 9 heads of an even size"):
        unpermute_qk(np.zeros((192, 4), dtype=np.float32), 9)


@pytest.mark.parametrize("change, message", [
    ({"llama.attention.layer_norm_rms_epsilon": -1.0},
     r"rms_norm_eps \(GGUF key attention.layer_norm_rms_epsilon\) must be a positive finite"),
    ({"llama.rope.freq_base": float("nan")}, "rope_theta .* must be a positive finite"),
    ({"llama.feed_forward_length": None}, "has no llama.feed_forward_length"),
    ({"llama.context_length": 0},
     r"max_position_embeddings \(GGUF key context_length\) must be a positive integer"),
])
def test_gguf_settings_out_of_range_are_refused(tmp_path, change, message):
    """Metadata that would build a model answering garbage (a negative epsilon, a NaN RoPE
    base) or failing mid-start-up is refused at start-up, naming the GGUF key."""
    import gguf

    from tokenmill.config import ConfigError
    from tokenmill.hf_config import ModelLoadError

    fields = {"llama.block_count": 1, "llama.context_length": 64, "llama.embedding_length": 8,
              "llama.feed_forward_length": 16, "llama.attention.head_count": 2,
              "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 1e4}
    fields.update(change)
    path = str(tmp_path / "x.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    finish(writer)
    with pytest.raises((ModelLoadError, ConfigError), match=message):
        EngineArgs(model=path, tokenizer=path).create_engine_config()


def _one_tensor_gguf(path, data, raw_dtype=None, shape=None):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    if raw_dtype is None:
        writer.add_tensor("blk.0.attn_norm.weight", data)
    else:
        writer.add_tensor("blk.0.ffn_down.weight", data, raw_shape=shape, raw_dtype=raw_dtype)
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(64, dtype=np.float32))
    finish(writer)


def test_a_header_that_does_not_match_the_data_is_refused(tmp_path):
    """A tensor type changed in the header but not in the data (float32 read as float16)
    leaves the next tensor's data where the header does not put it: refused, as llama.cpp's
    loader does, instead of reading other values."""
    import struct

    from tokenmill.gguf_config import open_gguf
    from tokenmill.hf_config import ModelLoadError

    path = tmp_path / "patched.gguf"
    _one_tensor_gguf(path, np.ones(64, dtype=np.float32))
    raw = bytearray(path.read_bytes())
    name = b"blk.0.attn_norm.weight"
    at = raw.index(name) + len(name) + 4 + 8  # past n_dims (u32) and the one dimension (u64)
    assert struct.unpack_from("<I", raw, at)[0] == 0  # F32
    struct.pack_into("<I", raw, at, 1)  # F16: half the bytes
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelLoadError, match=r"inconsistent: tensor 'blk\.0\.ffn_norm\.weight' "
                                             r"starts at byte \d+, not at the end of tensor "
                                             r"'blk\.0\.attn_norm\.weight' \(F16, 128 bytes\)"):
        open_gguf(str(path))
    struct.pack_into("<I", raw, at, 99)  # no such type
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelLoadError, match="a type the gguf package does not know"):
        open_gguf(str(path))


def test_quantized_types_without_a_kernel_are_named_when_dequantized(tmp_path, caplog):
    """IQ4_NL blocks (no kernel here) load dequantized; the log says so and what it costs
    instead of the start-up line alone calling the weights kept in their blocks."""
    import logging

    import gguf

    from tokenmill.model.loader.gguf_loader import iterate_gguf

    path = tmp_path / "iq.gguf"
    # IQ4_NL: blocks of 32 weights in 18 bytes (an fp16 scale, 16 bytes of 4-bit indices)
    blocks = np.zeros((64, 2 * 18), dtype=np.uint8)
    _one_tensor_gguf(path, blocks, gguf.GGMLQuantizationType.IQ4_NL, blocks.shape)
    names = ["model.layers.0.mlp.down_proj.weight",
             "model.layers.0.post_attention_layernorm.weight"]  # fmt: skip
    caplog.set_level(logging.WARNING, "tokenmill.model.loader.gguf_loader")
    tensors = dict(iterate_gguf(str(path), names, 1, 1, keep_quantized=True))
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    [record] = caplog.records
    assert "1 tensor(s) of type IQ4_NL are not kept in their blocks" in record.getMessage()

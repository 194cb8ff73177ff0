"""gpt-oss from GGUF files (llama.cpp's ``gpt-oss`` architecture): a tiny random model written
as llama.cpp's converter writes it -- the experts' interleaved gate/up rows split into
``ffn_gate_exps`` / ``ffn_up_exps`` with their biases, ``down_proj`` as ``ffn_down_exps``,
the sinks as ``attn_sinks.weight``, MXFP4 experts in ggml's ``block_mxfp4`` (the scale byte,
then values 0-15 in the low nibbles and 16-31 in the high ones) or float ones -- loads with
the settings llama.cpp's graph fixes (even layers sliding, YaRN's rounded correction range)
and gives transformers' logits on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model.gguf_files import decoder_writer, finish
from tests.model.paged import PagedRunner
from tests.model.test_gpt_oss_parity import _config, _randomize, save_mxfp4
from tests.model.tolerance import assert_logits_close


def _gguf_config():
    """The parity tests' config with what llama.cpp fixes: YaRN's correction range rounded,
    the SwiGLU clamp at 7 (the file stores neither)."""
    config = _config()
    config.rope_parameters.pop("truncate")
    config.swiglu_limit = 7.0
    return config


def ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """The checkpoint's MXFP4 (``blocks [..., K/32, 16]``, two values a byte, the even one in
    the low nibble; ``scales [..., K/32]``) as ggml's ``block_mxfp4`` rows ``[..., K/32*17]``."""
    values = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2)  # [..., K/32, 32]
    qs = values[..., :16] | (values[..., 16:] << 4)
    rows = torch.cat((scales.unsqueeze(-1), qs), dim=-1)
    return rows.flatten(-2).numpy().astype(np.uint8)


def write_gpt_oss_gguf(hf, tensors: dict[str, torch.Tensor], path: str, q8_0: bool = False,
                       fused: bool = False) -> None:  # fmt: skip
    """``tensors`` (the checkpoint's, MXFP4 experts or float ones) as llama.cpp's converter
    writes a gpt-oss file, with ``hf``'s settings. ``q8_0``: the attention projections in
    Q8_0 blocks, and ``hf``'s set to their dequantized values. ``fused``: gate and up in
    one ``ffn_gate_up_exps`` tensor (the gate rows, then the up rows)."""
    import gguf

    c = hf.config
    rope = c.rope_parameters
    writer = decoder_writer(path, "gpt-oss", c)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.intermediate_size)
    writer.add_sliding_window(c.sliding_window)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, c.num_hidden_layers)

    def add(hf_name: str, data, raw: bool = False) -> None:
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if raw:
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        elif q8_0 and ".self_attn." in hf_name and hf_name.endswith("_proj.weight"):
            q8 = gguf.GGMLQuantizationType.Q8_0
            blocks = gguf.quants.quantize(data.detach().float().numpy(), q8)
            writer.add_tensor(name, blocks, raw_dtype=q8)
            with torch.no_grad():
                hf.get_parameter(hf_name).copy_(torch.from_numpy(
                    gguf.quants.dequantize(blocks, q8)).reshape(data.shape))
        else:
            writer.add_tensor(name, data.detach().float().contiguous().numpy())

    def add_gate_up(base: str, kind: str, gate, up, raw: bool = False) -> None:
        if not fused:
            add(f"{base}.gate_proj.{kind}", gate, raw)
            add(f"{base}.up_proj.{kind}", up, raw)
            return
        layer = base.split(".")[2]
        both = (np.concatenate if raw else torch.cat)((gate, up), -1 if kind == "bias" else 1)
        name = f"blk.{layer}.ffn_gate_up_exps.{kind}"
        if raw:
            writer.add_tensor(name, both, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            writer.add_tensor(name, both.detach().float().contiguous().numpy())

    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".experts.")
        if not prefix:
            add(name + ".weight" if name.endswith(".sinks") else name, t)
            continue
        base = f"{prefix}.experts"
        if leaf == "gate_up_proj":  # [E, H, 2I], gate and up columns alternating
            rows = t.transpose(1, 2)
            add_gate_up(base, "weight", rows[:, 0::2], rows[:, 1::2])
        elif leaf == "gate_up_proj_bias":
            add_gate_up(base, "bias", t[:, 0::2], t[:, 1::2])
        elif leaf == "gate_up_proj_blocks":
            scales = tensors[f"{base}.gate_up_proj_scales"]
            add_gate_up(base, "weight", ggml_mxfp4(t[:, 0::2], scales[:, 0::2]),
                        ggml_mxfp4(t[:, 1::2], scales[:, 1::2]), raw=True)  # fmt: skip
        elif leaf == "down_proj":  # [E, I, H]
            add(f"{base}.down_proj.weight", t.transpose(1, 2))
        elif leaf == "down_proj_bias":
            add(f"{base}.down_proj.bias", t)
        elif leaf == "down_proj_blocks":
            scales = tensors[f"{base}.down_proj_scales"]
            add(f"{base}.down_proj.weight", ggml_mxfp4(t, scales), raw=True)
    finish(writer)


@pytest.fixture(scope="module", params=["float", "mxfp4", "mxfp4+q8_0", "mxfp4+fused"])
def gguf_model(request, tmp_path_factory):
    """(transformers' model, the GGUF file of its weights, the checkpoint's tensors)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    dense = tmp_path_factory.mktemp("gpt-oss-hf")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_gguf_config(), attn_implementation="eager")
    hf = hf.float().eval()
    _randomize(hf)
    hf.save_pretrained(dense)
    folder = dense
    if request.param.startswith("mxfp4"):
        folder = tmp_path_factory.mktemp("gpt-oss-mxfp4")
        hf = save_mxfp4(str(dense), str(folder))
    tensors = load_file(str(folder / "model.safetensors"))
    path = str(tmp_path_factory.mktemp("gguf") / f"gpt-oss-{request.param}.gguf")
    write_gpt_oss_gguf(hf, tensors, path, q8_0=request.param.endswith("q8_0"),
                       fused=request.param.endswith("fused"))  # fmt: skip
    return hf, path, tensors


def test_written_mxfp4_blocks_decode_as_the_checkpoint(gguf_model):
    """The gguf package decodes the file's experts to transformers' dequantized weights: the
    file holds ggml's block layout, not the checkpoint's."""
    import gguf

    hf, path, tensors = gguf_model
    if "model.layers.0.mlp.experts.down_proj_blocks" not in tensors:
        pytest.skip("float experts")
    reader = gguf.GGUFReader(path)
    down = next(t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight")
    assert down.tensor_type == gguf.GGMLQuantizationType.MXFP4
    decoded = gguf.quants.dequantize(np.asarray(down.data), down.tensor_type)
    want = hf.model.layers[0].mlp.experts.down_proj.transpose(1, 2)  # [E, H, I]
    assert torch.equal(torch.from_numpy(decoded).reshape(want.shape), want.float())


@pytest.mark.parametrize("dequantize", [False, True])
def test_gguf_file_matches_transformers(gguf_model, dequantize):
    """Blocks kept (the default; Q8_0 projections on the CPU's kernel, within 2% of the
    largest logit) or dequantized at load (``--gguf-dequantize``: transformers' logits)."""
    from tokenmill.config import LoadConfig
    from tokenmill.engine_args import EngineArgs
    from tokenmill.model.attention.torch_ref import TorchAttentionBackend
    from tokenmill.model.loader.model_loader import get_model

    hf, path, tensors = gguf_model
    cfg = EngineArgs(model=path, tokenizer=None, dtype="float32", device="cpu",
                     max_model_len=128, gguf_dequantize=dequantize).create_engine_config()
    config = cfg.model_config.hf_config
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    mxfp4 = "model.layers.0.mlp.experts.down_proj_blocks" in tensors
    assert (config.get("quantization_config") or {}).get("quant_method") == (
        "mxfp4" if mxfp4 else None
    )
    model = get_model(cfg.model_config, LoadConfig(), torch.device("cpu"), TorchAttentionBackend)
    moe = model.model.layers[0].mlp.experts
    assert moe.w13.mxfp4 == mxfp4  # MXFP4 experts stay in their blocks
    gen = torch.Generator().manual_seed(2)
    ids = {"a": torch.randint(0, 320, (40,), generator=gen).tolist(), "b": [5, 9, 2]}
    logits = PagedRunner(model, config, num_blocks=16).step(ids, ids)
    with torch.no_grad():
        expected = torch.cat([hf(torch.tensor([v])).logits[0] for v in ids.values()])
    if dequantize or "q8_0" not in path:
        assert_logits_close(logits, expected)
    else:
        assert (logits - expected).abs().max() <= 2e-2 * expected.abs().max()

"""The contract every ``LinearMethod`` passes: merged q/k/v and gate/up parts loaded one at a
time or as one fused tensor, and tensor-parallel slices of packed tensors, give the product
of the checkpoint's dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model.quant_checkpoints import _pack, quantize
from tokenmill.model.layers import linear as linear_module
from tokenmill.model.layers.quantization import quantization_context
from tokenmill.model.loader.quantized_weights import (
    create_quantized_weights,
    process_quantized_weights,
)

K = 128
PARTS = {"q": 64, "k": 32, "v": 32}


def _config(method: str):
    from tokenmill.model.layers.quantization import get_quantization_config

    qc = {
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True},
        "ct": {"quant_method": "compressed-tensors", "format": "pack-quantized",
               "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                                   "strategy": "group", "group_size": 32,
                                                   "symmetric": False}}}},
        "ct_fp8": {"quant_method": "compressed-tensors", "format": "float-quantized",
                   "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                                       "strategy": "channel",
                                                       "symmetric": True, "dynamic": False},
                                           "input_activations": None}}},
    }.get(method, {})
    name = {"ct": "compressed-tensors", "ct_fp8": "compressed-tensors",
            "unquantized": None}.get(method, method)
    return get_quantization_config(name, {"quantization_config": qc}, "cpu")


def checkpoint_tensors(method: str, w: torch.Tensor, seed: int
                       ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(suffix -> checkpoint tensor, dequantized [N, K] float32)`` for weight ``w``."""
    gen = torch.Generator().manual_seed(seed)
    if method in ("unquantized", "bitsandbytes"):
        return {"weight": w}, w
    if method == "gguf":
        import gguf

        from tokenmill.model.layers.quantization.tensors import GGUFTensor

        raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
        deq = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
        return ({"weight": GGUFTensor(torch.from_numpy(raw), 8, tuple(w.shape))},
                torch.from_numpy(np.array(deq)))
    if method == "ct_fp8":  # FP8 weights per output channel, 16-bit activations
        from tokenmill.kernels.quant import fp8 as q8

        q, scale = q8.quantize_per_channel(w)
        return {"weight": q, "weight_scale": scale[:, None]}, q8.dequantize(q, scale)
    q, scales, zeros = quantize(w, 32, False, gen)
    deq = ((q.view(w.shape[0], -1, 32).float() - zeros.unsqueeze(-1).float())
           * scales.float().unsqueeze(-1)).view(w.shape)
    fmt = {"ct": "ct", "gptq": "gptq", "awq": "awq"}[method]
    packed = _pack(fmt, "x", q, scales, zeros, torch.arange(w.shape[1]) // 32, False, False)
    return {k[2:]: v for k, v in packed.items()}, deq


def _fuse(method: str, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One checkpoint tensor per name holding every part (a fused qkv_proj)."""
    if method == "gguf":
        from tokenmill.model.layers.quantization.tensors import GGUFTensor

        data = torch.cat([p["weight"].data for p in parts])
        return {"weight": GGUFTensor(data, 8, (data.shape[0], K))}
    out = {}
    for name in parts[0]:
        dim = 1 if method in ("gptq", "awq") and name != "g_idx" else 0
        if name in ("g_idx", "weight_shape"):
            out[name] = parts[0][name]
            if name == "weight_shape":
                out[name] = torch.tensor([sum(int(p[name][0]) for p in parts), K])
            continue
        out[name] = torch.cat([p[name] for p in parts], dim=dim)
    return out


METHODS = ["unquantized", "gptq", "awq", "ct", "gguf", "bitsandbytes", "ct_fp8"]


def _build(method: str, make):
    config = _config(method)
    with quantization_context(config):
        layer = make()
        if config is not None:
            create_quantized_weights(layer, config)
    return layer


def _load(layer, tensors: dict[str, torch.Tensor], shard_id) -> None:
    params = dict(layer.named_parameters())
    for name, tensor in tensors.items():
        param = params[name]
        param._tm_name = name
        param.weight_loader(param, tensor, shard_id)


def _reference(method: str, deq: torch.Tensor) -> torch.Tensor:
    if method != "bitsandbytes":
        return deq
    import bitsandbytes.functional as F

    packed, state = F.quantize_4bit(deq, blocksize=64, quant_type="nf4",
                                    compress_statistics=False)
    return F.dequantize_4bit(packed, state).float()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_qkv_parts(method, fused):
    if method == "bitsandbytes":
        pytest.importorskip("bitsandbytes")
    layer = _build(method, lambda: linear_module.QKVParallelLinear(K, 16, 4, 2, bias=False))
    torch.manual_seed(0)
    tensors, deqs = {}, []
    for i, (sid, n) in enumerate(PARTS.items()):
        tensors[sid], deq = checkpoint_tensors(method, torch.randn(n, K) * 0.1, i)
        deqs.append(deq)
    if fused:
        _load(layer, _fuse(method, list(tensors.values())), None)
    else:
        for sid in ("k", "q", "v"):  # any order
            _load(layer, tensors[sid], sid)
    process_quantized_weights(layer, torch.device("cpu"))
    x = torch.randn(5, K)
    expected = x @ _reference(method, torch.cat(deqs)).t()
    tol = 1e-5 if method in ("unquantized", "bitsandbytes") else 1e-2
    assert (layer(x) - expected).abs().max() <= tol * expected.abs().max()


@pytest.mark.parametrize("method", METHODS)
def test_a_part_of_another_parts_size_is_refused(method):
    """k_proj given q_proj's rows (larger) is refused, not cut to k's rows."""
    from tokenmill.model.layers.weight_shape import WeightShapeError

    if method == "bitsandbytes":
        pytest.importorskip("bitsandbytes")
    layer = _build(method, lambda: linear_module.QKVParallelLinear(K, 16, 4, 2, bias=False))
    tensors, _ = checkpoint_tensors(method, torch.randn(PARTS["q"], K) * 0.1, 0)
    # (AWQ packs 8 output features per int32 word: 32 rows are 4 words)
    rows = PARTS["k"] // 8 if method == "awq" else PARTS["k"]
    with pytest.raises(WeightShapeError, match=f"expected {rows} along dimension"):
        _load(layer, tensors, "k")


@pytest.mark.parametrize("method", ["unquantized", "gptq", "awq", "ct", "ct_fp8"])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_tensor_parallel_slices(method, kind, monkeypatch):
    """Each of two ranks takes its slice of the full checkpoint tensors (packed ones too)."""
    torch.manual_seed(1)
    n = 64
    tensors, deq = checkpoint_tensors(method, torch.randn(n, K) * 0.1, 7)
    x = torch.randn(3, K)
    outputs = []
    for rank in range(2):
        monkeypatch.setattr(linear_module, "get_tensor_model_parallel_world_size", lambda: 2)
        monkeypatch.setattr(linear_module, "get_tensor_model_parallel_rank", lambda r=rank: r)
        if kind == "column":
            layer = _build(method, lambda: linear_module.ColumnParallelLinear(K, n))
        else:
            # No process group here: each rank's partial output is summed below.
            monkeypatch.setattr(linear_module, "tensor_model_parallel_all_reduce", lambda y: y)
            layer = _build(method, lambda: linear_module.RowParallelLinear(K, n))
        _load(layer, tensors, None)
        process_quantized_weights(layer, torch.device("cpu"))
        half = K // 2
        outputs.append(layer(x[:, rank * half:(rank + 1) * half] if kind == "row" else x))
    y = torch.cat(outputs, dim=1) if kind == "column" else outputs[0] + outputs[1]
    expected = x @ deq.t()
    tol = 1e-5 if method == "unquantized" else 1e-2
    assert (y - expected).abs().max() <= tol * expected.abs().max()

"""MXFP4 expert weights and gpt-oss' expert variant (biases, clamped SwiGLU): the torch
dequantization against transformers' on the checkpoint layout, the torch expert path
against a per-token float64 loop, and the Triton kernel (interpreter on CPU) decoding MXFP4
in registers against the torch path."""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill.kernels.moe.fused_moe import fused_experts_torch, select_experts
from tokenmill.kernels.moe.mxfp4 import FP4_E2M1_VALUES, dequantize_mxfp4
from tokenmill.kernels.moe.tiles import GatedActivation

SWIGLUOAI = GatedActivation("swigluoai", alpha=1.702, limit=7.0)


def random_mxfp4(*shape: int, gen: torch.Generator, low: int = 118, high: int = 124):
    """Random MXFP4 ``(blocks uint8 [..., K / 2], scales uint8 [..., K / 32])`` for a
    ``[..., K]`` weight: every FP4 code, scales ``2^(low - 127) .. 2^(high - 128)``."""
    *lead, k = shape
    blocks = torch.randint(0, 256, (*lead, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(low, high, (*lead, k // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_dequantize_equals_transformers_on_the_checkpoint_layout():
    """gpt-oss stores blocks ``[E, rows, K/32, 16]``; transformers dequantizes them to
    ``[E, K, rows]`` (its experts multiply ``x @ W``)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks, scales = random_mxfp4(3, 10, 96, gen=gen, low=100, high=150)
    for dtype in (torch.float32, torch.bfloat16):
        ref = convert_moe_packed_tensors(blocks.view(3, 10, 3, 16), scales, dtype=dtype)
        ours = dequantize_mxfp4(blocks, scales, dtype)
        assert ours.dtype == dtype
        torch.testing.assert_close(ours, ref.transpose(1, 2), atol=0, rtol=0)


def test_codes_nibbles_and_scales():
    # Byte 0x9A: low nibble 0xA (-1.0) is value 0, high nibble 0x9 (-0.5) value 1.
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x9A
    blocks[0, 1] = 0x07  # 6.0, then 0.0
    scales = torch.tensor([[129]], dtype=torch.uint8)  # x 4
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out[0, :4].tolist() == [-4.0, -2.0, 24.0, 0.0]
    assert FP4_E2M1_VALUES[7] == 6.0 and len(FP4_E2M1_VALUES) == 16
    with pytest.raises(ValueError, match="disagree"):
        dequantize_mxfp4(blocks, torch.zeros(1, 2, dtype=torch.uint8))


def _gpt_oss_problem(tokens: int, hidden: int, inter: int, experts: int, top_k: int, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen) * 2
    w13 = random_mxfp4(experts, 2 * inter, hidden, gen=gen)
    w2 = random_mxfp4(experts, hidden, inter, gen=gen)
    b13 = torch.randn(experts, 2 * inter, generator=gen)
    b2 = torch.randn(experts, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=gen) * 3, top_k, True)
    kwargs = dict(w13_scale=w13[1], w2_scale=w2[1], w13_bias=b13, w2_bias=b2,
                  activation=SWIGLUOAI)  # fmt: skip
    return x, w13[0], w2[0], weights, ids, kwargs


def test_torch_path_equals_gpt_oss_experts_per_token():
    """transformers' GptOssExperts formula, token by token in float64."""
    x, w13, w2, weights, ids, kw = _gpt_oss_problem(9, 64, 32, 4, 2)
    out = fused_experts_torch(x, w13, w2, weights, ids, **kw)
    dense13 = dequantize_mxfp4(w13, kw["w13_scale"], torch.float64)
    dense2 = dequantize_mxfp4(w2, kw["w2_scale"], torch.float64)
    expected = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (dense13[e] @ x[t].double() + kw["w13_bias"][e].double()).chunk(2)
            gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
            act = (up + 1) * gate * torch.sigmoid(gate * 1.702)
            expected[t] += float(weights[t, j]) * (dense2[e] @ act + kw["w2_bias"][e].double())
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)


needs_triton = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs under the Triton interpreter"
)


@needs_triton
@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,top_k,config",
    [
        (1, 64, 32, 4, 2, None),  # decode
        (21, 96, 64, 4, 3, None),  # three experts a token
        (40, 64, 96, 3, 2, dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_warps=4,
                                num_stages=1)),  # down's K = 96: a partial K tile
    ],
)
def test_triton_kernel_decodes_mxfp4_as_the_torch_path(tokens, hidden, inter, experts, top_k,
                                                       config):  # fmt: skip
    pytest.importorskip("triton")
    from tokenmill.kernels.moe.fused_moe import fused_experts_triton

    x, w13, w2, weights, ids, kw = _gpt_oss_problem(tokens, hidden, inter, experts, top_k, 1)
    expected = fused_experts_torch(x, w13, w2, weights, ids, **kw)
    got = fused_experts_triton(x, w13, w2, weights, ids, config, **kw)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


@needs_triton
def test_triton_kernel_with_biases_and_clamped_swiglu_on_plain_weights():
    pytest.importorskip("triton")
    from tokenmill.kernels.moe.fused_moe import fused_experts_triton

    x, w13, w2, weights, ids, kw = _gpt_oss_problem(13, 64, 32, 4, 2, 2)
    w13 = dequantize_mxfp4(w13, kw.pop("w13_scale"), torch.float32)
    w2 = dequantize_mxfp4(w2, kw.pop("w2_scale"), torch.float32)
    expected = fused_experts_torch(x, w13, w2, weights, ids, **kw)
    got = fused_experts_triton(x, w13, w2, weights, ids, **kw)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


@needs_triton
def test_triton_decode_equals_the_torch_dequantization(monkeypatch):
    """``decode_mxfp4``'s kernel (the interpreter standing in for CUDA) against
    ``dequantize_mxfp4``, bit for bit, on rows and bytes that do not fill its tiles."""
    pytest.importorskip("triton")
    from tokenmill.kernels.moe import mxfp4

    gen = torch.Generator().manual_seed(3)
    blocks, scales = random_mxfp4(2, 19, 96, gen=gen, low=100, high=150)
    out = torch.empty(2 * 19, 96)
    grid = (triton_cdiv(2 * 19, mxfp4._DECODE_ROWS), triton_cdiv(48, mxfp4._DECODE_BYTES))
    mxfp4._decode_kernel[grid](blocks.reshape(-1, 48), scales.reshape(-1, 3), out, 2 * 19, 48,
                               BLOCK_R=mxfp4._DECODE_ROWS, BLOCK_H=mxfp4._DECODE_BYTES)
    expected = dequantize_mxfp4(blocks, scales, torch.float32)
    torch.testing.assert_close(out.view(2, 19, 96), expected, atol=0, rtol=0)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)

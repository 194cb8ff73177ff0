"""The fused MoE Triton kernel on CUDA in bf16 against the torch path (and both against a
float32 reference), at Mixtral-like proportions scaled down to test size; MXFP4 experts with
biases and gpt-oss' clamped SwiGLU against the float32 dequantized reference."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.moe.fused_moe import (
    fused_experts_torch,
    fused_experts_triton,
    moe_tile_config,
    select_experts,
)
from tokenmill.kernels.moe.tiles import GatedActivation
from tokenmill.model.layers.fused_moe import FusedMoE

pytestmark = pytest.mark.gpu


def _problem(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    kw = dict(device="cuda", generator=gen)
    x = torch.randn(tokens, hidden, **kw).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, **kw) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, **kw) / inter**0.5).to(dtype)
    weights, ids = select_experts(torch.randn(tokens, experts, **kw), top_k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("tokens", [1, 7, 64, 333, 2048])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (16, 4)])
def test_bf16_kernel_matches_torch_path(tokens, experts, top_k):
    x, w13, w2, weights, ids = _problem(tokens, 1024, 1536, experts, top_k, torch.bfloat16)
    got = fused_experts_triton(x, w13, w2, weights, ids)
    ours_torch = fused_experts_torch(x, w13, w2, weights, ids)
    exact = fused_experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
    scale = exact.abs().max().item()
    # The kernel keeps gate/up in fp32 through the activation and rounds once; the torch path
    # rounds the GEMM outputs to bf16 first. Both stay within bf16 rounding of the fp32 result.
    err_kernel = (got.float() - exact).abs().max().item()
    err_torch = (ours_torch.float() - exact).abs().max().item()
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert err_kernel <= 2e-2 * scale, (err_kernel, scale)
    assert err_kernel <= 2 * err_torch + 1e-3 * scale, (err_kernel, err_torch)
    torch.testing.assert_close(got, ours_torch, atol=3e-2 * scale, rtol=3e-2)


@pytest.mark.parametrize("tokens", [64, 2048, 4099])
def test_grouped_mm_path_matches_torch_path(tokens):
    """Prompt-sized batches' grouped GEMM (``fused_experts_grouped_mm``, which
    ``fused_experts`` takes from ``TORCH_MIN_TOKENS`` under ``large_batch="grouped_gemm"``)
    on CUDA against the torch loop, with assignments to another rank's experts and an
    expert that gets no token."""
    from tokenmill.kernels.moe.fused_moe import (
        TORCH_MIN_TOKENS,
        fused_experts,
        fused_experts_grouped_mm,
    )

    x, w13, w2, weights, ids = _problem(tokens, 1024, 1536, 16, 4, torch.bfloat16)
    ids = ids.masked_fill(ids == 3, 4)
    expected = fused_experts_torch(x, w13, w2, weights, ids)
    scale = expected.abs().max().item()
    got = fused_experts_grouped_mm(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, expected, atol=3e-2 * scale, rtol=3e-2)
    if tokens >= TORCH_MIN_TOKENS:
        chosen = fused_experts(x, w13, w2, weights, ids, large_batch="grouped_gemm")
        torch.testing.assert_close(chosen, got, atol=0, rtol=0)
    remote = ids.masked_fill(ids == 5, -1)
    expected = fused_experts_torch(x, w13, w2, weights, remote)
    got = fused_experts_grouped_mm(x, w13, w2, weights, remote)
    torch.testing.assert_close(got, expected, atol=3e-2 * scale, rtol=3e-2)


@pytest.mark.parametrize("tokens", [5, 300])
def test_fp32_kernel_is_exact_on_gpu(tokens):
    """fp32 uses IEEE dot products (no TF32), so it agrees with the torch path tightly."""
    x, w13, w2, weights, ids = _problem(tokens, 256, 384, 8, 2, torch.float32)
    expected = fused_experts_torch(x, w13, w2, weights, ids)
    got = fused_experts_triton(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("slots_per_expert", [4, 32, 512])
def test_every_tile_config_matches(slots_per_expert):
    x, w13, w2, weights, ids = _problem(97, 512, 768, 8, 2, torch.bfloat16)
    config = moe_tile_config(slots_per_expert * 8, 8, torch.bfloat16)
    got = fused_experts_triton(x, w13, w2, weights, ids, config=config)
    expected = fused_experts_torch(x, w13, w2, weights, ids)
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, atol=3e-2 * scale, rtol=3e-2)


def test_layer_dispatches_to_the_kernel_on_cuda():
    with torch.device("cuda"):
        moe = FusedMoE(8, 2, 256, 512, renormalize=True).to(torch.bfloat16)
    torch.nn.init.normal_(moe.w13.weight, std=0.05)
    torch.nn.init.normal_(moe.w2.weight, std=0.05)
    x = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(33, 8, device="cuda")
    weights, ids = select_experts(logits, 2, True)
    expected = fused_experts_torch(x, moe.w13.weight, moe.w2.weight, weights, ids)
    scale = expected.abs().max().item()
    torch.testing.assert_close(moe(x, logits), expected, atol=3e-2 * scale, rtol=3e-2)


def _mxfp4_problem(tokens: int, hidden: int, inter: int, experts: int, top_k: int):
    """gpt-oss-like experts: MXFP4 weights (random codes, scales 2^-9 .. 2^-6), biases, the
    clamped SwiGLU; bf16 activations."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    kw = dict(device="cuda", generator=gen)

    def mxfp4(rows: int, k: int):
        blocks = torch.randint(0, 256, (experts, rows, k // 2), dtype=torch.uint8, **kw)
        return blocks, torch.randint(118, 122, (experts, rows, k // 32), dtype=torch.uint8, **kw)

    (w13, s13), (w2, s2) = mxfp4(2 * inter, hidden), mxfp4(hidden, inter)
    x = torch.randn(tokens, hidden, **kw).to(torch.bfloat16)
    extra = dict(
        w13_scale=s13, w2_scale=s2,
        w13_bias=(torch.randn(experts, 2 * inter, **kw) * 0.1).to(torch.bfloat16),
        w2_bias=(torch.randn(experts, hidden, **kw) * 0.1).to(torch.bfloat16),
        activation=GatedActivation("swigluoai", 1.702, 7.0),
    )  # fmt: skip
    weights, ids = select_experts(torch.randn(tokens, experts, **kw), top_k, renormalize=True)
    return x, w13, w2, weights, ids, extra


@pytest.mark.parametrize("tokens", [1, 8, 64, 600, 4096, 12288])
@pytest.mark.parametrize("hidden,inter,experts", [(2880, 2880, 32), (512, 320, 8)])
def test_mxfp4_kernel_against_fp32_reference(tokens, hidden, inter, experts):
    """MXFP4 experts in bf16 against the torch path on the float32 dequantized weights, at
    gpt-oss-20b's expert shapes (K = 2880, not a multiple of the 64- and 128-wide K tiles)
    and a small one; through ``fused_experts``: the scaled-dot kernel below
    ``MXFP4_TORCH_MIN_TOKENS`` tokens, the experts decoded one at a time from there on;
    with ``large_batch="grouped_gemm"`` the decoded experts' grouped GEMM from
    ``TORCH_MIN_TOKENS``."""
    from tokenmill.kernels.moe.fused_moe import fused_experts

    x, w13, w2, weights, ids, extra = _mxfp4_problem(tokens, hidden, inter, experts, 4)
    got = fused_experts(x, w13, w2, weights, ids, **extra)
    grouped = fused_experts(x, w13, w2, weights, ids, large_batch="grouped_gemm", **extra)
    exact_extra = dict(extra, w13_bias=extra["w13_bias"].float(),
                       w2_bias=extra["w2_bias"].float())  # fmt: skip
    exact = fused_experts_torch(x.float(), w13, w2, weights, ids, **exact_extra)
    scale = exact.abs().max().item()
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    err = (got.float() - exact).abs().max().item()
    assert err <= 2e-2 * scale, (err, scale)
    err = (grouped.float() - exact).abs().max().item()
    assert err <= 2e-2 * scale, (err, scale)


def test_mxfp4_every_tile_config():
    from tokenmill.kernels.moe.mxfp4_experts import mxfp4_tile_config

    x, w13, w2, weights, ids, extra = _mxfp4_problem(97, 512, 320, 8, 2)
    exact = fused_experts_torch(x.float(), w13, w2, weights, ids, **dict(
        extra, w13_bias=extra["w13_bias"].float(), w2_bias=extra["w2_bias"].float()))
    scale = exact.abs().max().item()
    for slots_per_expert in (4, 32, 512):
        config = mxfp4_tile_config(slots_per_expert * 8, 8, torch.bfloat16)
        got = fused_experts_triton(x, w13, w2, weights, ids, config, **extra)
        assert (got.float() - exact).abs().max().item() <= 2e-2 * scale


def test_mxfp4_decode_kernel_is_exact():
    """``decode_mxfp4`` on CUDA equals the torch dequantization, bit for bit, in bf16 and
    float32, on gpt-oss-20b's expert shapes."""
    from tokenmill.kernels.moe.mxfp4 import decode_mxfp4, dequantize_mxfp4

    _, w13, _, _, _, extra = _mxfp4_problem(1, 2880, 2880, 4, 2)
    for dtype in (torch.bfloat16, torch.float32):
        got = decode_mxfp4(w13, extra["w13_scale"], dtype)
        assert torch.equal(got, dequantize_mxfp4(w13, extra["w13_scale"], dtype))

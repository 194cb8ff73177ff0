"""The skinny GEMM with the residual stream passed through it: the residual added to its
output, the RMSNorm applied to its input (run by Triton's interpreter on CPU; on CUDA
where there is one). Each equals the separate norm kernel's arithmetic, rounding included."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from tokenmill.model.layers import skinny_gemm as sg  # noqa: E402
from tokenmill.model.layers.skinny_gemm import SkinnyConfig, skinny_linear  # noqa: E402

needs_kernels = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or the Triton interpreter",
)
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
FMA = SkinnyConfig(block_n=16, block_k=64, split_k=1, num_warps=4, num_stages=1, use_dot=False)
DOT = SkinnyConfig(block_n=32, block_k=32, split_k=1, num_warps=4, num_stages=1, use_dot=True)
# Whole rows of K <= 512 in one tile, as the engine's batch-1 QKV and gate/up tiles take
# K = 4,096.
ROWS = replace(FMA, block_k=512)


def _operands(m, n, k, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    return x, w, b


def _rms_norm(x, weight, eps, offset=0.0):
    """RMSNorm as the torch path computes it (fp32, rounded to x's dtype)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + offset)
    return y.to(x.dtype)


def _on(t):
    return None if t is None else t.to(DEV)


@needs_kernels
@pytest.mark.parametrize(
    "m,cfg,split_k",
    [(1, FMA, 1), (3, FMA, 3), (4, ROWS, 1), (2, replace(FMA, block_k=128), 3), (1, DOT, 1),
     (5, DOT, 2)],
    ids=["fma-1", "fma-3-split", "fma-4-one-tile", "fma-2-one-tile-split", "dot-1", "dot-5-split"],
)
def test_residual_added_to_the_rounded_product(m, cfg, split_k):
    """``residual``: the product (bias included) rounded to bf16, plus the residual in fp32,
    rounded again, as ``fused_kernels.rms_norm`` adds it: ragged N and K, split or not.
    Bit-equal on the GPU; the interpreter truncates to bf16 instead of rounding, so there
    one bf16 step may differ."""
    x, w, b = _operands(m, 100, 300, torch.bfloat16, seed=m + 10 * split_k)
    residual = torch.randn(m, 100).to(torch.bfloat16)
    got = skinny_linear(_on(x), _on(w), _on(b), config=replace(cfg, split_k=split_k),
                        residual=_on(residual)).cpu()  # fmt: skip
    product = skinny_linear(_on(x), _on(w), _on(b), config=replace(cfg, split_k=split_k)).cpu()
    expected = (product.float() + residual.float()).to(torch.bfloat16)
    rtol = 0.0 if DEV == "cuda" else 2.0**-7
    torch.testing.assert_close(got.float(), expected.float(), rtol=rtol, atol=0)
    assert got.dtype == torch.bfloat16 and got.shape == (m, 100)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_normalised_input_matches_the_norm_then_the_product(m, gated):
    """``norm_weight``: the product of RMSNorm(x) (fp32, rounded to x's dtype), with the
    norm's offset; K = 300 is not a multiple of anything, so the row's masked tail must
    not count in the mean square. Gated products take the same input."""
    x, w, b = _operands(m, 200, 300, seed=3 * m + gated)
    x = x * 3.0 + 0.5  # rows far from unit RMS
    nw = torch.rand(300) + 0.5
    normed = _rms_norm(x, nw - 1.0, 1e-5, offset=1.0)
    stream = {"norm_weight": _on(nw - 1.0), "norm_eps": 1e-5, "norm_offset": 1.0}
    got = skinny_linear(_on(x), _on(w), _on(b), config=ROWS, gated=gated, **stream).cpu()
    expected = skinny_linear(_on(normed), _on(w), _on(b), config=ROWS, gated=gated).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    y = F.linear(normed.double(), w.double(), b.double())
    if not gated:
        torch.testing.assert_close(got.double(), y, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_normalised_bf16_input_rounds_like_the_norm_kernel():
    """bf16: the normalised row is rounded to bf16 before the product, as the norm kernel
    stores it; the products then agree to fp32 summation order (bit-equal on the GPU up to
    the mean square's summation order; the interpreter truncates to bf16 instead of
    rounding, so there one bf16 step may differ)."""
    x, w, _ = _operands(1, 64, 512, torch.bfloat16, seed=4)
    nw = (torch.rand(512) + 0.5).to(torch.bfloat16)
    normed = _rms_norm(x, nw, 1e-6)
    got = skinny_linear(_on(x), _on(w), config=ROWS, norm_weight=_on(nw)).cpu()
    expected = skinny_linear(_on(normed), _on(w), config=ROWS).cpu()
    torch.testing.assert_close(got.float(), expected.float(), rtol=2.0**-7, atol=1e-2)


@needs_kernels
def test_norm_and_residual_in_one_product():
    x, w, _ = _operands(2, 96, 256, seed=8)
    nw, residual = torch.rand(256) + 0.5, torch.randn(2, 96)
    got = skinny_linear(_on(x), _on(w), config=ROWS, norm_weight=_on(nw),
                        residual=_on(residual)).cpu()  # fmt: skip
    expected = F.linear(_rms_norm(x, nw, 1e-6).double(), w.double()) + residual.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_whole_row_config():
    assert sg.whole_row_config(1, 4096, SkinnyConfig(2, 4096, 1, 8, 1, False))
    assert sg.whole_row_config(4, 300, ROWS)
    assert not sg.whole_row_config(1, 14336, SkinnyConfig(4, 512, 1, 8, 1, False))
    assert not sg.whole_row_config(1, 256, replace(DOT, block_k=256))
    assert not sg.whole_row_config(sg.FMA_MAX_M + 1, 256, ROWS)


def test_rejects_stream_operands_it_cannot_take():
    x, w, _ = _operands(2, 64, 128)
    with pytest.raises(ValueError, match="gated product cannot add a residual"):
        skinny_linear(x, w, config=ROWS, gated=True, residual=torch.zeros(2, 64))
    with pytest.raises(ValueError, match="residual must be"):
        skinny_linear(x, w, config=ROWS, residual=torch.zeros(2, 32))
    with pytest.raises(ValueError, match="residual must be"):
        skinny_linear(x, w, config=ROWS, residual=torch.zeros(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="norm_weight must be"):
        skinny_linear(x, w, config=ROWS, norm_weight=torch.ones(64))
    with pytest.raises(ValueError, match="whole rows"):
        skinny_linear(x, w, config=replace(FMA, block_k=64), norm_weight=torch.ones(128))
    with pytest.raises(ValueError, match="whole rows"):
        skinny_linear(x, w, config=DOT, norm_weight=torch.ones(128))

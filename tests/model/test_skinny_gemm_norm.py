"""An RMSNorm folded into the skinny GEMM's input (``InputNorm``): the product of the normed
rows, the new residual stored once, and the configurations that may fold it (run by
Triton's interpreter on CPU, compiled on a GPU machine)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tokenmill.model.layers import linear  # noqa: E402
from tokenmill.model.layers.skinny_gemm import (  # noqa: E402
    InputNorm,
    SkinnyConfig,
    holds_whole_rows,
    skinny_linear,
)

needs_kernels = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or the Triton interpreter",
)
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
# Whole rows: K = 300 in one 512-wide tile (masked), or K = 256 exactly (unmasked).
WHOLE = SkinnyConfig(block_n=4, block_k=512, split_k=1, num_warps=4, num_stages=1, use_dot=False)
LOOP = SkinnyConfig(block_n=16, block_k=64, split_k=1, num_warps=4, num_stages=1, use_dot=False)


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    r = torch.randn(m, k, generator=gen).to(dtype)
    g = (1.0 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    return x, r, g, w, b


def _normed(h: torch.Tensor, g: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """``fused_kernels.rms_norm``'s arithmetic in torch: fp32, rounded to h's dtype."""
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * (g.float() + offset)
    return y.to(h.dtype)


def _run(x, w, b, norm: InputNorm, cfg: SkinnyConfig = WHOLE) -> torch.Tensor:
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=DEV)
    got = skinny_linear(x, w, b, config=cfg, out=out, norm=norm)
    assert got is out
    return got.cpu()


def _to(*tensors):
    return [t.to(DEV) for t in tensors]


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("k", [300, 256], ids=["ragged-k", "even-k"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
def test_folded_norm_matches_norm_then_product_fp32(m, k, with_residual):
    """fp32 (interpreter): y equals the float64 product of RMSNorm(x + r) * (g + offset);
    ``residual_out`` holds x + r exactly for every row, and the inputs are untouched."""
    x, r, g, w, b = _to(*_operands(m, 37, k, torch.float32, seed=m + k))
    x0, r0 = x.clone(), r.clone()
    h_out = torch.full_like(r, float("nan"))
    norm = InputNorm(g, 1e-5, 0.5, r if with_residual else None, h_out if with_residual else None)
    got = _run(x, w, b, norm)
    h = x + r if with_residual else x
    expected = F.linear(_normed(h.double(), g.double(), 1e-5, 0.5), w.double(), b.double())
    torch.testing.assert_close(got.double(), expected.cpu(), rtol=1e-5, atol=1e-5)
    assert torch.equal(x, x0) and torch.equal(r, r0)
    if with_residual:
        assert torch.equal(h_out, x + r)
    else:
        assert torch.isnan(h_out).all()


@needs_kernels
def test_folded_norm_rounds_like_the_separate_kernels_bf16():
    """bf16: x + r rounded to bf16 (stored as the new residual), the normed rows rounded to
    bf16, then the product, as ``rms_norm`` then ``skinny_linear`` compute it. On a GPU the
    mean square's summation order may differ from the norm kernel's, and the interpreter
    truncates to bf16 instead of rounding, so one bf16 step may differ."""
    x, r, g, w, b = _to(*_operands(2, 64, 256, torch.bfloat16, seed=3))
    h_out = torch.empty_like(r)
    got = _run(x, w, b, InputNorm(g, 1e-6, 0.0, r, h_out))
    h = (x.float() + r.float()).to(torch.bfloat16)
    torch.testing.assert_close(h_out.float(), h.float(), rtol=2.0**-7, atol=0)
    separate = _run(_normed(h, g, 1e-6, 0.0), w, b, None)
    torch.testing.assert_close(got.float(), separate.float(), rtol=2.0**-6, atol=2.0**-6)


def test_configurations_that_hold_whole_rows():
    assert holds_whole_rows(1, 4096, SkinnyConfig(2, 4096, 1, 8, 1, False))
    assert holds_whole_rows(4, 300, WHOLE)
    assert not holds_whole_rows(1, 4096, SkinnyConfig(8, 256, 1, 4, 1, False))  # a K loop
    assert not holds_whole_rows(5, 300, WHOLE)  # more rows than the CUDA-core loop takes
    assert not holds_whole_rows(1, 300, SkinnyConfig(64, 512, 1, 4, 4, True))  # tensor cores


@needs_kernels
def test_bad_folded_norms_are_rejected():
    x, r, g, w, b = _to(*_operands(2, 37, 300, torch.float32, seed=1))
    h_out = torch.empty_like(r)
    with pytest.raises(ValueError, match="whole rows"):
        skinny_linear(x, w, b, config=LOOP, norm=InputNorm(g, 1e-6, 0.0, r, h_out))
    with pytest.raises(ValueError, match="alias"):
        skinny_linear(x, w, b, config=WHOLE, norm=InputNorm(g, 1e-6, 0.0, r, r))
    with pytest.raises(ValueError, match="go together"):
        skinny_linear(x, w, b, config=WHOLE, norm=InputNorm(g, 1e-6, 0.0, r, None))
    with pytest.raises(ValueError, match=r"\[300\] vector"):
        skinny_linear(x, w, b, config=WHOLE, norm=InputNorm(g[:100], 1e-6))
    with pytest.raises(ValueError, match="contiguous"):
        skinny_linear(x, w, b, config=WHOLE, norm=InputNorm(g, 1e-6, 0.0, r[:1], h_out[:1]))


def test_normed_dense_declines_off_cuda():
    """Off CUDA (and wherever ``dense`` would not run the skinny GEMM) the caller runs the
    norm and the product apart."""
    x, r, g, w, b = _operands(1, 37, 300, torch.bfloat16, seed=2)
    assert linear.normed_dense(x, r, InputNorm(g, 1e-6), w, b) is None

"""The skinny GEMM's prologues (run by Triton's interpreter on CPU, compiled on CUDA):
``rms_norm_linear`` and ``silu_and_mul_linear`` equal the separate norm or gate followed by
the product, for ragged shapes, split K, one and two rows."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from tokenmill.model.layers import skinny_gemm as sg  # noqa: E402
from tokenmill.model.layers.norm import RMSNorm  # noqa: E402

needs_kernels = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or the Triton interpreter",
)
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
FMA = sg.SkinnyConfig(block_n=16, block_k=64, split_k=1, num_warps=4, num_stages=1, use_dot=False)
DOT = sg.SkinnyConfig(block_n=32, block_k=32, split_k=1, num_warps=4, num_stages=1, use_dot=True)


def _randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _norm(k: int, offset: float, seed: int) -> RMSNorm:
    norm = RMSNorm(k, eps=1e-5, offset=offset)
    norm.weight.data = _randn(k, seed=seed, scale=0.2) + (0.0 if offset else 1.0)
    return norm


@needs_kernels
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_rms_norm_prologue_matches_norm_then_product_fp32(m, split_k, offset):
    n, k = 100, 300  # ragged against 16 x 64 tiles; K pads to 512 for the row reduction
    hidden, residual = _randn(m, k, seed=m), _randn(m, k, seed=10 + m)
    w, b = _randn(n, k, seed=2, scale=k**-0.5), _randn(n, seed=3)
    norm = _norm(k, offset, seed=4)
    y, new_residual = sg.rms_norm_linear(
        hidden.to(DEV), residual.to(DEV), norm.weight.to(DEV), norm.eps, w.to(DEV), b.to(DEV),
        norm_offset=offset, config=replace(FMA, split_k=split_k),
    )  # fmt: skip
    normed, summed = norm(hidden, residual)
    assert torch.equal(new_residual.cpu(), summed)
    ref = F.linear(normed.double(), w.double(), b.double())
    torch.testing.assert_close(y.cpu().double(), ref, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("split_k", [1, 3])
def test_silu_and_mul_prologue_matches_gate_then_product_fp32(m, split_k):
    n, k = 100, 300
    gate_up = _randn(m, 2 * k, seed=5 + m, scale=2.0)
    w = _randn(n, k, seed=6, scale=k**-0.5)
    y = sg.silu_and_mul_linear(gate_up.to(DEV), w.to(DEV), config=replace(FMA, split_k=split_k))
    gated = F.silu(gate_up[:, :k]) * gate_up[:, k:]
    ref = F.linear(gated.double(), w.double())
    torch.testing.assert_close(y.cpu().double(), ref, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_fp16_prologues_round_like_the_separate_kernels():
    """In a 16-bit dtype the prologue rounds where the separate kernels store: the sum,
    then the normalised (or gated) input, so the product sees the same inputs up to the
    order of the norm's sum of squares."""
    m, n, k = 2, 64, 256
    hidden = _randn(m, k, seed=7, dtype=torch.float16)
    residual = _randn(m, k, seed=8, dtype=torch.float16)
    w = _randn(n, k, seed=9, dtype=torch.float16, scale=k**-0.5)
    norm = _norm(k, 0.0, seed=10)
    norm.weight.data = norm.weight.data.half()
    y, new_residual = sg.rms_norm_linear(
        hidden.to(DEV), residual.to(DEV), norm.weight.to(DEV), norm.eps, w.to(DEV),
        config=replace(FMA, split_k=2),
    )  # fmt: skip
    normed, summed = norm(hidden, residual)
    assert torch.equal(new_residual.cpu(), summed)
    ref = sg.skinny_linear(normed.to(DEV), w.to(DEV), config=replace(FMA, split_k=2)).cpu()
    torch.testing.assert_close(y.cpu(), ref, rtol=2e-3, atol=2e-3)
    gate_up = _randn(m, 2 * k, seed=11, dtype=torch.float16)
    gated = (F.silu(gate_up[:, :k].float()) * gate_up[:, k:].float()).half()
    ref = sg.skinny_linear(gated.to(DEV), w.to(DEV), config=FMA).cpu()
    got = sg.silu_and_mul_linear(gate_up.to(DEV), w.to(DEV), config=FMA).cpu()
    assert torch.equal(got, ref)


def test_prologues_reject_what_they_cannot_take():
    k = 128
    w = torch.zeros(64, k)
    x = torch.zeros(2, k)
    norm_w = torch.ones(k)
    with pytest.raises(ValueError, match="residual must match"):
        sg.rms_norm_linear(x, x[:1], norm_w, 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight"):
        sg.rms_norm_linear(x, x, norm_w[:10], 1e-6, w)
    with pytest.raises(ValueError, match="gate_up must be"):
        sg.silu_and_mul_linear(torch.zeros(2, k), w)
    if os.environ.get("TRITON_INTERPRET") == "1":
        with pytest.raises(ValueError, match="prologue needs"):
            sg.rms_norm_linear(x, x, norm_w, 1e-6, w, config=DOT)
        with pytest.raises(ValueError, match="prologue needs"):
            sg.silu_and_mul_linear(torch.zeros(3, 2 * k), w, config=replace(FMA, block_n=16))


def test_takes_prologue_follows_the_default_main_loop():
    w = torch.zeros(4096, 4096)
    assert sg.takes_prologue(1, w) and sg.takes_prologue(2, w)
    assert not sg.takes_prologue(3, w)


@needs_kernels
def test_linear_layers_hand_their_inputs_to_the_prologues(monkeypatch):
    """``forward_after_rms_norm`` / ``forward_after_silu_and_mul`` give what the norm (or
    gate) followed by the layer gives, through the prologue and through the fallback."""
    from tokenmill.model.layers import linear
    from tokenmill.model.layers.activation import SiluAndMul

    k, n = 256, 96
    qkv = linear.ColumnParallelLinear(k, n, bias=True)
    down = linear.RowParallelLinear(k, n)
    for layer, seed in ((qkv, 20), (down, 21)):
        layer.weight.data = _randn(n, k, seed=seed, scale=k**-0.5)
    qkv.bias.data = _randn(n, seed=22)
    norm = _norm(k, 0.0, seed=23)
    hidden, residual = _randn(1, k, seed=24), _randn(1, k, seed=25)
    gate_up = _randn(1, 2 * k, seed=26)
    act = SiluAndMul()
    normed, summed = norm(hidden, residual)
    want_qkv = F.linear(normed.double(), qkv.weight.double(), qkv.bias.double())
    want_down = F.linear(act(gate_up).double(), down.weight.double())
    for fused in (False, True):
        monkeypatch.setattr(linear, "takes_prologue", lambda x, w, fused=fused: fused)
        for module in (qkv, down, norm):
            module.to(DEV)
        y, new_residual = qkv.forward_after_rms_norm(hidden.to(DEV), residual.to(DEV), norm)
        assert torch.equal(new_residual.cpu(), summed)
        torch.testing.assert_close(y.cpu().double(), want_qkv, rtol=1e-5, atol=1e-5)
        y = down.forward_after_silu_and_mul(gate_up.to(DEV), act)
        torch.testing.assert_close(y.cpu().double(), want_down, rtol=1e-5, atol=1e-5)

"""The skinny GEMM kernel equals ``F.linear`` (run by Triton's interpreter on CPU), and its
launch heuristics keep the properties the kernel's bandwidth model relies on."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from tokenmill.kernels.gemm import skinny as sg  # noqa: E402
from tokenmill.kernels.gemm import split_k  # noqa: E402
from tokenmill.kernels.gemm.skinny import SkinnyConfig, skinny_linear  # noqa: E402

needs_kernels = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or the Triton interpreter",
)
# On a GPU machine the kernel is compiled for CUDA; on CPU it runs in the interpreter.
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"

# Small tiles keep the interpreter fast and make N=100, K=300 ragged in both dimensions.
FMA = SkinnyConfig(block_n=16, block_k=64, split_k=1, num_warps=4, num_stages=1, use_dot=False)
DOT = SkinnyConfig(block_n=32, block_k=32, split_k=1, num_warps=4, num_stages=1, use_dot=True)
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


def _operands(m: int, n: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    return x, w, b


def _run(x, w, b=None, **kwargs) -> torch.Tensor:
    """The kernel on DEV, writing into a NaN-filled output so that unwritten entries show."""
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=DEV)
    got = skinny_linear(x.to(DEV), w.to(DEV), None if b is None else b.to(DEV), out=out, **kwargs)
    assert got is out
    return got.cpu()


def _reference(x, w, b=None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@needs_kernels
@pytest.mark.parametrize(
    "m,cfg",
    [(1, FMA), (2, FMA), (3, FMA), (4, FMA), (1, DOT), (3, DOT), (8, DOT), (17, DOT)],
    ids=["fma-1", "fma-2", "fma-3", "fma-4", "dot-1", "dot-3", "dot-8", "dot-17"],
)
@pytest.mark.parametrize("split_k", [1, 3])
def test_matches_reference_fp32(m, cfg, split_k):
    """Ragged N and K (not multiples of the tiles), uneven K-splits (5 tiles over 3)."""
    x, w, b = _operands(m, 100, 300, seed=10 * m + split_k + 100 * cfg.use_dot)
    got = _run(x, w, b, config=replace(cfg, split_k=split_k))
    torch.testing.assert_close(got.double(), _reference(x, w, b), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize(
    "k,split_k", [(300, 3), (128, 1), (256, 2)], ids=["ragged", "whole", "even"]
)
def test_one_tile_slices_match_reference(m, k, split_k):
    """Every program's K-slice is one tile (the CUDA-core loop's ``ONE_TILE`` path): split
    over 3 with the last slice short, unsplit, and split evenly."""
    x, w, b = _operands(m, 100, k, seed=7 * m + k)
    cfg = replace(FMA, block_k=128, split_k=split_k)
    assert sg.split_plan(k, cfg.block_k, split_k)[1] == cfg.block_k
    got = _run(x, w, b, config=cfg)
    torch.testing.assert_close(got.double(), _reference(x, w, b), rtol=1e-5, atol=1e-5)


def _gated_reference(x, w, b=None) -> torch.Tensor:
    """silu(gate) * up of ``x [gate; up]^T``, each product rounded to x's dtype first."""
    y = F.linear(x.double(), w.double(), None if b is None else b.double()).to(x.dtype).double()
    h = y.shape[1] // 2
    return F.silu(y[:, :h]) * y[:, h:]


@needs_kernels
@pytest.mark.parametrize(
    "m,cfg",
    [(1, FMA), (3, FMA), (1, replace(FMA, block_k=512)), (4, replace(FMA, block_n=2)),
     (2, replace(FMA, block_n=4)), (2, DOT), (17, DOT), (32, DOT)],
    ids=["fma-1", "fma-3", "fma-1-one-tile", "fma-4-half-1", "fma-2-half-2", "dot-2", "dot-17",
         "dot-32"],
)
@pytest.mark.parametrize("split_k", [1, 3])
def test_gated_product_matches_silu_of_the_product(m, cfg, split_k):
    """``gated=True``: the SwiGLU gate of a ``[gate; up]`` product, N/2 = 100 outputs (not a
    multiple of the half tile), ragged K, with bias, split or not."""
    x, w, b = _operands(m, 200, 300, seed=5 * m + split_k)
    got = _run_gated(x, w, b, config=replace(cfg, split_k=split_k))
    torch.testing.assert_close(got.double(), _gated_reference(x, w, b), rtol=1e-5, atol=1e-5)


def _run_gated(x, w, b=None, **kwargs) -> torch.Tensor:
    out = torch.full((x.shape[0], w.shape[0] // 2), float("nan"), dtype=x.dtype, device=DEV)
    got = skinny_linear(x.to(DEV), w.to(DEV), None if b is None else b.to(DEV), out=out,
                        gated=True, **kwargs)  # fmt: skip
    assert got is out
    return got.cpu()


@needs_kernels
@pytest.mark.parametrize("cfg", [FMA, DOT], ids=["fma", "dot"])
def test_gated_product_rounds_like_the_separate_kernels(cfg):
    """bf16: the same sums as the plain product, rounded to bf16, gated in fp32 as
    ``silu_and_mul``'s kernel computes it, then rounded again: bit-equal on the GPU. The
    interpreter truncates to bf16 instead of rounding, so there one bf16 step may differ."""
    x, w, b = _operands(2, 64, 256, torch.bfloat16, seed=9)
    cfg = replace(cfg, split_k=2)
    y = _run(x, w, b, config=cfg).float()
    gate, up = y[:, :32], y[:, 32:]
    expected = (gate / (1.0 + torch.exp(-gate)) * up).to(torch.bfloat16)
    rtol = 0.0 if DEV == "cuda" else 2.0**-7
    got = _run_gated(x, w, b, config=cfg)
    torch.testing.assert_close(got.float(), expected.float(), rtol=rtol, atol=0)


def test_gated_product_needs_even_halves():
    with pytest.raises(ValueError, match="even N"):
        sg._launch_plan(1, 101, 64, FMA, True)
    with pytest.raises(ValueError, match="even N"):
        sg._launch_plan(1, 100, 64, replace(FMA, block_n=5), True)


@needs_kernels
@pytest.mark.parametrize("cfg", [FMA, DOT], ids=["fma", "dot"])
def test_fp16_even_k_without_bias(cfg):
    """K a multiple of the tile (no K masks), fp16 in and out, no bias."""
    x, w, _ = _operands(3, 96, 256, torch.float16, seed=1 + cfg.use_dot)
    got = _run(x, w, config=replace(cfg, split_k=2))
    # fp32 sums of fp16 products, one rounding to fp16 (|y| <~ 4: half an ulp ~ 2e-3).
    torch.testing.assert_close(got.double(), _reference(x, w), rtol=2e-3, atol=2e-3)


@needs_kernels
@pytest.mark.parametrize("cfg", [FMA, DOT], ids=["fma", "dot"])
def test_strided_x_rows(cfg):
    """Rows of x taken from a wider buffer and every other row (stride(0) != K)."""
    x, w, b = _operands(4, 40, 200, seed=3 + cfg.use_dot)
    wide = torch.randn(8, 320)
    wide[::2, 16:216] = x
    view = wide[::2, 16:216]
    assert view.stride(0) == 640
    got = _run(view, w, b, config=replace(cfg, split_k=2))
    torch.testing.assert_close(got.double(), _reference(x, w, b), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_split_k_counters_reset_and_results_repeat():
    """Each launch leaves the split-K counters at zero, so the next launch (a graph replay)
    combines correctly, and the fixed summation order makes repeats bitwise equal."""
    x, w, b = _operands(2, 100, 300, seed=5)
    cfg = replace(FMA, split_k=4, block_k=32)
    first = _run(x, w, b, config=cfg)
    locks = split_k._COUNTERS[torch.empty(0, device=DEV).device]
    assert int(locks.abs().sum()) == 0
    second = _run(x, w, b, config=cfg)
    assert torch.equal(first, second)
    assert int(locks.abs().sum()) == 0
    unsplit = _run(x, w, b, config=replace(cfg, split_k=1))
    torch.testing.assert_close(first, unsplit, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_too_many_column_blocks_for_the_counters_run_unsplit(monkeypatch):
    monkeypatch.setattr(split_k, "COUNTER_SLOTS", 3)  # 7 column blocks of 16
    untouched = torch.full((3,), 100, dtype=torch.int32, device=DEV)
    monkeypatch.setitem(split_k._COUNTERS, untouched.device, untouched)
    x, w, b = _operands(1, 100, 300, seed=7)
    got = _run(x, w, b, config=replace(FMA, split_k=3))
    torch.testing.assert_close(got.double(), _reference(x, w, b), rtol=1e-5, atol=1e-5)
    assert untouched.tolist() == [100, 100, 100]


@needs_kernels
def test_default_config_runs():
    x, w, b = _operands(1, 64, 512, seed=6)
    got = skinny_linear(x.to(DEV), w.to(DEV), b.to(DEV))
    assert got.shape == (1, 64) and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got.cpu().double(), _reference(x, w, b), rtol=1e-5, atol=1e-5)


def test_rejects_what_the_kernel_cannot_address():
    x, w, b = _operands(2, 64, 128)
    with pytest.raises(ValueError, match="expected x"):
        skinny_linear(x, w[:, :64])
    with pytest.raises(ValueError, match="rows"):
        skinny_linear(torch.zeros(sg.MAX_M + 1, 128), w)
    with pytest.raises(ValueError, match="dtypes"):
        skinny_linear(x, w.double())
    with pytest.raises(ValueError, match="contiguous along K"):
        skinny_linear(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, w, b[:10])
    with pytest.raises(ValueError, match="out must be"):  # checked where the kernel runs
        skinny_linear(x.to(DEV), w.to(DEV), out=torch.empty(64, 2, device=DEV))
    if os.environ.get("TRITON_INTERPRET") == "1":
        with pytest.raises(ValueError, match="CUDA-core main loop"):
            skinny_linear(torch.zeros(8, 128), w, config=FMA)
        with pytest.raises(ValueError, match="block_n >= 16"):
            skinny_linear(x, w, config=replace(DOT, block_n=8))


def test_eligibility():
    bf16 = torch.bfloat16
    x, w = torch.zeros(8, 4096, dtype=bf16), torch.zeros(4096, 4096, dtype=bf16)
    assert sg._eligible(x, w)
    assert not sg.use_skinny_gemm(x, w)  # CPU tensors stay on F.linear
    assert sg._eligible(torch.zeros(sg.MAX_M, 4096, dtype=bf16), w)
    assert not sg._eligible(torch.zeros(sg.MAX_M + 1, 4096, dtype=bf16), w)
    assert not sg._eligible(x.float(), w.float())
    assert not sg._eligible(x.half(), w)
    assert not sg._eligible(x, w.t())  # non-contiguous weight
    assert not sg._eligible(x, torch.zeros(8, 4096, dtype=bf16))  # router-sized N
    odd_k = torch.zeros(256, 4098, dtype=bf16)  # rows not 16-byte aligned
    assert not sg._eligible(torch.zeros(8, 4098, dtype=bf16), odd_k)
    assert not sg._eligible(torch.zeros(8, 4096, dtype=bf16).t().contiguous().t(), w)


def test_split_plan_covers_k_without_empty_splits():
    for k in (64, 300, 4096, 14336, 4100):
        for block_k in (32, 128, 256):
            for split in (1, 2, 3, 4, 7, 16, 1000):
                splits, k_per_split = sg.split_plan(k, block_k, split)
                assert 1 <= splits <= max(1, split) and k_per_split % block_k == 0
                assert (splits - 1) * k_per_split < k <= splits * k_per_split


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16, 32])
@pytest.mark.parametrize("n,k", LLAMA_8B)
def test_default_config_fills_the_chip(m, n, k):
    """Enough programs for 132 SMs unless a split limit stops it; splits keep
    MIN_TILES_PER_SPLIT tiles and the partials' traffic within budget."""
    cfg = sg.default_config(m, n, k, 132)
    assert cfg.use_dot == (m > sg.FMA_DEFAULT_MAX_M)
    splits, k_per_split = sg.split_plan(k, cfg.block_k, cfg.split_k)
    assert splits == cfg.split_k  # Llama's K divides evenly into the chosen splits
    programs = triton.cdiv(n, cfg.block_n) * splits
    assert splits == 1 or k_per_split >= sg.MIN_TILES_PER_SPLIT * cfg.block_k
    assert 4 * splits * m / k <= sg.PARTIAL_TRAFFIC_BUDGET or splits == 1
    assert programs >= sg.TARGET_PROGRAMS_PER_SM * 132 or splits * 2 > min(
        sg.MAX_SPLIT_K,
        triton.cdiv(k, cfg.block_k) // sg.MIN_TILES_PER_SPLIT,
        int(sg.PARTIAL_TRAFFIC_BUDGET * k / (4 * m)),
    )


def test_tuned_table_takes_precedence(monkeypatch):
    tuned = replace(DOT, split_k=2)
    monkeypatch.setitem(sg.TUNED_CONFIGS, (8, 4096, 4096), tuned)
    assert sg.launch_config(5, 4096, 4096, 132) is tuned  # M=5 falls in bucket 8
    assert sg.launch_config(8, 4096, 4096, 114) == sg.default_config(8, 4096, 4096, 114)
    assert sg.launch_config(16, 4096, 4096, 132) == sg.default_config(16, 4096, 4096, 132)


def test_tuned_configs_launch():
    """Every tuned entry is a configuration the kernel accepts at its M bucket."""
    for (bucket, n, k), cfg in sg.TUNED_CONFIGS.items():
        assert bucket == sg.m_bucket(bucket)
        assert cfg.use_dot or bucket <= sg.FMA_MAX_M
        plan = sg._launch_plan(bucket, n, k, cfg)
        assert plan.splits * plan.k_per_split >= k


def test_has_tuned_config_only_on_the_gpu_it_was_measured_on():
    x, w = torch.empty(1, 4096), torch.empty(6144, 4096)
    assert (1, 6144, 4096) in sg.TUNED_CONFIGS
    assert not sg.has_tuned_config(x, w)  # CPU tensors


# FP8 weights (W8A16): one scale per output row, applied to the fp32 sums before the bias.
def _fp8_operands(m: int, n: int, k: int, seed: int):
    from tokenmill.kernels.quant import fp8 as q8

    x, w, b = _operands(m, n, k, seed=seed)
    w = w * torch.rand(n, 1, generator=torch.Generator().manual_seed(seed)) * 4
    q, s = q8.quantize_per_channel(w)
    return x, q, s, b, q8.dequantize(q, s)


@needs_kernels
@pytest.mark.parametrize("m,cfg", [(1, FMA), (3, FMA), (1, replace(FMA, block_k=512)),
                                   (2, DOT), (17, DOT)],
                         ids=["fma-1", "fma-3", "fma-1-one-tile", "dot-2", "dot-17"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_fp8_weight_matches_the_dequantized_product(m, cfg, split_k):
    x, q, s, b, w = _fp8_operands(m, 100, 300, seed=7 * m + split_k)
    out = torch.full((m, 100), float("nan"), device=DEV)
    got = skinny_linear(x.to(DEV), q.to(DEV), b.to(DEV), out=out, weight_scale=s.to(DEV),
                        config=replace(cfg, split_k=split_k)).cpu()
    torch.testing.assert_close(got.double(), _reference(x, w, b), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("cfg", [FMA, DOT], ids=["fma", "dot"])
def test_fp8_weight_gated_product(cfg):
    """The scales of the gate rows and of the up rows each reach their own outputs."""
    x, q, s, b, w = _fp8_operands(2, 200, 300, seed=3)
    got = skinny_linear(x.to(DEV), q.to(DEV), b.to(DEV), gated=True, weight_scale=s.to(DEV),
                        config=replace(cfg, split_k=2)).cpu()
    torch.testing.assert_close(got.double(), _gated_reference(x, w, b), rtol=1e-5, atol=1e-5)


def test_fp8_weight_operand_checks():
    x, q, s, _, _ = _fp8_operands(2, 64, 128, seed=1)
    with pytest.raises(ValueError, match="weight_scale"):
        skinny_linear(x, q)  # an FP8 weight without its scales
    with pytest.raises(ValueError, match="weight_scale must be"):
        skinny_linear(x, q, weight_scale=s[:10])
    with pytest.raises(ValueError, match="weight_scale must be"):
        skinny_linear(x, q, weight_scale=s.double())
    bf16 = torch.bfloat16
    assert sg._eligible(torch.zeros(8, 4096, dtype=bf16),
                        torch.zeros(4096, 4096, dtype=torch.float8_e4m3fn))


@pytest.mark.parametrize("m", [1, 2, 8, 32])
def test_fp8_default_config_keeps_the_tile_bytes(m):
    """One byte per weight: twice the K elements per tile, the same rows and warps."""
    bf16 = sg.default_config(m, 4096, 14336, 132)
    fp8 = sg.default_config(m, 4096, 14336, 132, weight_bytes=1)
    assert fp8.block_k == 2 * bf16.block_k and fp8.block_n == bf16.block_n
    assert fp8.use_dot == bf16.use_dot and fp8.num_warps == bf16.num_warps


def test_fp8_one_row_takes_whole_weight_rows():
    """One row of FP8 weights with K = 4096: whole rows in one tile (``FP8_ONE_TILE_MAX_K``);
    a K that is not a power of two keeps the tiled loop."""
    cfg = sg.default_config(1, 28672, 4096, 132, weight_bytes=1)
    assert (cfg.block_n, cfg.block_k, cfg.split_k, cfg.use_dot) == (4, 4096, 1, False)
    assert sg.default_config(1, 4096, 14336, 132, weight_bytes=1).block_k == 512
    assert sg.default_config(2, 28672, 4096, 132, weight_bytes=1).block_k == 512


@needs_kernels
def test_fp8_default_one_tile_config_runs():
    x, q, s, b, w = _fp8_operands(1, 64, 256, seed=11)
    got = skinny_linear(x.to(DEV), q.to(DEV), b.to(DEV), weight_scale=s.to(DEV)).cpu()
    torch.testing.assert_close(got.double(), _reference(x, w, b), rtol=1e-5, atol=1e-5)

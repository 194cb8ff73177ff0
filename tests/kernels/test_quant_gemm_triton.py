"""The int4 and GGUF dequantize-in-GEMM Triton kernels under Triton's interpreter (CPU,
float32, small shapes) against the float32 product of the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gguf_cases import random_blocks
from tokenmill.kernels.gemm import gguf as gguf_gemm
from tokenmill.kernels.gemm import int4 as int4_gemm
from tokenmill.kernels.gemm.gguf_q32 import Q32_TYPES, q32_gemv
from tokenmill.kernels.quant.gguf_blocks import BLOCK_TYPES, dequantize
from tokenmill.kernels.quant.int4_pack import pack_k

pytestmark = pytest.mark.skipif(not int4_gemm.HAS_TRITON, reason="needs Triton")

# (M, N, K, split_k): a decode row with split-K, and a multi-tile prefill-like batch.
SHAPES = [(1, 64, 256, 4), (20, 48, 256, 1)]


def _config(split: int, block_k: int = 32) -> dict[str, int]:
    return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, SPLIT_K=split, num_warps=4,
                num_stages=1)


# block_k 64 with group 32: tiles that span two groups (per-element scales); the others keep
# a tile inside one group (one scale row per tile).
@pytest.mark.parametrize("m, n, k, split", SHAPES)
@pytest.mark.parametrize("group, block_k", [(32, 32), (64, 32), (128, 32), (32, 64)])
def test_int4_kernel(m, n, k, split, group, block_k):
    gen = torch.Generator().manual_seed(group + m)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scales = torch.rand(k // group, n, generator=gen)
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.uint8, generator=gen)
    w_t = (q.float().t() - zeros.float().repeat_interleave(group, 0)) * scales.repeat_interleave(
        group, 0)
    x = torch.randn(m, k, generator=gen)
    y = int4_gemm.int4_linear(x, pack_k(q), scales, zeros, group, _config(split, block_k))
    torch.testing.assert_close(y, x @ w_t, rtol=1e-4, atol=1e-4)


def test_int4_k_step_divides_the_group():
    """16-bit tiles never span two groups (one scale and zero row per tile): the K step
    shrinks to the group, down to 32 channels."""
    for group, decode, prefill in [(32, 32, 32), (64, 64, 64), (128, 128, 64), (4096, 128, 64)]:
        for m, want in ((8, decode), (300, prefill)):
            cfg = int4_gemm.launch_config(m, 4096, 4096, torch.bfloat16, 132, group)
            assert cfg["BLOCK_K"] == want and group % cfg["BLOCK_K"] == 0


@pytest.mark.parametrize("m, n, k, split", [(20, 48, 256, 1), (5, 40, 320, 2)])
def test_int4_kernel_float16(m, n, k, split):
    """float16 activations: the tensor-core kernel equals the float32 product of the
    dequantized weight within float16's rounding; with masked rows (m = 5, 20 in 16-row
    tiles), masked columns (n = 40) and K split into three tiles and two (k = 320)."""
    group = 64
    gen = torch.Generator().manual_seed(m)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(k // group, n, generator=gen) * 0.1).half()
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.uint8, generator=gen)
    w_t = (q.float().t() - zeros.float().repeat_interleave(group, 0)) * scales.float(
    ).repeat_interleave(group, 0)
    x = torch.randn(m, k, generator=gen).half()
    cfg = dict(_config(split, 64), BLOCK_N=16)
    y = int4_gemm.int4_linear(x, pack_k(q), scales, zeros, group, cfg)
    assert y.dtype == torch.float16
    ref = x.float() @ w_t
    # float16 rounds each weight and the output at 2^-11 relative
    assert (y.float() - ref).abs().max() <= 2e-3 * ref.abs().max()


@pytest.mark.parametrize("m, split", [(1, 3), (3, 1)])
@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_int4_gemv_kernel(m, split, group):
    """The GEMV path (scale and zero applied once per group) equals the dequantized product,
    with split-K, masked rows (m = 3 in a 4-row tile) and masked columns (n = 80)."""
    n, k = 80, 512
    gen = torch.Generator().manual_seed(group + m)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scales = torch.rand(k // group, n, generator=gen)
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.uint8, generator=gen)
    w_t = (q.float().t() - zeros.float().repeat_interleave(group, 0)) * scales.repeat_interleave(
        group, 0)
    x = torch.randn(m, k, generator=gen)
    cfg = int4_gemm.gemv_config(m, n, k, group, num_sms=1)
    cfg.update(SPLIT_K=split, BLOCK_N=32, num_stages=1)
    y = int4_gemm.int4_linear(x, pack_k(q), scales, zeros, group, cfg)
    torch.testing.assert_close(y, x @ w_t, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_dequantize_then_product(group):
    """Large batches dequantize W once (``int4_dequantize``, the GEMM kernels' arithmetic)
    and multiply with torch: the weight equals the reference bit for bit."""
    n, k = 72, 256
    gen = torch.Generator().manual_seed(group)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scales = torch.rand(k // group, n, generator=gen)
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.uint8, generator=gen)
    w_t = (q.float().t() - zeros.float().repeat_interleave(group, 0)) * scales.repeat_interleave(
        group, 0)
    got = int4_gemm.int4_dequantize(pack_k(q), scales, zeros, group, torch.float32)
    assert torch.equal(got, w_t)
    x = torch.randn(5, k, generator=gen)
    y = int4_gemm.int4_linear(x, pack_k(q), scales, zeros, group, {"DEQUANT": 1})
    torch.testing.assert_close(y, x @ w_t, rtol=1e-5, atol=1e-5)


def test_int4_dequantize_in_column_slabs():
    """The slab variant (``CHUNK_N`` output columns dequantized at a time into one scratch
    buffer, timed by ``int4_kernel_bench.py --chunks``) equals the whole dequantized
    product, including a last slab narrower than the others."""
    n, k, group = 300, 256, 128
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scales = torch.rand(k // group, n, generator=gen)
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.uint8, generator=gen)
    w_t = (q.float().t() - zeros.float().repeat_interleave(group, 0)) * scales.repeat_interleave(
        group, 0)
    x = torch.randn(5, k, generator=gen)
    y = int4_gemm.int4_linear(x, pack_k(q), scales, zeros, group, {"DEQUANT": 1, "CHUNK_N": 128})
    torch.testing.assert_close(y, x @ w_t, rtol=1e-4, atol=1e-4)


TYPES = sorted(BLOCK_TYPES)


@pytest.mark.parametrize("qtype", TYPES, ids=[BLOCK_TYPES[t][0] for t in TYPES])
@pytest.mark.parametrize("m, dequantize_first", [(1, False), (20, False), (3, True)])
def test_gguf_linear(qtype, m, dequantize_first):
    """Every block type through ``gguf_linear``'s choice of product (GEMV, tensor-core
    kernel or dequantize-then-product) against the gguf package's dequantization."""
    k = 512 if BLOCK_TYPES[qtype][1] == 256 else 128
    raw = random_blocks(qtype, 40, k, seed=qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(qtype))
    expected = x @ dequantize(raw, qtype).t()
    y = gguf_gemm.gguf_linear(x, raw, qtype, dequantize_first)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("qtype", sorted(Q32_TYPES), ids=[BLOCK_TYPES[t][0]
                                                          for t in sorted(Q32_TYPES)])
@pytest.mark.parametrize("split", [1, 2])
def test_q32_gemv_partial_iterations_and_split(qtype, split):
    """The 32-weight-block GEMV over 20 blocks (a partial last iteration of 16), 37 rows (a
    partial row tile) and a K split."""
    n, k = 37, 640
    raw = random_blocks(qtype, n, k, seed=qtype + split)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(split))
    expected = x @ dequantize(raw, qtype).t()
    cfg = dict(BLOCK_N=8, NB=16, SPLIT_K=split, num_warps=2)
    y = q32_gemv(x, raw, qtype, cfg)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    with pytest.raises(ValueError, match="one row"):
        q32_gemv(torch.zeros(2, k), raw, qtype)

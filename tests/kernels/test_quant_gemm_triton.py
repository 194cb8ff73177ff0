"""The int4 and GGUF dequantize-in-GEMM Triton kernels under Triton's interpreter (CPU,
float32, small shapes) against the float32 product of the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gguf_cases import random_blocks
from tokenmill.kernels.gemm import gguf as gguf_gemm
from tokenmill.kernels.gemm import int4 as int4_gemm
from tokenmill.kernels.quant.gguf_blocks import BLOCK_TYPES, dequantize
from tokenmill.kernels.quant.int4_pack import pack_k

pytestmark = pytest.mark.skipif(not int4_gemm.HAS_TRITON, reason="needs Triton")

# (M, N, K, split_k): a decode row with split-K, and a multi-tile prefill-like batch.
SHAPES = [(1, 64, 256, 4), (20, 48, 256, 1)]


def _config(split: int) -> dict[str, int]:
    return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=split, num_warps=4, num_stages=1)


@pytest.mark.parametrize("m, n, k, split", SHAPES)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_kernel(m, n, k, split, group):
    gen = torch.Generator().manual_seed(group + m)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scales = torch.rand(k // group, n, generator=gen)
    zeros = torch.randint(0, 16, (k // group, n), dtype=torch.uint8, generator=gen)
    w_t = (q.float().t() - zeros.float().repeat_interleave(group, 0)) * scales.repeat_interleave(
        group, 0)
    x = torch.randn(m, k, generator=gen)
    y = int4_gemm.int4_linear(x, pack_k(q), scales, zeros, group, _config(split))
    torch.testing.assert_close(y, x @ w_t, rtol=1e-4, atol=1e-4)


TYPES = sorted(BLOCK_TYPES)


@pytest.mark.parametrize("qtype", TYPES, ids=[BLOCK_TYPES[t][0] for t in TYPES])
@pytest.mark.parametrize("m, split", [(1, 2), (20, 1)])
def test_gguf_kernel(qtype, m, split):
    k = 512 if BLOCK_TYPES[qtype][1] == 256 else 128
    raw = random_blocks(qtype, 40, k, seed=qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(qtype))
    expected = x @ dequantize(raw, qtype).t()
    y = gguf_gemm.gguf_linear(x, raw, qtype, _config(split))
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())

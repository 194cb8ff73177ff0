"""GGUF blocks: tokenmill's unpacking and dequantization equal the gguf package's bit for bit;
the CPU int4 planes compute the product of the exact weights (bfloat16 precision)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.gguf_cases import random_blocks
from tokenmill.kernels.cpu.block_gemm import BlockWeights
from tokenmill.kernels.quant import int4_cpu
from tokenmill.kernels.quant.gguf_blocks import BLOCK_TYPES, dequantize, unpack_blocks

TYPES = sorted(BLOCK_TYPES)


def _k(qtype: int) -> int:
    return 512 if BLOCK_TYPES[qtype][1] == 256 else 128


@pytest.mark.parametrize("qtype", TYPES, ids=[BLOCK_TYPES[t][0] for t in TYPES])
def test_dequantize_equals_gguf_bit_for_bit(qtype):
    import gguf

    raw = random_blocks(qtype, 16, _k(qtype), seed=qtype)
    expected = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(qtype))
    ours = dequantize(raw, qtype).numpy()
    assert ours.shape == expected.shape
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_dequantize_gguf_quantized_values(name):
    """Blocks the gguf package quantized from real values (not random bits)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[name]
    w = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    expected = gguf.quants.dequantize(raw, qtype)
    ours = dequantize(torch.from_numpy(raw), int(qtype)).numpy()
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=[BLOCK_TYPES[t][0] for t in TYPES])
def test_cpu_planes_compute_the_exact_weights(qtype):
    u = unpack_blocks(random_blocks(qtype, 32, _k(qtype), seed=1), qtype)
    if not int4_cpu.supports(u.group, 32, _k(qtype)):
        pytest.skip("16-weight groups: dequantized per product on the CPU")
    planes = int4_cpu.make_planes(u.q, u.scale, u.offset, u.group)
    if not isinstance(planes[0], BlockWeights):  # torch's int4 planes: wide integers split
        assert len(planes) == (1 if int(u.q.min()) >= -8 and int(u.q.max()) <= 15 else 2)
    x = torch.randn(5, _k(qtype))
    expected = x @ u.dequantize().t()
    got = int4_cpu.planes_mm(x, planes)
    assert (got - expected).abs().max() <= 1e-2 * expected.abs().max()

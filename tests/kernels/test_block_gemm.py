"""The native CPU block product (``tokenmill.kernels.cpu.block_gemm``) against float32
products of the same weights: every integer width it packs (nibbles, signed four bits, int8),
group sizes that are multiples of 32, and rows independent of the batch."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.cpu import block_gemm

pytestmark = pytest.mark.skipif(not block_gemm.available(), reason="native block product not built")


def _dense(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int):
    n, k = q.shape
    w = q.double().view(n, k // group, group) * scale.double()[..., None]
    return (w + offset.double()[..., None]).view(n, k)


@pytest.mark.parametrize("low,high", [(0, 15), (-8, 7), (-128, 127), (-32, 31), (0, 31)])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 4, 7, 16])
@pytest.mark.parametrize("scales", ["float32", "float16", "symmetric"])
def test_product_matches_float64(low, high, group, m, scales):
    """``float16``: scales and offsets that are float16 values (GGUF's), packed as such;
    ``symmetric``: no offsets (Q8_0, GPTQ's symmetric groups), none packed."""
    torch.manual_seed(low * 7 + group + m)
    n, k = 48, 256
    q = torch.randint(low, high + 1, (n, k))
    scale = torch.rand(n, k // group) * 0.02 + 0.005
    offset = torch.randn(n, k // group) * 0.05
    if scales != "float32":
        scale, offset = scale.half().float(), offset.half().float()
    if scales == "symmetric":
        offset = torch.zeros_like(scale)
    w = block_gemm.pack_blocks(q, scale, offset, group)
    assert w is not None and w.nibbles == (high - low <= 15)
    shifted = -8 <= low and high <= 7 and low < 0  # signed four bits: offset -8 * scale
    # shifting signed four bits adds -8 * scale to an offset: a float16 sum only by chance
    half = scales == "symmetric" or (scales == "float16" and not shifted)
    if scales == "float16" and shifted:
        half = torch.equal((offset - 8 * scale).half().float(), offset - 8 * scale)
    assert w.scales.dtype == (torch.float16 if half else torch.float32)
    assert (w.offsets.numel() == 0) == (scales == "symmetric" and not shifted)
    x = torch.randn(m, k) * 3
    x[0, 5] = 40.0  # an outlier in one block
    got = w.mm(x).double()
    want = x.double() @ _dense(q, scale, offset, group).t()
    # two int8 digits per activation: ~2^-16 of each block's largest value
    assert (got - want).abs().max() <= 2e-4 * want.abs().max()


def test_each_row_is_independent_of_the_others():
    torch.manual_seed(1)
    q = torch.randint(0, 16, (32, 96))
    scale, offset = torch.rand(32, 3) * 0.02, torch.randn(32, 3) * 0.01
    w = block_gemm.pack_blocks(q, scale, offset, 32)
    x = torch.randn(11, 96)
    batch = w.mm(x)
    for i in range(len(x)):
        assert torch.equal(w.mm(x[i : i + 1])[0], batch[i])
    assert torch.equal(w.mm(x[3:9]), batch[3:9])


def test_zero_rows_and_all_zero_blocks():
    q = torch.randint(-128, 128, (16, 64))
    w = block_gemm.pack_blocks(q, torch.ones(16, 2), torch.zeros(16, 2), 32)
    assert w.mm(torch.zeros(0, 64)).shape == (0, 16)
    assert torch.equal(w.mm(torch.zeros(2, 64)), torch.zeros(2, 16))


def test_unpackable_weights_are_refused():
    ones = torch.ones(16, 4)
    assert block_gemm.pack_blocks(torch.zeros(16, 64, dtype=torch.int32), ones, None, 16) is None
    assert block_gemm.pack_blocks(torch.zeros(20, 64, dtype=torch.int32), ones, None, 32) is None
    wide = torch.full((16, 64), 200)
    assert block_gemm.pack_blocks(wide, ones[:, :2], None, 32) is None


def test_bad_inputs_raise_clear_errors():
    w = block_gemm.pack_blocks(torch.randint(0, 16, (16, 64)), torch.ones(16, 2), None, 32)
    with pytest.raises(RuntimeError, match="K must be a multiple of 32|scales must be"):
        w.mm(torch.randn(2, 48))


@pytest.mark.parametrize("low,high", [(0, 15), (-128, 127)])
@pytest.mark.parametrize("half", [False, True])
def test_rows_dequantize_the_packed_weights(low, high, half):
    torch.manual_seed(2)
    q = torch.randint(low, high + 1, (48, 128))
    scale, offset = torch.rand(48, 4) * 0.02, torch.randn(48, 4) * 0.01
    if half:
        scale, offset = scale.half().float(), offset.half().float()
    w = block_gemm.pack_blocks(q, scale, offset, 32)
    ids = torch.tensor([0, 47, 17, 17, 5])
    want = _dense(q, scale, offset, 32)[ids].float()
    assert torch.allclose(w.rows(ids), want, rtol=0, atol=1e-6)

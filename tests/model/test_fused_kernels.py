"""Fused Triton kernels equal the torch layers (run by Triton's interpreter on CPU)."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from tokenmill.model.layers import fused_kernels  # noqa: E402
from tokenmill.model.layers.activation import SiluAndMul  # noqa: E402
from tokenmill.model.layers.norm import RMSNorm  # noqa: E402
from tokenmill.model.layers.rotary import RotaryEmbedding  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or the Triton interpreter",
)
# On a GPU machine the kernels are compiled for CUDA; on CPU they run in the interpreter.
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm(residual, offset):
    torch.manual_seed(0)
    norm = RMSNorm(96, eps=1e-5, offset=offset)
    norm.weight.data = torch.randn(96)
    x = torch.randn(7, 96)
    r = torch.randn(7, 96) if residual else None
    ref = norm(x, r) if residual else norm(x)
    got = fused_kernels.rms_norm(
        x.to(DEV), norm.weight.to(DEV), 1e-5, r.to(DEV) if residual else None, offset
    )
    got = tuple(g.cpu() for g in got) if residual else got.cpu()
    if residual:
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], ref[1])
    else:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_silu_and_mul():
    torch.manual_seed(0)
    x = torch.randn(5, 2 * 1100)
    got = fused_kernels.silu_and_mul(x.to(DEV)).cpu()
    torch.testing.assert_close(got, SiluAndMul()(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("heads", [(4, 2), (9, 3)])
def test_rotary_inplace(neox, rotary_dim, heads):
    torch.manual_seed(0)
    num_q, num_k = heads
    rope = RotaryEmbedding(32, rotary_dim, 64, 10000.0, is_neox_style=neox)
    pos = torch.tensor([0, 5, 63, 17, 2])
    sizes = [num_q * 32, num_k * 32, num_k * 32]
    qkv = torch.randn(5, sum(sizes))
    q, k, v = qkv.split(sizes, dim=-1)
    ref_q, ref_k = rope(pos, q.clone(), k.clone())
    qkv_dev = qkv.to(DEV)
    q, k, v_dev = qkv_dev.split(sizes, dim=-1)
    fused_kernels.rotary_inplace(
        pos.to(DEV), q, k, rope.cos_sin_cache.to(DEV), 32, rotary_dim, neox
    )
    torch.testing.assert_close(q.cpu(), ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.cpu(), ref_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(v_dev.cpu(), v)  # the values beside q and k are left alone

"""Fused Triton kernels equal the torch layers (run by Triton's interpreter on CPU)."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from tokenmill.kernels import activation, rotary  # noqa: E402
from tokenmill.kernels import norm as norm_kernels  # noqa: E402
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
    got = norm_kernels.rms_norm(
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
    got = activation.silu_and_mul(x.to(DEV)).cpu()
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
    rotary.rotary_inplace(
        pos.to(DEV), q, k, rope.cos_sin_cache.to(DEV), 32, rotary_dim, neox
    )
    torch.testing.assert_close(q.cpu(), ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.cpu(), ref_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(v_dev.cpu(), v)  # the values beside q and k are left alone


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("heads", [(4, 2), (9, 3)])
def test_rotary_and_cache(neox, rotary_dim, heads):
    """One kernel equals RoPE then the K/V write: the query rotated in place on every row,
    the rotated key and the value in their slots for the first ``num_tokens`` tokens with a
    slot (padding rows and slot -1 write nothing), ``k`` itself untouched."""
    torch.manual_seed(0)
    num_q, num_k = heads
    d, block_size, num_blocks = 32, 5, 6
    rope = RotaryEmbedding(d, rotary_dim, 64, 10000.0, is_neox_style=neox)
    pos = torch.tensor([0, 5, 63, 17, 2, 9])
    slots = torch.tensor([7, 0, -1, 29, 12, 3])  # row 5 is padding past num_tokens
    num_tokens = 5
    sizes = [num_q * d, num_k * d, num_k * d]
    qkv = torch.randn(6, sum(sizes))
    q, k, v = qkv.split(sizes, dim=-1)
    ref_q, ref_k = rope(pos, q.clone(), k.clone())
    ref_cache = torch.randn(2, num_blocks, block_size, num_k, d)
    cache = ref_cache.clone().to(DEV)
    for i in range(num_tokens):
        if slots[i] >= 0:
            b, o = divmod(int(slots[i]), block_size)
            ref_cache[0, b, o] = ref_k[i].view(num_k, d)
            ref_cache[1, b, o] = v[i].view(num_k, d)
    qkv_dev = qkv.to(DEV)
    q_dev, k_dev, v_dev = qkv_dev.split(sizes, dim=-1)
    rotary.rotary_and_cache(
        pos.to(DEV), q_dev, k_dev, v_dev, rope.cos_sin_cache.to(DEV), d, rotary_dim, neox,
        cache, slots.to(DEV), num_tokens,
    )  # fmt: skip
    torch.testing.assert_close(q_dev.cpu(), ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.cpu(), ref_cache, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_dev.cpu(), k) and torch.equal(v_dev.cpu(), v)


def test_rotary_and_cache_bf16_matches_the_two_kernels():
    """In bf16 the fused write rounds the rotated key as the unfused pair does (to the key's
    dtype, then the cache's); the compiler may contract the products into FMAs differently,
    so keys may differ in their last bit."""
    from tokenmill.kernels.attention.cache_write import reshape_and_cache

    torch.manual_seed(1)
    d, num_q, num_k, block_size = 64, 8, 2, 16
    rope = RotaryEmbedding(d, d, 128, 500000.0)
    pos = torch.arange(40, 60)
    slots = torch.randperm(64)[:20]
    qkv = torch.randn(20, (num_q + 2 * num_k) * d).to(DEV, torch.bfloat16)
    table = rope.cos_sin_cache.to(DEV)
    caches = [torch.zeros(2, 4, block_size, num_k, d, dtype=torch.bfloat16, device=DEV)]
    caches.append(caches[0].clone())
    q1, k1, v1 = qkv.clone().split([num_q * d, num_k * d, num_k * d], dim=-1)
    rotary.rotary_and_cache(
        pos.to(DEV), q1, k1, v1, table, d, d, True, caches[0], slots.to(DEV), 20
    )
    q2, k2, v2 = qkv.clone().split([num_q * d, num_k * d, num_k * d], dim=-1)
    rotary.rotary_inplace(pos.to(DEV), q2, k2, table, d, d, True)
    reshape_and_cache(k2, v2, caches[1], slots.to(DEV), 20)
    assert torch.equal(q1, q2)
    torch.testing.assert_close(caches[0], caches[1], rtol=2**-7, atol=2**-7)


def test_dependent_launches_stay_off_where_they_cannot_run():
    """CPU tensors (and Triton's interpreter) never get grid dependency control; the
    kernels then take USE_PDL=False."""
    from tokenmill.kernels import pdl

    assert not pdl.supported(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}


def test_dependent_launches_are_never_asked_of_rocm(monkeypatch):
    """A ROCm device is ``cuda`` to torch and an MI300 reports capability (9, 4); Triton's
    grid dependency control exists only for NVIDIA GPUs."""
    from tokenmill.kernels import pdl

    monkeypatch.setattr(pdl, "_capability_major", lambda index: 9)
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    assert not pdl.supported(torch.device("cuda", 0))
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert pdl.supported(torch.device("cuda", 0)) == pdl.HAS_TRITON


@pytest.mark.parametrize("heads,head_dim", [(16, 80), (3, 8)])
def test_vision_rotary_inplace(heads, head_dim):
    """The vision tower's patch rotary (a half of 40: no power of two) on q and k views of
    a fused qkv output, in place, equals transformers' float32 formula; v is left alone."""
    from tokenmill.kernels.vision import vision_rotary_inplace, vision_rotary_torch

    torch.manual_seed(0)
    s = 37
    qkv = torch.randn(s, 3 * heads * head_dim)
    freqs = torch.randn(s, head_dim // 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q, k, v = qkv.view(s, 3, heads, head_dim).unbind(1)
    ref_q, ref_k = vision_rotary_torch(q, cos, sin), vision_rotary_torch(k, cos, sin)
    dev = qkv.to(DEV)
    qd, kd, vd = dev.view(s, 3, heads, head_dim).unbind(1)
    vision_rotary_inplace(qd, kd, cos.to(DEV), sin.to(DEV))
    torch.testing.assert_close(qd.cpu(), ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kd.cpu(), ref_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(vd.cpu(), v)

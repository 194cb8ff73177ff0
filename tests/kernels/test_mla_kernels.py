"""Multi-head latent attention's Triton kernels (Triton's interpreter on CPU, float32) against
the torch reference: the decode kernel over a paged latent cache, with and without splits of
the context, and the rotation fused with the latent write. Small shapes; the real DeepSeek
dimensions run in ``tests/gpu/test_mla_gpu.py``."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_mla_gpu.py", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from tokenmill.kernels.attention.mla_cache import mla_rope_and_cache  # noqa: E402
from tokenmill.kernels.attention.mla_decode import (  # noqa: E402
    mla_decode,
    mla_decode_tiles,
    mla_num_splits,
)
from tokenmill.model.attention.mla import MLAImpl, attend_latent_torch  # noqa: E402
from tokenmill.model.layers.rotary import RotaryEmbedding  # noqa: E402

RANK, ROPE, BLOCK = 32, 16, 16


def _decode_problem(num_heads: int, seq_lens: list[int], num_blocks: int = 24, seed: int = 0):
    """Queries and a latent cache whose unwritten slots hold NaN, block ids scattered and
    spare table entries pointing at other blocks."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    cache = torch.full((num_blocks, BLOCK, RANK + ROPE), float("nan"))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(1, max(-(-s // BLOCK) for s in seq_lens)) + 1
    table = torch.zeros(batch, width, dtype=torch.int32)
    for b, length in enumerate(seq_lens):
        blocks = [perm.pop() for _ in range(-(-length // BLOCK))]
        table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        table[b, len(blocks) :] = perm[0]  # a valid id past the context
        for pos in range(length):
            cache[blocks[pos // BLOCK], pos % BLOCK] = torch.randn(RANK + ROPE, generator=gen)
    q_lat = torch.randn(num_heads, batch, RANK, generator=gen)
    q_pe = torch.randn(batch, num_heads, ROPE, generator=gen)
    return q_lat, q_pe, cache, table, torch.tensor(seq_lens, dtype=torch.int32)


def _reference(q_lat, q_pe, cache, table, seq_lens, scale):
    # The torch reference gathers whole blocks: NaN in unwritten slots would poison its
    # masked matmuls, so it reads a cache with those slots zeroed.
    return attend_latent_torch(q_lat, q_pe, cache.nan_to_num(0.0), table, seq_lens, RANK, scale)


@pytest.mark.parametrize("num_heads", [4, 20])
@pytest.mark.parametrize("splits", [None, 1, 2, 4])
@pytest.mark.parametrize("heads_major", [False, True])
def test_decode_kernel_matches_torch(num_heads, splits, heads_major):
    seq_lens = [1, 15, 16, 17, 50, 0]
    q_lat, q_pe, cache, table, lens = _decode_problem(num_heads, seq_lens)
    tiles = dataclasses.replace(mla_decode_tiles(torch.float32), heads_major=heads_major)
    got = mla_decode(q_lat, q_pe, cache, table, lens, 0.3, max(seq_lens), tiles=tiles,
                     num_splits=splits)  # fmt: skip
    expected = _reference(q_lat, q_pe, cache, table, lens, 0.3)
    assert got.shape == (num_heads, len(seq_lens), RANK)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert bool((got[:, -1] == 0).all())  # a context of 0 attends to nothing


def test_decode_kernel_reads_strided_queries():
    """The absorbed query comes out of a batched product as ``[H, B, R]``; the rotary query
    is a view into the ``[B, H, nope + rope]`` query rows."""
    q_lat, q_pe, cache, table, lens = _decode_problem(4, [9, 33])
    rows = torch.randn(2, 4, 8 + ROPE)
    rows[..., 8:] = q_pe
    got = mla_decode(q_lat.transpose(0, 1).contiguous().transpose(0, 1), rows[..., 8:], cache,
                     table, lens, 0.5, 33, num_splits=2)  # fmt: skip
    torch.testing.assert_close(got, _reference(q_lat, q_pe, cache, table, lens, 0.5))


def test_split_count_fills_the_device_once_and_follows_the_context():
    assert mla_num_splits(batch=256, num_head_blocks=8, max_seq_len=4096, sms=132) == 1
    assert mla_num_splits(batch=1, num_head_blocks=8, max_seq_len=100_000, sms=132) == 16
    assert mla_num_splits(batch=1, num_head_blocks=8, max_seq_len=600, sms=132) == 2
    assert mla_num_splits(batch=4, num_head_blocks=8, max_seq_len=100, sms=132) == 1
    with pytest.raises(ValueError, match="power of two"):
        mla_decode(*_decode_problem(4, [5])[:5], 0.5, 5, num_splits=3)


@pytest.mark.parametrize("neox", [True, False])
def test_rope_and_cache_matches_torch(neox):
    heads, nope, tokens = 3, 8, 5
    gen = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(ROPE, ROPE, 64, 10000.0, is_neox_style=neox)
    positions = torch.tensor([0, 7, 3, 40, 12])
    query = torch.randn(tokens, heads * (nope + ROPE), generator=gen)
    latent = torch.randn(tokens, RANK + ROPE, generator=gen)  # kv_a's output: [c | k_pe]
    kv_c, k_pe = latent[:, :RANK], latent[:, RANK:]
    slots = torch.tensor([5, -1, 17, 30, 2])  # one padding token; the last is past num_tokens
    cache = torch.zeros(3, BLOCK, RANK + ROPE)
    q_kernel = query.clone()
    mla_rope_and_cache(positions, q_kernel, kv_c, k_pe, rope.cos_sin_cache, neox, heads, nope,
                       cache, slots, num_tokens=4)  # fmt: skip

    q_ref = query.clone().view(tokens, heads, nope + ROPE)
    q_ref[..., nope:] = rope.rotate(positions, q_ref[..., nope:])
    k_rot = rope.rotate(positions, k_pe[:, None, :]).squeeze(1)
    expected = torch.zeros_like(cache)
    flat = expected.view(-1, RANK + ROPE)
    for t in (0, 2, 3):
        flat[slots[t]] = torch.cat([kv_c[t], k_rot[t]])
    torch.testing.assert_close(q_kernel, q_ref.view(tokens, -1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache, expected, atol=1e-6, rtol=1e-6)


def test_torch_write_skips_padding_slots():
    impl = MLAImpl.__new__(MLAImpl)
    cache = torch.zeros(2, BLOCK, RANK + ROPE)
    kv_c, k_pe = torch.ones(3, RANK), torch.full((3, ROPE), 2.0)
    impl.write_latent(kv_c, k_pe, cache, torch.tensor([3, -1, 20]), num_tokens=3)
    flat = cache.view(-1, RANK + ROPE)
    assert bool((flat[3, :RANK] == 1).all()) and bool((flat[20, RANK:] == 2).all())
    assert int((flat.abs().sum(-1) > 0).sum()) == 2

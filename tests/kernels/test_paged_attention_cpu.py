"""The native paged decode attention (``tokenmill_cpu.paged_decode_attention``) against a
float64 reference over gathered keys: scattered blocks, lengths of 1 and lengths that are
not multiples of the block size, GQA and MHA, sliding windows, float32/bfloat16/float16
caches. Slots no request owns hold NaN, so a read past a request's keys fails. A request's
output is bit-identical alone, in any batch and on any number of threads."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.paged_cases import scattered_cache
from tokenmill.kernels.cpu.native import native_ops

BLOCK_SIZE = 16
# 1 token; a full block; one past it; SmolLM2's decode context; short and odd lengths.
LENGTHS = [1, 16, 17, 230, 5, 100, 33]


@pytest.fixture(scope="module")
def ops():
    ops = native_ops()
    if ops is None:
        pytest.skip("the native CPU kernels cannot be built here")
    return ops


def make_case(lengths, num_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float32, seed=0):
    """Query ``[B, H, D]``, a NaN-filled cache with each request's keys in shuffled blocks,
    block table rows with spare columns of other valid ids, and the lengths (int32)."""
    gen = torch.Generator().manual_seed(seed)
    cache, table = scattered_cache(lengths, num_kv_heads, head_dim, BLOCK_SIZE, gen,
                                   float("nan"), spare_blocks=5, spare_columns=2)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen) * 2.0
    return q, cache.to(dtype), table, torch.tensor(lengths, dtype=torch.int32)


def reference(q, cache, table, seq_lens, scale, window=0):
    """Each request's attention over its gathered keys, float64."""
    _, _, bs, hkv, d = cache.shape
    flat = cache.double().view(2, -1, hkv, d)
    group = q.shape[1] // hkv
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, n in enumerate(seq_lens.tolist()):
        start = max(0, n - window) if window else 0
        slots = [int(table[i, p // bs]) * bs + p % bs for p in range(start, n)]
        k = flat[0, slots].repeat_interleave(group, 1).transpose(0, 1)  # [H, L, D]
        v = flat[1, slots].repeat_interleave(group, 1).transpose(0, 1)
        w = (torch.einsum("hd,hld->hl", q[i].double(), k) * scale).softmax(-1)
        out[i] = torch.einsum("hl,hld->hd", w, v)
    return out


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1), (12, 2)], ids=str)
@pytest.mark.parametrize("window", [0, 5, 40])
@pytest.mark.parametrize("head_dim", [64, 16, 128])
def test_matches_reference(ops, heads, window, head_dim):
    q, cache, table, lens = make_case(LENGTHS, *heads, head_dim=head_dim)
    scale = head_dim**-0.5
    out = ops.paged_decode_attention(q, cache, table, lens, scale, window)
    expected = reference(q, cache, table, lens, scale, window)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_caches(ops, dtype):
    q, cache, table, lens = make_case(LENGTHS, dtype=dtype)
    out = ops.paged_decode_attention(q, cache, table, lens, 0.125, 0)
    # The reference reads the same rounded keys and values, widened exactly.
    torch.testing.assert_close(out.double(), reference(q, cache, table, lens, 0.125),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_long_context(ops):
    q, cache, table, lens = make_case([4000, 1], seed=3)
    out = ops.paged_decode_attention(q, cache, table, lens, 0.125, 0)
    torch.testing.assert_close(out.double(), reference(q, cache, table, lens, 0.125),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_a_request_alone_or_in_any_batch_gives_the_same_bits(ops):
    q, cache, table, lens = make_case(LENGTHS)
    threads = torch.get_num_threads()
    try:
        batched = ops.paged_decode_attention(q, cache, table, lens, 0.125, 0)
        torch.set_num_threads(1)
        one_thread = ops.paged_decode_attention(q, cache, table, lens, 0.125, 0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, one_thread)
    for i in range(len(LENGTHS)):
        alone = ops.paged_decode_attention(q[i : i + 1], cache, table[i : i + 1],
                                           lens[i : i + 1], 0.125, 0)  # fmt: skip
        assert torch.equal(alone[0], batched[i])
    order = torch.randperm(len(LENGTHS), generator=torch.Generator().manual_seed(1))
    shuffled = ops.paged_decode_attention(q[order], cache, table[order], lens[order], 0.125, 0)
    assert torch.equal(shuffled, batched[order])


def test_strided_queries_and_empty_requests(ops):
    q, cache, table, lens = make_case([7, 0, 20])
    wide = torch.randn(3, 9, 128)
    wide[..., :64] = q
    out = ops.paged_decode_attention(wide[..., :64], cache, table, lens, 0.125, 0)
    assert torch.equal(out, ops.paged_decode_attention(q, cache, table, lens, 0.125, 0))
    assert torch.equal(out[1], torch.zeros(9, 64))


def test_bad_arguments_are_refused(ops):
    q, cache, table, lens = make_case([20, 3])
    attend = ops.paged_decode_attention
    with pytest.raises(RuntimeError, match="reads block"):
        attend(q, cache, torch.full_like(table, cache.shape[1]), lens, 0.1, 0)
    with pytest.raises(RuntimeError, match="block table row covers"):
        attend(q, cache, table[:, :1], lens, 0.1, 0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        attend(q[..., :8], cache[..., :8].contiguous(), table, lens, 0.1, 0)
    with pytest.raises(RuntimeError, match="not a multiple of"):
        attend(q[:, :8], cache, table, lens, 0.1, 0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        attend(q, cache.double(), table, lens, 0.1, 0)
    with pytest.raises(RuntimeError, match="seq_lens must be"):
        attend(q, cache, table, lens.long(), 0.1, 0)


def _rotate_ref(x, cs, rot, neox):
    """``x [..., D]`` rotated by table rows ``cs [..., rot]`` (cos | sin), float64."""
    x = x.double().clone()
    half = rot // 2
    cos, sin = cs[..., :half].double(), cs[..., half:].double()
    if neox:
        a, b = x[..., :half].clone(), x[..., half:rot].clone()
        x[..., :half], x[..., half:rot] = a * cos - b * sin, b * cos + a * sin
    else:
        a, b = x[..., 0:rot:2].clone(), x[..., 1:rot:2].clone()
        x[..., 0:rot:2], x[..., 1:rot:2] = a * cos - b * sin, b * cos + a * sin
    return x


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot", [64, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k_normed", [False, True])
def test_rotary_variant_writes_the_new_kv_then_attends(ops, neox, rot, dtype, k_normed):
    """The rotary variant equals: rotate q and k at position seq_len - 1, store k and v in
    that token's slot, then the plain kernel."""
    q, cache, table, lens = make_case(LENGTHS, dtype=dtype, seed=3)
    b, hkv, d = len(LENGTHS), 3, 64
    gen = torch.Generator().manual_seed(4)
    # k and v as column slices of one projection output, like a QKV split
    qkv = torch.randn(b, (9 + 2 * hkv) * d, generator=gen)
    k, v = qkv[:, 9 * d : 12 * d], qkv[:, 12 * d :]
    if k_normed:  # a QK-norm's output (Gemma 3, Qwen3): k contiguous, v still a slice
        k = k.contiguous()
    cos_sin = torch.randn(300, rot, generator=gen)
    pos = (lens - 1).long()
    expected_cache = cache.clone()
    flat = expected_cache.view(2, -1, hkv, d)
    slots = table.long()[torch.arange(b), pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    flat[0, slots] = _rotate_ref(k.view(b, hkv, d), cos_sin[pos][:, None], rot, neox).to(dtype)
    flat[1, slots] = v.view(b, hkv, d).to(dtype)
    q_rot = _rotate_ref(q, cos_sin[pos][:, None], rot, neox).float()
    expected = ops.paged_decode_attention(q_rot, expected_cache, table, lens, 0.125, 0)
    out = ops.paged_decode_attention_rotary(q, k, v, cache, slots, table, lens, cos_sin, rot,
                                            neox, 0.125, 0)  # fmt: skip
    torch.testing.assert_close(cache.float(), expected_cache.float(), rtol=1e-6, atol=1e-6,
                               equal_nan=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_rotary_variant_refuses_positions_past_the_table(ops):
    q, cache, table, lens = make_case([5, 300])
    kv = torch.zeros(2, 3 * 64)
    with pytest.raises(RuntimeError, match="rotary table has 100"):
        ops.paged_decode_attention_rotary(q, kv, kv, cache, torch.zeros(2, dtype=torch.long),
                                          table, lens, torch.zeros(100, 64), 64, True, 0.125,
                                          0)  # fmt: skip


def test_rotary_variant_writes_nothing_for_a_negative_slot(ops):
    """A row whose slot is -1 (a draft past the model length) writes no K/V, as the cache
    write of the other paths; the rows around it still write theirs."""
    q, cache, table, lens = make_case(LENGTHS, seed=5)
    b, hkv, d = len(LENGTHS), 3, 64
    k = torch.randn(b, hkv * d)
    pos = (lens - 1).long()
    slots = table.long()[torch.arange(b), pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    skipped = slots.clone()
    skipped[1] = -1
    cos_sin, expected = torch.randn(300, 64), cache.clone()
    ops.paged_decode_attention_rotary(q, k, k, expected, slots, table, lens, cos_sin, 64, True,
                                      0.125, 0)  # fmt: skip
    ops.paged_decode_attention_rotary(q, k, k, cache, skipped, table, lens, cos_sin, 64, True,
                                      0.125, 0)  # fmt: skip
    flat, want = cache.view(2, -1, hkv, d), expected.view(2, -1, hkv, d)
    assert not torch.equal(flat[:, slots[1]], want[:, slots[1]])  # row 1 not written
    others = slots[torch.arange(b) != 1]
    torch.testing.assert_close(flat[:, others], want[:, others], rtol=1e-6, atol=1e-6)

"""The Triton attention kernels on CUDA in bf16/fp16 against an fp32 torch reference.

Inputs are unit-variance and rounded to the kernel dtype before both runs, so the error
measured is the kernels' own: probabilities cast to bf16/fp16 for the P @ V product and the
output rounding. Tolerance: max abs error <= 2e-2 (bf16 keeps 8 mantissa bits; attention
outputs are weighted means of unit-variance values, so |out| <= ~3).

Kernel modules are imported inside the tests: defining them at collection time on a machine
without CUDA would stop the interpreter-mode CPU tests from running in the same session.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill.model.attention.backend import AttentionMetadata

pytestmark = pytest.mark.gpu

ATOL = 2e-2
DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float16]


@dataclasses.dataclass
class Batch:
    query: torch.Tensor  # [T, H * D], kernel dtype
    key: torch.Tensor  # [T, Hkv * D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]; NaN where never written
    metadata: AttentionMetadata
    num_heads: int
    num_kv_heads: int
    head_dim: int


def make_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    num_decodes: int = 0,
    max_seq_len: int | None = None,
    query_scale: float = 1.0,
    seed: int = 0,
) -> Batch:
    """Requests of ``q_lens[i]`` new tokens after ``ctx_lens[i]`` cached ones, in scattered
    blocks; cache slots nothing wrote hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 2
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(n)] for n in needed]
    width = max(needed) + 1
    rows = [
        t + torch.randint(num_blocks, (width - len(t),), generator=gen).tolist() for t in tables
    ]
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    slots = []
    for table, c, s in zip(tables, ctx_lens, seq_lens, strict=True):
        pos = torch.arange(s)
        all_slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        flat[:, all_slots[:c]] = torch.randn(2, c, num_kv_heads, head_dim, generator=gen)
        slots += all_slots[c:].tolist()
    t = len(slots)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=t,
        num_reqs=len(q_lens),
        query_start_loc=qsl.to(DEVICE),
        seq_lens=sl.to(DEVICE),
        block_table=torch.tensor(rows, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        max_query_len=max(q_lens),
        max_seq_len=max_seq_len or max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=sl,
        num_decodes=num_decodes,
    )

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    return Batch(
        query=rand(t, num_heads * head_dim, scale=query_scale),
        key=rand(t, num_kv_heads * head_dim),
        value=rand(t, num_kv_heads * head_dim),
        kv_cache=kv_cache.to(DEVICE, dtype),
        metadata=metadata,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )


def check(
    b: Batch,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Triton (poisoned output, NaN stale slots) against the fp32 reference (NaN read as 0);
    ``sinks`` (float32) go to the kernels in the query's dtype, as a model holds them."""
    from tokenmill.kernels.attention.cache_write import reshape_and_cache
    from tokenmill.model.attention.torch_ref import TorchAttentionImpl, write_to_kv_cache
    from tokenmill.model.attention.triton_backend import TritonAttentionImpl

    args = (b.num_heads, b.head_dim, b.head_dim**-0.5, b.num_kv_heads, sliding_window, soft_cap,
            chunk)  # fmt: skip
    kernel_sinks = None if sinks is None else sinks.to(DEVICE, b.query.dtype)
    md = b.metadata
    n = md.num_actual_tokens
    cache = b.kv_cache.clone()
    reshape_and_cache(b.key, b.value, cache, md.slot_mapping, n)
    out = torch.full((b.query.shape[0], b.num_heads * b.head_dim), float("nan"), device=DEVICE)
    out = out.to(b.query.dtype)
    impl = TritonAttentionImpl(*args, sinks=kernel_sinks)
    impl.attend(b.query, cache, dataclasses.replace(md), out=out)

    expected_cache = b.kv_cache.clone()
    write_to_kv_cache(b.key[:n], b.value[:n], expected_cache, md.slot_mapping[:n])
    torch.testing.assert_close(cache, expected_cache, atol=0, rtol=0, equal_nan=True)

    ref_sinks = None if kernel_sinks is None else kernel_sinks.float()
    ref = TorchAttentionImpl(*args, sinks=ref_sinks).forward(
        b.query.float(), b.key.float(), b.value.float(),
        torch.nan_to_num(b.kv_cache.float(), nan=0.0), dataclasses.replace(md),
    )  # fmt: skip
    assert out.dtype == b.query.dtype
    assert not out[:n].isnan().any(), "a real token's output row was not written"
    err = (out[:n].float() - ref[:n]).abs().max().item()
    assert err <= ATOL, f"max abs error {err:.3g} > {ATOL}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(32, 8, 128), (16, 16, 64), (8, 1, 256), (12, 4, 80), (28, 4, 128)],
)
def test_mixed_batch(dtype, num_heads, num_kv_heads, head_dim):
    # Three decodes, a fresh prompt, a chunk after cached context.
    b = make_batch(
        [1, 1, 1, 700, 300], [1000, 4000, 17, 0, 2000],
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
        num_decodes=3,
    )  # fmt: skip
    check(b)


@pytest.mark.parametrize("block_size", [8, 32, 128])
def test_block_sizes(block_size):
    b = make_batch(
        [1, 1, 333, 95], [70, 999, 0, 517], num_heads=32, num_kv_heads=8, head_dim=128,
        dtype=torch.bfloat16, block_size=block_size, num_decodes=2,
    )  # fmt: skip
    check(b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window_and_soft_cap(dtype):
    # Gemma-2/3-like: head_dim 256, window 512, soft cap 50.
    b = make_batch(
        [1, 1, 900, 200], [3000, 100, 0, 1500], num_heads=8, num_kv_heads=4, head_dim=256,
        dtype=dtype, num_decodes=2, query_scale=3.0,
    )  # fmt: skip
    check(b, sliding_window=512)
    check(b, soft_cap=50.0)
    check(b, sliding_window=512, soft_cap=50.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bidirectional_spans(dtype):
    """Gemma-3-4B-like layers (8 query heads over 4, head_dim 256, window 1024) whose prompts
    hold 256-token image spans that attend both ways (``AttentionMetadata.last_key_pos``):
    a fresh prompt with two spans, a chunk after cached context whose span began there."""
    b = make_batch(
        [1, 1, 900, 400], [3000, 100, 0, 1500], num_heads=8, num_kv_heads=4, head_dim=256,
        dtype=dtype, num_decodes=2, query_scale=3.0,
    )  # fmt: skip
    spans = {2: [(10, 266), (300, 556)], 3: [(1400, 1656), (1700, 1900)]}
    starts = b.metadata.query_start_loc_cpu.tolist()
    last = []
    for r in range(b.metadata.num_reqs):
        seq_len, q_len = int(b.metadata.seq_lens_cpu[r]), starts[r + 1] - starts[r]
        for pos in range(seq_len - q_len, seq_len):
            ends = [hi - 1 for lo, hi in spans.get(r, []) if lo <= pos < hi]
            last.append(ends[0] if ends else pos)
    md = dataclasses.replace(b.metadata, last_key_pos=torch.tensor(last, dtype=torch.int32,
                                                                    device=DEVICE))  # fmt: skip
    b = dataclasses.replace(b, metadata=md)
    check(b)
    check(b, sliding_window=1024)
    check(b, sliding_window=200, soft_cap=50.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_and_chunked_attention(dtype):
    """gpt-oss-like (64 query heads over 8, head_dim 64, window 128, sinks) and Llama-4-like
    (40 over 8, head_dim 128, chunks of 256) layers, over decodes split across programs, a
    fresh prompt longer than the window and chunk, and a chunk after cached context."""
    sinks = torch.randn(64, generator=torch.Generator().manual_seed(2)) * 2
    b = make_batch(
        [1, 1, 1, 900, 200], [3000, 100, 7, 0, 1500], num_heads=64, num_kv_heads=8,
        head_dim=64, dtype=dtype, num_decodes=3, query_scale=3.0,
    )  # fmt: skip
    check(b, sinks=sinks)
    check(b, sliding_window=128, sinks=sinks)
    check(b, chunk=256, sinks=sinks)
    b = make_batch(
        [1, 1, 700, 300], [5000, 40, 0, 2000], num_heads=40, num_kv_heads=8, head_dim=128,
        dtype=dtype, num_decodes=2,
    )  # fmt: skip
    check(b, chunk=256)
    check(b, chunk=8192)
    check(shared_prefix(make_batch(
        [1] * 16, [700] * 16, num_heads=64, num_kv_heads=8, head_dim=64, dtype=dtype,
        num_decodes=16,
    ), 16, 40), sinks=sinks)  # fmt: skip


def test_long_decode_small_batch():
    from tokenmill.kernels.attention import paged
    from tokenmill.kernels.device import num_sms

    b = make_batch(
        [1, 1], [16000, 333], num_heads=32, num_kv_heads=8, head_dim=128,
        dtype=torch.bfloat16, num_decodes=2,
    )  # fmt: skip
    sms = num_sms(torch.device(DEVICE))
    assert paged.num_decode_splits(2, 8, b.metadata.max_seq_len, sms) > 1
    check(b)


def test_large_decode_batch():
    ctx = torch.randint(1, 2000, (256,), generator=torch.Generator().manual_seed(1)).tolist()
    b = make_batch(
        [1] * 256, ctx, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
    )  # fmt: skip
    check(b)


@pytest.mark.parametrize("tile", [0, 1, 2], ids=["4-warps", "2-warps", "1-warp"])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_tiles_of_every_wave(monkeypatch, tile, splits):
    """Each decode tile the wave rule picks at head_dim 128, on 72 decodes of varied
    contexts, whole or split in three (empty splits at the shortest contexts)."""
    from tokenmill.kernels.attention import launch as triton_launch
    from tokenmill.kernels.attention import paged

    cfg = triton_launch.DECODE_TILES_D128[tile][1]
    monkeypatch.setattr(paged, "decode_tile_config", lambda *args: cfg)
    monkeypatch.setattr(paged, "num_decode_splits", lambda *args: splits)
    ctx = torch.randint(1, 3000, (72,), generator=torch.Generator().manual_seed(2)).tolist()
    b = make_batch(
        [1] * 72, ctx, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
        num_decodes=72,
    )  # fmt: skip
    check(b)
    check(b, sliding_window=700, soft_cap=30.0)


def test_decode_cuda_graph_replays_with_new_lengths():
    """Capture one decode step for 8 requests, then replay it with other contexts."""
    from tokenmill.model.attention.triton_backend import TritonAttentionImpl

    batch, heads, kv_heads, dim, max_len = 8, 32, 8, 128, 8192
    steps = [
        make_batch([1] * batch, [int(c) for c in ctx], num_heads=heads, num_kv_heads=kv_heads,
                   head_dim=dim, dtype=torch.bfloat16, seed=seed)
        for seed, ctx in enumerate(([5000, 3, 17, 800, 8000, 1, 64, 300], [40] * batch))
    ]  # fmt: skip
    # Static buffers sized for the longest step; each step's blocks live in one shared cache.
    num_blocks = max(s.kv_cache.shape[1] for s in steps)
    cache = torch.zeros(2, num_blocks, 16, kv_heads, dim, dtype=torch.bfloat16, device=DEVICE)
    query = torch.zeros(batch, heads * dim, dtype=torch.bfloat16, device=DEVICE)
    key = torch.zeros(batch, kv_heads * dim, dtype=torch.bfloat16, device=DEVICE)
    value = torch.zeros_like(key)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    md = AttentionMetadata(
        num_actual_tokens=batch, num_reqs=batch, query_start_loc=qsl.to(DEVICE),
        seq_lens=torch.ones(batch, dtype=torch.int32, device=DEVICE),
        block_table=torch.zeros(batch, max_len // 16, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=DEVICE),
        max_query_len=1, max_seq_len=max_len, query_start_loc_cpu=qsl,
        seq_lens_cpu=torch.ones(batch, dtype=torch.int32), num_decodes=batch,
    )  # fmt: skip
    impl = TritonAttentionImpl(heads, dim, dim**-0.5, kv_heads)
    impl.forward(query, key, value, cache, md)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = impl.forward(query, key, value, cache, md)

    for step in steps:
        cache.zero_()
        cache[:, : step.kv_cache.shape[1]].copy_(torch.nan_to_num(step.kv_cache, nan=0.0))
        for static, new in ((query, step.query), (key, step.key), (value, step.value)):
            static.copy_(new)
        md.seq_lens.copy_(step.metadata.seq_lens)
        md.slot_mapping.copy_(step.metadata.slot_mapping)
        md.block_table.zero_()
        table = step.metadata.block_table
        md.block_table[:, : table.shape[1]].copy_(table)
        graph.replay()
        expected = TritonAttentionImpl(heads, dim, dim**-0.5, kv_heads).forward(
            step.query, step.key, step.value, cache.clone(), dataclasses.replace(step.metadata)
        )
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    check(steps[0])


def test_no_compile_for_new_batch_shapes():
    """Once warm, steps with other decode counts, split counts and context lengths reuse the
    compiled kernels: a compile in the middle of serving stalls the engine for most of a
    second (split counts and strides were once specialization keys)."""
    import triton

    compiles: list[str] = []

    def hook(*args, **kwargs) -> None:
        fn = kwargs.get("fn")
        compiles.append(getattr(fn, "name", repr(fn)))

    def batch(num_decodes: int, ctx: int, seed: int) -> Batch:
        q_lens = [1] * num_decodes + [37, 250]
        ctx_lens = [ctx + 13 * i for i in range(num_decodes)] + [0, 2000]
        return make_batch(
            q_lens, ctx_lens, num_heads=32, num_kv_heads=8, head_dim=128,
            dtype=torch.bfloat16, num_decodes=num_decodes, seed=seed,
        )  # fmt: skip

    def cascade(num_decodes: int, ctx: int, seed: int, blocks: int) -> Batch:
        return shared_prefix(batch(num_decodes, ctx, seed), num_decodes, blocks)

    check(batch(1, 3000, 0))  # warm: one decode, split context, and a prompt chunk
    check(batch(64, 100, 1))  # warm: one split
    check(cascade(8, 300, 10, 16))  # warm: cascade attention
    old = triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        for seed, (num_decodes, ctx) in enumerate([(2, 5000), (3, 700), (5, 9000), (17, 40)]):
            check(batch(num_decodes, ctx, seed + 2))
        check(cascade(20, 600, 11, 32))
        check(cascade(64, 1100, 12, 64))
    finally:
        triton.knobs.runtime.jit_post_compile_hook = old
    assert not compiles, f"kernels compiled again for new batch shapes: {compiles}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(32, 8, 128), (8, 1, 256), (12, 4, 80)]
)
def test_cascade_over_a_shared_prefix(dtype, num_heads, num_kv_heads, head_dim):
    # 64 decodes whose first 125 blocks (2,000 tokens) are the first decode's, then a chunk.
    gen = torch.Generator().manual_seed(3)
    ctx = (2000 + torch.randint(0, 400, (64,), generator=gen)).tolist()
    b = make_batch(
        [1] * 64 + [40], ctx + [300], num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype, num_decodes=64,
    )  # fmt: skip
    check(shared_prefix(b, 64, 125))
    check(shared_prefix(b, 64, 125), soft_cap=30.0)


def shared_prefix(b: Batch, num_decodes: int, blocks: int) -> Batch:
    """The first ``num_decodes`` requests take their first ``blocks`` blocks from the first
    one (a prefix-cache hit), and the metadata says so."""
    table = b.metadata.block_table.clone()
    table[1:num_decodes, :blocks] = table[0, :blocks]
    bs = b.kv_cache.shape[2]
    md = dataclasses.replace(b.metadata, block_table=table, common_prefix_len=blocks * bs)
    return dataclasses.replace(b, metadata=md)


@pytest.mark.parametrize("dtype", DTYPES)
# Planned for 256 tokens: one key split per (request, KV head), whatever the lengths; for
# 4,096: five, and a reduction.
@pytest.mark.parametrize("max_seq_len", [256, 4096])
# The decode tiles of the wave rule with RoPE (``triton_launch.DECODE_TILES_D128_ROPE``)
# and of many splits; None: the rule's pick.
@pytest.mark.parametrize(
    "tile", [None, 0, 1, "many"], ids=["chosen", "4-warps", "2-warps", "many-splits"]
)
def test_decode_with_rope_in_the_kernel(monkeypatch, dtype, max_seq_len, tile):
    """``attend_decode_rotary`` on the GPU tiles (32- and 64-key tiles, pipelined stages,
    tensor-core dot products): the cache it leaves equals the separate rotary/KV-write
    kernel's bit for bit (up to FMA contraction of the rotation: one bf16/fp16 step), and
    the output matches rotate-write-attend. Covers the write -> barrier -> read order
    inside one program."""
    from tokenmill.kernels import rotary as fused_rotary
    from tokenmill.kernels.attention import launch as triton_launch
    from tokenmill.kernels.attention import paged
    from tokenmill.model.attention.backend import DecodeRotary
    from tokenmill.model.attention.triton_backend import TritonAttentionImpl

    if tile == "many":
        cfg = triton_launch.DECODE_TILE_MANY_SPLITS_ROPE
        monkeypatch.setattr(paged, "decode_tile_config", lambda *args: cfg)
    elif tile is not None:
        cfg = triton_launch.DECODE_TILES_D128_ROPE[tile][1]
        monkeypatch.setattr(paged, "decode_tile_config", lambda *args: cfg)
    b = make_batch([1] * 6, [700, 63, 64, 129, 1, 300], num_heads=32, num_kv_heads=8,
                   head_dim=128, dtype=dtype, num_decodes=6, max_seq_len=max_seq_len)  # fmt: skip
    md = b.metadata
    gen = torch.Generator().manual_seed(7)
    angles = torch.rand(2048, 64, generator=gen) * 6.0
    table = torch.cat([angles.cos(), angles.sin()], dim=-1).to(DEVICE)
    impl = TritonAttentionImpl(32, 128, 128**-0.5, 8)

    cache = b.kv_cache.clone()
    out = impl.attend_decode_rotary(
        b.query, b.key, b.value, cache, dataclasses.replace(md), DecodeRotary(table, 128, True)
    )

    q, k = b.query.clone(), b.key.clone()
    expected_cache = b.kv_cache.clone()
    positions = (md.seq_lens - 1).long()
    fused_rotary.rotary_and_cache(
        positions, q, k, b.value, table, 128, 128, True, expected_cache, md.slot_mapping, 6
    )
    expected = impl.attend(q, expected_cache, dataclasses.replace(md))
    written = ~expected_cache.isnan()
    step = torch.finfo(dtype).eps * 8  # |k| <= ~4 after rotation
    assert (cache.isnan() == expected_cache.isnan()).all()
    assert (cache[written].float() - expected_cache[written].float()).abs().max() <= step
    assert (out.float() - expected.float()).abs().max() <= ATOL

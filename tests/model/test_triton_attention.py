"""The Triton attention kernels against the torch reference, run by Triton's interpreter
on CPU in float32 (batches and runners in ``triton_attention_cases.py``; the decode
kernel's rotary path in ``test_triton_decode_rope.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.model.triton_attention_cases import (  # first: switches the interpreter on
    MIXED_CTX,
    MIXED_Q,
    TILE_SHAPES,
    assert_same_cache,
    check,
    make_batch,
    padded_decode_batch,
    run_reference,
    run_triton,
    share_prefix,
    use_tiles,
)
from tokenmill.kernels.attention import launch as triton_launch
from tokenmill.kernels.attention import paged
from tokenmill.kernels.attention.cache_write import reshape_and_cache
from tokenmill.kernels.attention.launch import TileConfig
from tokenmill.model.attention.selector import get_attn_backend
from tokenmill.model.attention.torch_ref import TorchAttentionImpl, write_to_kv_cache
from tokenmill.model.attention.triton_backend import TritonAttentionBackend, TritonAttentionImpl

# An empty split's log-sum-exp is log2(0) = -inf by design.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2")


def test_short_whole_step_graphs_take_the_short_chunk_tiles():
    bf16, config = torch.bfloat16, paged.varlen_tile_config
    assert config(128, bf16) == config(128, bf16, 1024) == TileConfig(128, 64, 8, 3)
    assert config(128, bf16, 336) == TileConfig(64, 128, 4, 2)
    assert config(256, bf16, 336) == TileConfig(64, 32, 8, 2)
    assert config(128, torch.float32, 336) == TileConfig(16, 16, 4, 1)


def test_decode_tiles_follow_the_waves_of_their_grid(monkeypatch):
    """At head_dim 128 (16-bit) the decode tile is the first whose single wave of resident
    programs holds the grid (132 SMs: 396 programs at 4 warps, 528 at 2, 1,056 at 1; with
    RoPE in the kernel 264 at 4 warps, 528 at 2, no 1-warp tile), 2 warps past them all and
    for whole-step graphs; other shapes (and groups of more than 16 query heads) keep their
    one tile, as does the switch's off."""
    bf16, config = torch.bfloat16, paged.decode_tile_config
    four, two, one = (tile for _, tile in triton_launch.DECODE_TILES_D128)
    assert (four.num_warps, two.num_warps, one.num_warps) == (4, 2, 1)
    assert config(128, bf16) == four
    assert config(128, bf16, 48 * 8, 132) == config(128, bf16, 396, 132) == four
    assert config(128, bf16, 397, 132) == config(128, bf16, 64 * 8, 132) == two
    assert config(128, bf16, 72 * 8, 132) == config(128, bf16, 1056, 132) == one
    assert config(128, bf16, 1057, 132) == config(128, bf16, 256 * 8, 132) == two
    assert config(128, bf16, 8, 132, uniform=True) == two
    assert config(128, bf16, 72 * 8, 66) == two  # a smaller chip: two waves of 1 warp
    assert config(128, bf16, 264, 132, rope=True) == four
    assert config(128, bf16, 265, 132, rope=True) == config(128, bf16, 72 * 8, 132, rope=True)
    assert config(128, bf16, 265, 132, rope=True) == two
    assert config(128, bf16, 72 * 8, 132, group_padded=32) == four
    assert config(64, bf16, 72 * 8, 132) == TileConfig(16, 64, 4, 3)
    assert config(256, bf16, 72 * 8, 132) == TileConfig(16, 32, 4, 3)
    assert config(128, torch.float32, 72 * 8, 132) == TileConfig(16, 16, 4, 2)


def test_start_up_warms_the_decode_variants_at_their_first_batch_sizes_and_contexts():
    """One (decode count, context) per decode kernel variant that eager decode steps
    reach: by tile, 1-token contexts (132 SMs, 8 KV heads: 4 warps from 1, 2 from 50, 1
    from 67, 2 again past 132); by key splits, one context past a split (several splits
    pass float32 partial buffers: another argument signature); a single 1-token case for
    head sizes with one tile, and none past the runner's decodes."""
    cases = TritonAttentionBackend.decode_warm_up_cases
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    split = triton_launch.MIN_SPLIT_TOKENS
    assert cases(8, 4, 128, bf16, 1024, 1, cpu) == [(1, 1), (50, 1), (67, 1)]
    assert cases(8, 4, 128, bf16, 60, 1, cpu) == [(1, 1), (50, 1)]
    assert cases(8, 4, 128, bf16, 1024, 8192, cpu) == [(1, 1), (1, split + 1), (50, 1), (67, 1)]
    assert cases(8, 4, 64, bf16, 1024, 1, cpu) == [(1, 1)]
    assert cases(8, 4, 128, torch.float32, 1024, 1, cpu) == [(1, 1)]
    # every decode count and context up to the limits launches a variant of some case
    sms = triton_launch.DEFAULT_NUM_SMS

    def variant(n, ctx):
        splits = triton_launch.num_decode_splits(n, 8, ctx, sms)
        tile = triton_launch.decode_tile_config(128, bf16, n * splits * 8, sms, False, False,
                                                16, splits)  # fmt: skip
        return tile, splits == 1

    warmed = {variant(n, ctx) for n, ctx in cases(8, 4, 128, bf16, 256, 8192, cpu)}
    assert all(variant(n, ctx) in warmed for n in range(1, 257) for ctx in range(1, 8193, 97))


def test_decode_tile_is_chosen_for_the_grid_it_launches(monkeypatch):
    """The backend asks for the tile of its decode grid: requests x splits x KV heads, and
    whether the grid is uniform."""
    asked = []
    real_config = paged.decode_tile_config

    def config(*args):
        asked.append(args[2:])
        return real_config(*args)

    monkeypatch.setattr(paged, "decode_tile_config", config)
    monkeypatch.setattr(paged, "num_decode_splits", lambda *args: 3)
    check(make_batch([1] * 5, [40, 3, 17, 90, 1], num_heads=8, num_kv_heads=2, num_decodes=5))
    assert asked == [(5 * 3 * 2, triton_launch.DEFAULT_NUM_SMS, False, False, 16, 3)]


def test_rotating_decode_over_many_splits_takes_32_key_tiles():
    """With RoPE in the kernel, a first-wave grid of at least 32 key splits per (request,
    KV head) (batch 1 with 8 KV heads: 33) takes 32-key tiles at 4 warps; fewer splits,
    the kernel without RoPE, a second wave and whole-step graphs keep the wave rule's."""
    bf16, config = torch.bfloat16, paged.decode_tile_config
    many = triton_launch.DECODE_TILE_MANY_SPLITS_ROPE
    four = triton_launch.DECODE_TILES_D128_ROPE[0][1]
    assert (many.block_n, many.num_warps) == (32, 4)
    assert config(128, bf16, 33 * 8, 132, False, True, 16, 33) == many
    assert config(128, bf16, 64 * 4, 132, False, True, 16, 64) == many
    assert config(128, bf16, 16 * 16, 132, False, True, 16, 16) == four
    assert config(128, bf16, 33 * 8, 132, False, False, 16, 33) != many
    assert config(128, bf16, 33 * 9, 132, False, True, 16, 33) != many
    assert config(128, bf16, 33 * 8, 132, True, True, 16, 33) != many
    assert config(64, bf16, 33 * 8, 132, False, True, 16, 33) != many


def test_backend_is_selected_for_cuda():
    assert TritonAttentionBackend.name == "triton"
    assert TritonAttentionBackend.get_impl_cls() is TritonAttentionImpl
    assert get_attn_backend("cuda") is TritonAttentionBackend


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(2, 2, 16), (4, 2, 64), (8, 2, 128), (8, 1, 16)]
)
def test_mixed_batch_matches_reference(num_heads, num_kv_heads, head_dim):
    b = make_batch(
        MIXED_Q, MIXED_CTX, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        num_decodes=2,
    )  # fmt: skip
    check(b)


@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_forward_writes_cache_then_attends(num_kv_heads):
    b = make_batch(MIXED_Q, MIXED_CTX, num_kv_heads=num_kv_heads)
    impl = TritonAttentionImpl(4, 16, 0.25, num_kv_heads)
    cache = b.kv_cache.clone()
    out = impl.forward(b.query, b.key, b.value, cache, dataclasses.replace(b.metadata))
    ref_out, ref_cache = run_reference(b)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    assert_same_cache(cache, ref_cache)


@pytest.mark.parametrize("block_size", [8, 32, 128])
def test_block_sizes(block_size):
    check(make_batch(MIXED_Q, MIXED_CTX, block_size=block_size, num_decodes=2))


@pytest.mark.parametrize("tiles", sorted(TILE_SHAPES))
@pytest.mark.parametrize("window", [None, 1, 7, 33])
def test_tile_shapes_masks_and_window(monkeypatch, tiles, window):
    # Chunks longer than a tile, window edges inside and across tiles.
    use_tiles(monkeypatch, *TILE_SHAPES[tiles])
    b = make_batch([1, 70, 45], [60, 0, 90], num_kv_heads=1, block_size=8, num_decodes=1)
    check(b, sliding_window=window)


@pytest.mark.parametrize("window", [1, 20, 500])
def test_sliding_window(window):
    check(make_batch(MIXED_Q, [140, 17, 0, 150], num_decodes=2), sliding_window=window)


@pytest.mark.parametrize("window", [5, 40])
def test_context_outside_the_window_is_never_read(small_tiles, window):
    # Blocks that fell out of the window may be reused: poison them for the kernels only.
    q_lens, ctx_lens = [1, 1, 30], [75, 44, 60]
    b = make_batch(q_lens, ctx_lens, num_kv_heads=1, block_size=8, num_decodes=2)
    ref_out, ref_cache = run_reference(b, sliding_window=window)
    md = b.metadata
    poisoned = b.kv_cache.clone()
    flat = poisoned.view(2, -1, *poisoned.shape[3:])
    for i, ctx in enumerate(ctx_lens):
        first_visible = ctx - window + 1  # the window start of the request's first query
        stale = [int(md.block_table[i, p // 8]) * 8 + p % 8 for p in range(max(first_visible, 0))]
        flat[:, stale] = float("nan")
    out, _ = run_triton(dataclasses.replace(b, kv_cache=poisoned), sliding_window=window)
    n = md.num_actual_tokens
    torch.testing.assert_close(out[:n], ref_out[:n], atol=1e-4, rtol=1e-4)


def test_soft_cap_with_window():
    b = make_batch(MIXED_Q, MIXED_CTX, num_decodes=2, query_scale=4.0)
    check(b, soft_cap=5.0)
    check(b, sliding_window=24, soft_cap=5.0)


def test_non_power_of_two_head_dim():
    check(make_batch(MIXED_Q, MIXED_CTX, num_heads=6, num_kv_heads=2, head_dim=24, num_decodes=2))


def test_long_decode_uses_several_splits():
    ctx = [1000, 700, 3, 260]
    b = make_batch([1] * 4, ctx, num_heads=8, num_kv_heads=2, head_dim=16, num_decodes=4)
    splits = paged.num_decode_splits(
        4, 2, b.metadata.max_seq_len, triton_launch.DEFAULT_NUM_SMS
    )
    assert splits > 1
    check(b)
    check(b, sliding_window=300)


@pytest.mark.parametrize("splits", [1, 5])
def test_decode_split_counts(monkeypatch, splits):
    # 5 splits: a non-power-of-two reduction where short contexts leave splits empty.
    monkeypatch.setattr(paged, "num_decode_splits", lambda *args: splits)
    b = make_batch([1] * 3, [300, 2, 47], num_heads=4, num_kv_heads=1, num_decodes=3)
    check(b)


class _LaunchCounter:
    """Stands in for a kernel and counts its launches."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize(
    "self_merge,tile",
    [(True, 4096), (True, 128), (False, 4096)],
    ids=["self-merge", "self-merge-2-per-load", "reduction"],
)
def test_decode_splits_merge_themselves_or_in_a_reduction(monkeypatch, self_merge, tile):
    """12 splits: 10 of them hold keys of the 600-token context (more than one merge load;
    five with a merge tile of 128 elements), 1 and 3 the others'; one padding row. The
    counters are left at zero, so a repeated launch (a graph replay) merges again."""
    from tokenmill.kernels.attention import decode as triton_decode

    monkeypatch.setattr(triton_launch, "MERGE_TILE_ELEMS", tile)
    if not self_merge:  # no counter slots: the splits are merged by a reduction launch
        monkeypatch.setattr(paged, "MERGE_COUNTER_SLOTS", 0)
    monkeypatch.setattr(paged, "num_decode_splits", lambda *args: 12)
    reduce = _LaunchCounter(triton_decode.decode_reduce_kernel)
    monkeypatch.setattr(triton_decode, "decode_reduce_kernel", reduce)
    real = make_batch([1] * 3, [600, 2, 47], num_heads=8, num_kv_heads=2, num_decodes=3)
    ref_out, ref_cache = run_reference(real)
    for _ in range(2):
        out, cache = run_triton(padded_decode_batch(real, 1))
        torch.testing.assert_close(out[:3], ref_out, atol=1e-4, rtol=1e-4)
        assert torch.equal(out[3:], torch.zeros_like(out[3:]))
        assert_same_cache(cache, ref_cache)
    assert reduce.launches == (0 if self_merge else 2)
    if self_merge:
        assert not paged._MERGE_COUNTERS[torch.device("cpu")].any()


def test_merge_loads_stay_within_their_register_budget():
    """At most 8 splits per merge load, and a [group, splits, head_dim] tile of at most
    MERGE_TILE_ELEMS: larger groups and heads read fewer splits per load, never none."""
    per_load = triton_launch.merge_splits_per_load
    assert per_load(4, 128) == 8  # Llama-3.1-8B
    assert per_load(8, 128) == 4
    assert per_load(8, 256) == 2
    assert per_load(32, 128) == per_load(64, 256) == 1


def test_short_chunks_after_long_context_split_their_keys():
    # Two decodes, then a 5-token turn after 700 cached tokens and a 3-token one after 257.
    b = make_batch([1, 1, 5, 3], [300, 40, 700, 257], num_heads=8, num_kv_heads=2,
                   num_decodes=2)  # fmt: skip
    splits = paged.num_varlen_splits(8, 2, 32, 2, 705, triton_launch.DEFAULT_NUM_SMS)
    assert splits == 3  # 705 keys make 3 splits of >= 256
    check(b)
    check(b, sliding_window=300)
    check(b, soft_cap=5.0)


def test_long_prompts_keep_one_key_split():
    # 2,000 query tokens in 32-token blocks over 8 KV heads: 504 programs fill 132 SMs.
    assert paged.num_varlen_splits(2000, 1, 32, 8, 4000, 132) == 1
    assert paged.num_varlen_splits(16, 1, 32, 8, 2016, 132) == 8


@pytest.mark.parametrize("splits", [2, 7])
@pytest.mark.parametrize("window", [None, 9])
def test_prompt_split_counts(monkeypatch, small_tiles, splits, window):
    # Uneven runs of key tiles; 7 splits leave some empty for the fresh prompt's first
    # blocks and for rows whose causal mask hides a whole split.
    monkeypatch.setattr(paged, "num_varlen_splits", lambda *args: splits)
    b = make_batch(MIXED_Q, MIXED_CTX, num_decodes=2)
    check(b, sliding_window=window)


def test_decode_grid_sized_for_longest_model_context():
    # A CUDA graph captured with max_seq_len = max_model_len replays with short contexts:
    # the split count then exceeds what the lengths need and most splits are empty.
    b = make_batch([1] * 3, [30, 5, 64], num_decodes=3, max_seq_len=32768)
    assert paged.num_decode_splits(3, 2, 32768, 132) > 8
    check(b)


def test_unordered_batch_without_decode_count():
    # Decodes after a prompt, num_decodes unknown: the leading decode is found on the host
    # copy of query_start_loc and the rest go through the varlen kernel.
    b = make_batch([1, 30, 1, 5, 1], [20, 0, 33, 9, 0])
    check(b)
    assert b.metadata.num_decodes == 0


def test_tokens_past_num_actual_tokens_are_ignored():
    b = make_batch(MIXED_Q, MIXED_CTX, extra_tokens=5, num_decodes=2)
    check(b)  # the cache comparison covers the stray block those tokens point at


@pytest.mark.parametrize("splits", [1, 4])
def test_padded_decode_batch_of_a_cuda_graph(monkeypatch, splits):
    # 3 real decodes padded to 6: padding requests have seq_len 0, one token, slot -1.
    monkeypatch.setattr(paged, "num_decode_splits", lambda *args: splits)
    real = make_batch([1] * 3, [50, 9, 31], num_decodes=3)
    out, cache = run_triton(padded_decode_batch(real, 3))
    ref_out, ref_cache = run_reference(real)
    torch.testing.assert_close(out[:3], ref_out, atol=1e-4, rtol=1e-4)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    assert_same_cache(cache, ref_cache)


@pytest.mark.parametrize(
    "q_lens, ctx, leading",
    [
        ([1, 1, 21, 9, 1], [40, 17, 50, 0, 33], 2),  # decodes first, one after the prompts
        ([21, 1, 1, 9, 1], [50, 40, 17, 0, 33], 0),  # no leading decode
    ],
)
@pytest.mark.parametrize("splits", [1, 3])
def test_uniform_grids_of_a_padded_mixed_batch(
    monkeypatch, small_tiles, splits, q_lens, ctx, leading
):
    """A mixed batch as a whole-step CUDA graph of 64 tokens runs it: the prompt kernel
    takes the requests after the leading decodes from the device ``prefill_range`` and
    leaves one-token queries among them to the decode kernel; padded with one-token
    requests of no context while padding tokens last, then with empty ones; host copies
    wrong on purpose (the kernels must not read them)."""
    monkeypatch.setattr(paged, "num_decode_splits", lambda *args: splits)
    real = make_batch(q_lens, ctx)
    md = real.metadata
    n, r, tokens, reqs = md.num_actual_tokens, md.num_reqs, 64, 40
    qsl = torch.cat([md.query_start_loc, torch.arange(n + 1, n + 1 + reqs - r).clamp(max=tokens)])
    sl = torch.cat([md.seq_lens, torch.zeros(reqs - r, dtype=torch.int32)])
    wrong = torch.zeros(reqs + 1, dtype=torch.int32)
    padded = dataclasses.replace(
        md,
        num_actual_tokens=tokens,
        num_reqs=reqs,
        query_start_loc=qsl.to(torch.int32),
        query_start_loc_cpu=wrong,
        seq_lens=sl,
        seq_lens_cpu=wrong[:reqs],
        block_table=torch.cat([md.block_table, md.block_table[:1].expand(reqs - r, -1)]),
        slot_mapping=torch.cat([md.slot_mapping, torch.full((tokens - n,), -1)]),
        max_query_len=1,
        max_seq_len=4096,
        uniform_grids=True,
        prefill_range=torch.tensor([leading, len(q_lens) - leading], dtype=torch.int32),
    )
    grow = lambda x: torch.cat([x, torch.randn(tokens - n, x.shape[1])])  # noqa: E731
    b = dataclasses.replace(
        real, query=grow(real.query), key=grow(real.key), value=grow(real.value), metadata=padded
    )
    out, cache = run_triton(b)
    ref_out, ref_cache = run_reference(real)
    torch.testing.assert_close(out[:n], ref_out, atol=1e-4, rtol=1e-4)
    assert_same_cache(cache, ref_cache)


def test_requests_without_tokens_are_skipped():
    # Trailing requests with no query tokens (query_start_loc repeats): nothing to do.
    b = make_batch([1, 12, 0, 0], [7, 3, 0, 0], num_decodes=1)
    check(b)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_requests_without_tokens_write_nothing(monkeypatch, splits):
    # All queries have length <= 1, so every request goes to the decode kernel; the empty
    # trailing ones start at token 2, a row that would be out of bounds in a real batch.
    monkeypatch.setattr(paged, "num_decode_splits", lambda *args: splits)
    b = make_batch([1, 1, 0, 0], [33, 8, 0, 0], extra_tokens=2)
    out, _ = run_triton(b)
    ref_out, _ = run_reference(b)
    torch.testing.assert_close(out[:2], ref_out[:2], atol=1e-4, rtol=1e-4)
    assert out[2:].isnan().all()


def test_strided_views_of_fused_qkv():
    b = make_batch(MIXED_Q, MIXED_CTX, num_decodes=2)
    qkv = torch.cat([b.query, b.key, b.value], dim=1)
    q, k, v = qkv.split([b.query.shape[1], b.key.shape[1], b.value.shape[1]], dim=1)
    assert not q.is_contiguous()
    check(dataclasses.replace(b, query=q, key=k, value=v))


def test_plan_is_shared_by_layers_of_one_step():
    # Layers with different head layouts and windows reuse one metadata object.
    b = make_batch([1, 1, 9], [300, 40, 5], num_heads=4, num_kv_heads=2, num_decodes=2)
    md = dataclasses.replace(b.metadata)
    cache = b.kv_cache.clone()
    reshape_and_cache(b.key, b.value, cache, md.slot_mapping, md.num_actual_tokens)
    for window, heads in ((None, 4), (16, 4), (None, 2)):
        query = b.query[:, : heads * 16]
        out = TritonAttentionImpl(heads, 16, 0.25, 2, window).attend(query, cache, md)
        ref = TorchAttentionImpl(heads, 16, 0.25, 2, window)
        clean = torch.nan_to_num(b.kv_cache, nan=0.0)
        ref_out = ref.forward(query, b.key, b.value, clean, dataclasses.replace(md))
        torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)


def test_reshape_and_cache_skips_negative_slots():
    b = make_batch([5, 3], [0, 4], num_kv_heads=2, head_dim=16)
    slots = b.metadata.slot_mapping.clone()
    slots[[1, 6]] = -1
    cache = b.kv_cache.clone()
    reshape_and_cache(b.key, b.value, cache, slots, len(slots))
    expected = b.kv_cache.clone()
    keep = slots >= 0
    write_to_kv_cache(b.key[keep], b.value[keep], expected, slots[keep])
    assert_same_cache(cache, expected)


@pytest.mark.parametrize("tiles", sorted(TILE_SHAPES))
@pytest.mark.parametrize("prefix_blocks", [1, 6, 21])
def test_cascade_attention_over_a_shared_prefix(monkeypatch, tiles, prefix_blocks):
    # Five decodes share 1, 6 or 21 blocks of 16 (the last request's context ends right
    # after the prefix); a prompt chunk follows. The prefix's last key tile is partial
    # (96 and 336 are not multiples of 64).
    use_tiles(monkeypatch, *TILE_SHAPES[tiles])
    q_lens, ctx = [1, 1, 1, 1, 1, 9], [400, 350, 341, 500, 336, 20]
    b = share_prefix(
        make_batch(q_lens, ctx, num_heads=8, num_kv_heads=2, num_decodes=5), 5, prefix_blocks
    )
    check(b)
    check(b, soft_cap=5.0)
    # A window turns cascade off (the prefix would not be visible to every request).
    check(b, sliding_window=100)


@pytest.mark.parametrize("self_merge", [True, False], ids=["self-merge", "reduction"])
@pytest.mark.parametrize("splits", [(1, 1), (3, 5), (2, 16)])
def test_cascade_split_counts(monkeypatch, splits, self_merge):
    # Empty splits on both sides: 5 suffix splits of ~30 keys, 16 splits of a 48-key prefix.
    if not self_merge:
        monkeypatch.setattr(paged, "MERGE_COUNTER_SLOTS", 0)
    decode_splits, prefix_splits = splits
    monkeypatch.setattr(paged, "num_decode_splits", lambda *args: decode_splits)
    monkeypatch.setattr(paged, "num_prefix_splits", lambda *args: prefix_splits)
    b = make_batch([1] * 4, [60, 77, 49, 90], num_heads=4, num_kv_heads=1, num_decodes=4)
    check(share_prefix(b, 4, 3))


def test_cascade_output_equals_the_plain_decode_path():
    q_lens, ctx = [1] * 6, [300, 290, 310, 275, 400, 288]
    b = make_batch(q_lens, ctx, num_heads=8, num_kv_heads=2, num_decodes=6)
    shared = share_prefix(b, 6, 16)
    plain = dataclasses.replace(
        shared, metadata=dataclasses.replace(shared.metadata, common_prefix_len=0)
    )
    out, _ = run_triton(shared)
    ref, _ = run_triton(plain)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_prefix_split_heuristic():
    # 64 decodes in 32-token blocks over 8 KV heads: 16 programs, 2,000 keys -> 8 splits.
    assert paged.num_prefix_splits(64, 32, 8, 2000, 132) == 8
    assert paged.num_prefix_splits(64, 32, 8, 256, 132) == 1
    assert paged.num_prefix_splits(1024, 32, 8, 8000, 132) == 1

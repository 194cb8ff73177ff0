"""Triton kernels of the decode path of paged attention: the split-K (flash-decoding)
decode kernel, optionally rotating the query and writing the new K/V itself, and the
log-sum-exp reduction of its splits.

The tile loop, the split merge and the online-softmax conventions are shared with the
prompt kernels (``common.py``); launches are in ``paged.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels.attention.common import (
    M_INIT,
    SPLIT_RUNTIME_INTS,
    attend_tiles,
    local_start,
    merge_splits,
    scaled_scores,
    sink_state,
    softmax_step,
    tile_rows,
    tile_scores,
)
from tokenmill.kernels.cache_cast import cast_to_cache
from tokenmill.kernels.pdl import allow_next_grid, wait_for_prior_results
from tokenmill.kernels.rotary import rotary_pairs


@triton.jit
def _rotary_pairs(cos_sin_ptr, stride_cos, seq_len, D_P: tl.constexpr, HALF: tl.constexpr,
                  NEOX: tl.constexpr):  # fmt: skip
    """``rotary_pairs`` for a decode token, at position ``seq_len - 1``."""
    row = cos_sin_ptr + tl.maximum(seq_len - 1, 0).to(tl.int64) * stride_cos
    return rotary_pairs(row, D_P, HALF, NEOX)


@triton.jit
def _rotate_decode_query(
    q, q_rows, qo_mask, cos_sin_ptr, stride_cos, seq_len,
    HEAD_DIM: tl.constexpr, D_P: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr,
):  # fmt: skip
    """``q [GROUP_P, D_P]`` (loaded from ``q_rows + d``) rotated, in q's dtype."""
    partner, cos, sin, rotates = _rotary_pairs(cos_sin_ptr, stride_cos, seq_len, D_P, HALF, NEOX)
    pair = tl.load(q_rows + partner[None, :], mask=qo_mask & rotates[None, :], other=0.0)
    rotated = q.to(tl.float32) * cos[None, :] + pair.to(tl.float32) * sin[None, :]
    return tl.where(rotates[None, :], rotated, q.to(tl.float32)).to(q.dtype)


@triton.jit
def _write_decode_kv(
    k_row, v_row, k_cache_ptr, v_cache_ptr, slot_ptr, cos_sin_ptr, stride_cos, seq_len,
    kv_head, stride_cb, stride_cs, stride_ch, active,
    HEAD_DIM: tl.constexpr, D_P: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Rotate one KV head's new key (``k_row + d``) and write it and the new value into the
    token's slot; a negative slot (padding) writes nothing, nor does a program that is not
    ``active`` (which loads nothing either). The key is rounded to its own dtype, then to
    the cache's, as the separate rotary kernel and cache write do. Returns ``(k, v)``
    ``[D_P]`` as written, in the cache's dtype (zeros where not ``active``)."""
    slot = tl.load(slot_ptr, mask=active, other=-1).to(tl.int64)
    partner, cos, sin, rotates = _rotary_pairs(cos_sin_ptr, stride_cos, seq_len, D_P, HALF, NEOX)
    d = tl.arange(0, D_P)
    valid = (d < HEAD_DIM) & active
    k = tl.load(k_row + d, mask=valid, other=0.0)
    pair = tl.load(k_row + partner, mask=valid & rotates, other=0.0)
    rotated = k.to(tl.float32) * cos + pair.to(tl.float32) * sin
    k = cast_to_cache(tl.where(rotates, rotated, k.to(tl.float32)).to(k.dtype), k_cache_ptr)
    v = cast_to_cache(tl.load(v_row + d, mask=valid, other=0.0), v_cache_ptr)
    dst = (tl.maximum(slot, 0) // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    dst += kv_head * stride_ch + d
    tl.store(k_cache_ptr + dst, k, mask=valid & (slot >= 0))
    tl.store(v_cache_ptr + dst, v, mask=valid & (slot >= 0))
    return k, v


@triton.jit
def _fold_key(acc, m_i, l_i, q, k, v, sm_scale, soft_cap, USE_SOFTCAP: tl.constexpr):
    """Fold one key ``k [D_P]`` and its value ``v [D_P]``, visible to every query row, into
    the online softmax state; the value is weighed in its own dtype, as ``attend_tiles``
    casts its weights for ``tl.dot``."""
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1)[:, None]
    m_new, l_new, alpha, p = softmax_step(
        m_i, l_i, scaled_scores(s, sm_scale, soft_cap, USE_SOFTCAP)
    )
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32) * v.to(tl.float32)[None, :]
    return acc, m_new, l_new


@triton.jit
def _fold_partials(
    acc, m_i, l_i, lse_rows, part_rows, lo, hi, head_ok,
    HEAD_DIM: tl.constexpr, D_P: tl.constexpr, MERGE_S: tl.constexpr,
):  # fmt: skip
    """Fold split slots ``lo .. hi - 1`` of a group's partials (``lse_rows``/``part_rows``:
    each head's first slot) into the online-softmax state, ``MERGE_S`` slots per load, from
    L2 (``.cg``): the splits that wrote them ran on other SMs."""
    d = tl.arange(0, D_P)
    sp = tl.arange(0, MERGE_S)
    for s0 in range(lo, hi, MERGE_S):
        valid = head_ok[:, None] & ((s0 + sp) < hi)[None, :]
        lse = tl.load(lse_rows[:, None] + (s0 + sp)[None, :], mask=valid, other=float("-inf"),
                      cache_modifier=".cg")  # fmt: skip
        parts = tl.load(
            part_rows[:, None, None] + ((s0 + sp) * HEAD_DIM)[None, :, None] + d[None, None, :],
            mask=valid[:, :, None] & (d < HEAD_DIM)[None, None, :], other=0.0,
            cache_modifier=".cg",
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(lse, 1))
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse - m_new[:, None])
        acc = acc * alpha[:, None] + tl.sum(parts * w[:, :, None], 1)
        l_i = l_i * alpha + tl.sum(w, 1)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _merge_group_splits(
    out_ptr, out_row, stride_ot, part_out_ptr, part_lse_ptr, r, kv_head, active,
    prefix_base, prefix_splits, stride_pr, stride_ph, stride_lr, stride_lh,
    GROUP: tl.constexpr, MERGE_G: tl.constexpr, HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
    MERGE_S: tl.constexpr,
):  # fmt: skip
    """Merge one (row, KV head)'s partials of its ``GROUP`` query heads by their
    log-sum-exp, as ``merge_splits`` does per head: split slots ``0 .. active - 1`` and the
    shared prefix's ``prefix_base ..`` (``prefix_splits`` of them); write the output row."""
    g = tl.arange(0, MERGE_G)
    d = tl.arange(0, D_P)
    head = kv_head * GROUP + g
    lse_rows = part_lse_ptr + r * stride_lr + head * stride_lh
    part_rows = part_out_ptr + r.to(tl.int64) * stride_pr + head * stride_ph
    acc = tl.zeros([MERGE_G, D_P], dtype=tl.float32)
    m_i = tl.zeros([MERGE_G], dtype=tl.float32) + M_INIT
    l_i = tl.zeros([MERGE_G], dtype=tl.float32)
    acc, m_i, l_i = _fold_partials(acc, m_i, l_i, lse_rows, part_rows, 0, active, g < GROUP,
                                   HEAD_DIM, D_P, MERGE_S)  # fmt: skip
    acc, m_i, l_i = _fold_partials(
        acc, m_i, l_i, lse_rows, part_rows, prefix_base, prefix_base + prefix_splits, g < GROUP,
        HEAD_DIM, D_P, MERGE_S,
    )  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + out_row.to(tl.int64) * stride_ot + head[:, None] * HEAD_DIM + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty),
             mask=(g < GROUP)[:, None] & (d < HEAD_DIM)[None, :])  # fmt: skip


@triton.jit(
    do_not_specialize=["req_offset", "kv_start", "merge_splits", "window"] + SPLIT_RUNTIME_INTS
)
def decode_attention_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    counter_ptr,
    req_offset,
    kv_start,
    merge_splits,
    sm_scale,
    soft_cap,
    window,
    num_splits,
    stride_qt,
    stride_ot,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_pr,
    stride_ph,
    stride_lr,
    stride_lh,
    k_new_ptr,
    v_new_ptr,
    cos_sin_ptr,
    slot_ptr,
    stride_kt,
    stride_vt,
    stride_cos,
    sinks_ptr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CHUNKED: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_PDL: tl.constexpr,
    ROPE: tl.constexpr,
    HALF: tl.constexpr,
    NEOX: tl.constexpr,
    EARLY_LOADS: tl.constexpr,
    MERGE_S: tl.constexpr,
    MERGE_G: tl.constexpr,
):
    """Flash-decoding: program ``(r * num_splits + split) * NUM_KV_HEADS + kv_head`` attends
    one query token's ``GROUP`` heads over its split of the context's keys from
    ``kv_start`` on.

    The key tiles are dealt evenly to ``num_splits`` programs from the device ``seq_lens``,
    so the grid does not depend on context lengths. ``kv_start > 0`` leaves the keys below
    it to ``shared_prefix_kernel`` (cascade attention). With one split, the result goes
    straight to ``out`` when it covers every key: ``kv_start == 0``, or the
    ``merge_splits`` partials of the keys below ``kv_start`` that ``shared_prefix_kernel``
    wrote before this launch (at split slots ``1 ..``) are merged in here. Otherwise each
    split writes its normalized partial output ``[D]`` and log2-sum-exp to
    ``part_out[r, head, split]`` / ``part_lse[r, head, split]`` (split strides ``HEAD_DIM``
    and 1), merged by the last split (``MERGE_S``, below) or by ``decode_reduce_kernel``.
    A request with ``seq_len == 0`` (padding) yields zeros; one whose query length is not 1
    is left alone.

    ``MERGE_S > 0`` with several splits: the splits merge themselves, with no reduction
    launch. Only the splits that hold keys (and the first) write a partial; each then
    counts itself in ``counter_ptr[r * NUM_KV_HEADS + kv_head]`` (int32, zero before the
    launch, shared by every launch on the device: one stream at a time), and the last to
    arrive resets the counter and merges the partials of its ``GROUP`` heads (``MERGE_G``:
    GROUP rounded up to a power of two), ``MERGE_S`` splits per load, with the
    ``merge_splits`` partials of the shared prefix at split slots ``num_splits ..``: CUDA's
    "last block" reduction (threadFenceReduction sample), as the skinny GEMM's split-K
    combine does. At short contexts most splits are empty, so the merge reads a few
    partials, where the reduction launch waits for every split and reads them all.

    ``ROPE``: ``q`` arrives unrotated, and this step's keys and values are not in the cache
    yet. Each program rotates its query heads in registers by the rotary table's row
    ``seq_len - 1`` (``cos_sin_ptr``: ``cos | sin`` of ``HALF`` frequencies each; the
    first ``2 * HALF`` dimensions rotate, as halves with ``NEOX``, else as adjacent
    pairs), rounded to the query's dtype as the separate rotary kernel stores it. The
    program whose split holds the last key also rotates the new key (``k_new_ptr``, rows
    ``stride_kt``) and writes it and the new value (``v_new_ptr``) into the token's slot
    (``slot_ptr``; negative slots are not written).

    As a dependent launch (``USE_PDL``) each program reads the batch layout, its block-table
    entries and its first tile of earlier keys before it waits for the previous kernel, so
    that those loads' latency overlaps it. The step's own key, which the previous kernel
    (or, with ``ROPE``, this one) writes, is left out of the tiles and folded in last by
    the split that holds it. That is sound only when no row reads a slot that the step
    writes for another row, which a prefix-cache hit on a block filled in the same step
    can make happen (``AttentionMetadata.reads_step_kv``): with ``EARLY_LOADS`` off every
    program waits first.

    Local layers (``USE_WINDOW``) read only the keys from the query's ``local_start`` on: a
    sliding window of ``window`` keys, or with ``CHUNKED`` the query's chunk of ``window``
    tokens. With ``USE_SINKS`` the first split starts its softmax from each head's sink
    logit (``sinks_ptr``, ``[num_heads]``; ``sink_state``), so the merged result counts
    it once.
    """
    allow_next_grid(USE_PDL)
    if not EARLY_LOADS:
        wait_for_prior_results(USE_PDL)
    # One grid axis, the request slowest: with uniform grids (whole-step graphs) the rows
    # past the step's decodes exit at once, and in this order they are dispatched after
    # every real program instead of between them, where each would hold a slot first.
    pid = tl.program_id(0)
    kv_head = pid % NUM_KV_HEADS
    split = (pid // NUM_KV_HEADS) % num_splits
    r = pid // (NUM_KV_HEADS * num_splits)
    req = req_offset + r
    # Until the wait below, only what the step's earlier kernels do not write: the batch
    # layout, the block table and the keys before this step's (written by earlier steps).
    # At a few tiles per program these loads are most of the kernel's latency, and here
    # they overlap the previous kernels (the QKV product, the rotary/KV write).
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_len != 1:
        # Every program waits before it exits, so that this grid completes after the
        # previous one (``pdl.py``: completion must imply the predecessor's).
        wait_for_prior_results(USE_PDL)
        return
    seq_len = tl.load(seq_lens_ptr + req)
    kv_lo = kv_start
    if USE_WINDOW:
        kv_lo = tl.maximum(local_start(seq_len - 1, window, CHUNKED), kv_start)
    lo = kv_lo // BLOCK_N * BLOCK_N
    tiles = tl.cdiv(seq_len - lo, BLOCK_N)
    tiles_per_split = tl.cdiv(tiles, num_splits)
    # Splits that hold keys; the first one always counts, so that padding rows (no keys)
    # get their zeros from the merge.
    active = tl.maximum(tl.cdiv(tiles, tl.maximum(tiles_per_split, 1)), 1)
    start = lo + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    # The step's own key (position seq_len - 1) is folded in apart, after the wait, by the
    # split that holds it (``owner``); the tiles cover the keys before it.
    last = seq_len - 1
    owner = ((last - lo) // BLOCK_N) // tl.maximum(tiles_per_split, 1)
    has_new_key = (split == owner) & (seq_len > 0) & (last >= kv_lo)
    block_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, D_P)
    j = start + tl.arange(0, BLOCK_N)
    first_valid = (j >= kv_lo) & (j < tl.minimum(end, last))
    row = tile_rows(block_row_ptr, kv_head * stride_ch, j, first_valid, stride_cb, stride_cs,
                    True, BLOCK_SIZE)  # fmt: skip
    k0 = tl.load(k_cache_ptr + row[None, :] + d[:, None],
                 mask=first_valid[None, :] & (d < HEAD_DIM)[:, None], other=0.0)  # fmt: skip
    v0 = tl.load(v_cache_ptr + row[:, None] + d[None, :],
                 mask=first_valid[:, None] & (d < HEAD_DIM)[None, :], other=0.0)  # fmt: skip
    new_block = tl.load(block_row_ptr + tl.maximum(last, 0) // BLOCK_SIZE, mask=has_new_key,
                        other=0)  # fmt: skip
    new_row = new_block.to(tl.int64) * stride_cb + (last % BLOCK_SIZE) * stride_cs
    new_row += kv_head * stride_ch
    wait_for_prior_results(USE_PDL)

    head = kv_head * GROUP + g
    qo_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + q_start.to(tl.int64) * stride_qt + head[:, None] * HEAD_DIM + d[None, :],
        mask=qo_mask,
        other=0.0,
    )
    q_pos = tl.zeros([GROUP_P], dtype=tl.int32) + last
    if ROPE:
        q = _rotate_decode_query(
            q, q_ptr + q_start.to(tl.int64) * stride_qt + head[:, None] * HEAD_DIM, qo_mask,
            cos_sin_ptr, stride_cos, seq_len, HEAD_DIM, D_P, HALF, NEOX,
        )  # fmt: skip
        k_new, v_new = _write_decode_kv(
            k_new_ptr + q_start.to(tl.int64) * stride_kt + kv_head * HEAD_DIM,
            v_new_ptr + q_start.to(tl.int64) * stride_vt + kv_head * HEAD_DIM,
            k_cache_ptr, v_cache_ptr, slot_ptr + q_start, cos_sin_ptr, stride_cos,
            seq_len, kv_head, stride_cb, stride_cs, stride_ch, has_new_key, HEAD_DIM, D_P,
            HALF, NEOX, BLOCK_SIZE,
        )  # fmt: skip
    else:
        # Written by the previous kernel (the rotary/KV write): read after the wait.
        new_mask = (d < HEAD_DIM) & has_new_key
        k_new = tl.load(k_cache_ptr + new_row + d, mask=new_mask, other=0.0)
        v_new = tl.load(v_cache_ptr + new_row + d, mask=new_mask, other=0.0)
    # FP8 caches: K/V widened to the query's dtype for the products.
    k0 = k0.to(q.dtype)
    v0 = v0.to(q.dtype)
    k_new = k_new.to(q.dtype)
    v_new = v_new.to(q.dtype)

    acc = tl.zeros([GROUP_P, D_P], dtype=tl.float32)
    m_i = tl.zeros([GROUP_P], dtype=tl.float32) + M_INIT
    l_i = tl.zeros([GROUP_P], dtype=tl.float32)
    m_i, l_i = sink_state(sinks_ptr, head, g < GROUP, split == 0, m_i, l_i, USE_SINKS)
    s0 = tile_scores(q, k0, j, q_pos, q_pos, first_valid, window, sm_scale, soft_cap,
                     True, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION, CHUNKED)  # fmt: skip
    m_i, l_i, alpha, p = softmax_step(m_i, l_i, s0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v0.dtype), v0, input_precision=DOT_PRECISION)
    acc, m_i, l_i = attend_tiles(
        acc, m_i, l_i, q, q_pos, q_pos, k_cache_ptr, v_cache_ptr, block_row_ptr,
        kv_head * stride_ch, kv_lo, last, window, sm_scale, soft_cap, start + BLOCK_N, end,
        stride_cb, stride_cs, True, USE_WINDOW, USE_SOFTCAP, HEAD_DIM, D_P, BLOCK_SIZE,
        BLOCK_N, DOT_PRECISION, CHUNKED,
    )  # fmt: skip
    if has_new_key:
        acc, m_i, l_i = _fold_key(acc, m_i, l_i, q, k_new, v_new, sm_scale, soft_cap,
                                  USE_SOFTCAP)  # fmt: skip
    for s in range(tl.where(num_splits == 1, merge_splits, 0)):
        # A partial (normalized output o, log2-sum-exp lse) is the state (acc = o * 2^lse,
        # l = 2^lse) relative to a zero maximum; fold it in like one more key tile.
        slot = r.to(tl.int64) * stride_pr + head * stride_ph + (1 + s) * HEAD_DIM
        o_s = tl.load(part_out_ptr + slot[:, None] + d[None, :], mask=qo_mask, other=0.0)
        lse_ptrs = part_lse_ptr + r * stride_lr + head * stride_lh + 1 + s
        lse_s = tl.load(lse_ptrs, mask=g < GROUP, other=float("-inf"))
        m_new = tl.maximum(m_i, lse_s)
        alpha = tl.exp2(m_i - m_new)
        beta = tl.exp2(lse_s - m_new)
        acc = acc * alpha[:, None] + o_s * beta[:, None]
        l_i = l_i * alpha + beta
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if num_splits == 1 and (kv_start == 0 or merge_splits > 0):
        o_ptrs = out_ptr + q_start.to(tl.int64) * stride_ot + head[:, None] * HEAD_DIM + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=qo_mask)
    elif MERGE_S == 0 or split < active:
        part = r.to(tl.int64) * stride_pr + head * stride_ph + split * HEAD_DIM
        # .cg: with MERGE_S the partials are read on another SM in this launch.
        tl.store(part_out_ptr + part[:, None] + d[None, :], out, mask=qo_mask,
                 cache_modifier=".cg")  # fmt: skip
        lse = m_i + tl.log2(l_i)  # -inf for an empty split
        lse_ptrs = part_lse_ptr + r * stride_lr + head * stride_lh + split
        tl.store(lse_ptrs, lse, mask=g < GROUP, cache_modifier=".cg")
        if MERGE_S > 0:
            # Every thread's stores precede the counter update (bar.sync), a release at GPU
            # scope; the last split's acquire orders its loads of the partials after it.
            tl.debug_barrier()
            count = counter_ptr + r * NUM_KV_HEADS + kv_head
            arrived = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
            if arrived == active - 1:
                # Left at zero for the next launch (kernel boundaries order it).
                tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")
                _merge_group_splits(
                    out_ptr, q_start, stride_ot, part_out_ptr, part_lse_ptr, r, kv_head,
                    active, num_splits, merge_splits, stride_pr, stride_ph, stride_lr,
                    stride_lh, GROUP, MERGE_G, HEAD_DIM, D_P, MERGE_S,
                )  # fmt: skip


@triton.jit(do_not_specialize=["req_offset"] + SPLIT_RUNTIME_INTS)
def decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    req_offset,
    num_splits,
    stride_ot,
    stride_pr,
    stride_ph,
    stride_lr,
    stride_lh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr,
    S_P: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program ``r * NUM_HEADS + head``: merge a decode token's splits into its output row
    (the request slowest, as in ``decode_attention_kernel``)."""
    allow_next_grid(USE_PDL)
    pid = tl.program_id(0)
    r = pid // NUM_HEADS
    req = req_offset + r
    # The batch layout is written before the step's first kernel: read it before the wait.
    q_start = tl.load(query_start_loc_ptr + req)
    q_end = tl.load(query_start_loc_ptr + req + 1)
    wait_for_prior_results(USE_PDL)
    if q_end - q_start != 1:
        return
    merge_splits(
        out_ptr, q_start, stride_ot, part_out_ptr, part_lse_ptr, r, pid % NUM_HEADS,
        num_splits, stride_pr, stride_ph, stride_lr, stride_lh, HEAD_DIM, D_P, S_P,
    )  # fmt: skip

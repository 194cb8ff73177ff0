"""Paged-attention kernels of prompt chunks: the varlen kernel with its key-split
reduction, and the shared-prefix kernel of cascade attention (tile loop and merge in
``common.py``; launches in ``paged.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels.attention.common import (
    M_INIT,
    SPLIT_RUNTIME_INTS,
    attend_tiles,
    local_start,
    merge_splits,
    sink_state,
)


@triton.jit(
    do_not_specialize=["req_offset", "num_decodes", "prefix_len", "split_base"]
    + SPLIT_RUNTIME_INTS
)
def shared_prefix_kernel(
    part_out_ptr,
    part_lse_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    req_offset,
    num_decodes,
    prefix_len,
    sm_scale,
    soft_cap,
    split_base,
    num_splits,
    stride_qt,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_pr,
    stride_ph,
    stride_lr,
    stride_lh,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Cascade attention's shared half: program (decode block, KV head, split) attends
    ``BLOCK_Q`` decode tokens times the ``GROUP`` heads of one KV head (``BLOCK_Q *
    GROUP_P`` rows of one ``tl.dot``) over its split of the first ``prefix_len`` keys, which
    every decode request ``req_offset .. req_offset + num_decodes - 1`` holds in the same
    physical blocks (read here through the first request's block table row).

    The decode kernel reads these keys once per request; here each key tile is read once per
    ``BLOCK_Q`` requests and multiplied on tensor cores. Every prefix key precedes every
    decode token, so only the prefix's last partial tile is masked. Writes normalized
    partial outputs and log2-sum-exps to ``part_out[r, head, split_base + split]`` /
    ``part_lse[...]`` (``r`` counted from ``req_offset``), merged with the decode kernel's
    splits of the keys from ``prefix_len`` on by the decode kernel's last split (or by
    ``decode_reduce_kernel`` where the launch has no merge counters). Cascade
    inference: Juravsky et al., "Hydragen" (2024); Ye et al., FlashInfer (2025).
    """
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    rows = tl.arange(0, BLOCK_M)
    r = q_block * BLOCK_Q + rows // GROUP_P
    g = rows % GROUP_P
    head = kv_head * GROUP + g
    d = tl.arange(0, D_P)
    row_valid = (r < num_decodes) & (g < GROUP)
    qo_mask = row_valid[:, None] & (d < HEAD_DIM)[None, :]
    q_rows = tl.load(query_start_loc_ptr + req_offset + r, mask=r < num_decodes, other=0)
    q = tl.load(
        q_ptr + q_rows.to(tl.int64)[:, None] * stride_qt + head[:, None] * HEAD_DIM + d[None, :],
        mask=qo_mask,
        other=0.0,
    )
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + prefix_len  # after every prefix key

    tiles_per_split = tl.cdiv(tl.cdiv(prefix_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, prefix_len)
    full_end = tl.maximum(start, end // BLOCK_N * BLOCK_N)
    acc = tl.zeros([BLOCK_M, D_P], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + M_INIT
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    block_row_ptr = block_table_ptr + req_offset.to(tl.int64) * stride_bt
    acc, m_i, l_i = attend_tiles(
        acc, m_i, l_i, q, q_pos, q_pos, k_cache_ptr, v_cache_ptr, block_row_ptr,
        kv_head * stride_ch, 0, prefix_len, 0, sm_scale, soft_cap, start, full_end, stride_cb,
        stride_cs,
        False, False, USE_SOFTCAP, HEAD_DIM, D_P, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, False,
    )  # fmt: skip
    acc, m_i, l_i = attend_tiles(
        acc, m_i, l_i, q, q_pos, q_pos, k_cache_ptr, v_cache_ptr, block_row_ptr,
        kv_head * stride_ch, 0, prefix_len, 0, sm_scale, soft_cap, full_end, end, stride_cb,
        stride_cs,
        True, False, USE_SOFTCAP, HEAD_DIM, D_P, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, False,
    )  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    part = r.to(tl.int64) * stride_pr + head * stride_ph + (split_base + split) * HEAD_DIM
    tl.store(part_out_ptr + part[:, None] + d[None, :], out, mask=qo_mask)
    lse = m_i + tl.log2(l_i)  # -inf for an empty split
    lse_ptrs = part_lse_ptr + r * stride_lr + head * stride_lh + split_base + split
    tl.store(lse_ptrs, lse, mask=row_valid)


@triton.jit(do_not_specialize=["row_offset"] + SPLIT_RUNTIME_INTS)
def varlen_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    row_offset,
    num_splits,
    stride_ot,
    stride_pr,
    stride_ph,
    stride_lr,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr,
    S_P: tl.constexpr,
):
    """Program (token, head): merge the KV splits of ``varlen_attention_kernel`` for query
    token ``row_offset + token``."""
    t = tl.program_id(0)
    merge_splits(
        out_ptr, row_offset + t, stride_ot, part_out_ptr, part_lse_ptr, t, tl.program_id(1),
        num_splits, stride_pr, stride_ph, stride_lr, stride_lh, HEAD_DIM, D_P, S_P,
    )  # fmt: skip


@triton.jit
def _find_seq(query_start_loc_ptr, req_offset, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks include program ``pid``.

    Sequence ``i`` (counted from ``req_offset``) owns programs from
    ``(query_start_loc[i] - query_start_loc[0]) // BLOCK_Q + i``: the ``+ i`` leaves room for
    each sequence's partial last block, so the starts increase and the grid needs at most
    ``num_tokens // BLOCK_Q + num_seqs`` programs. Binary search for the last start <= pid.
    """
    base = tl.load(query_start_loc_ptr + req_offset)
    lo = pid * 0
    hi = lo + num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        first = (tl.load(query_start_loc_ptr + req_offset + mid) - base) // BLOCK_Q + mid
        take = first <= pid
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid)
    return lo


@triton.jit(do_not_specialize=["req_offset", "num_seqs", "window"] + SPLIT_RUNTIME_INTS)
def varlen_attention_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    prefill_range_ptr,
    req_offset,
    num_seqs,
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
    sinks_ptr,
    last_key_pos_ptr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CHUNKED: tl.constexpr,
    USE_SINKS: tl.constexpr,
    UNIFORM: tl.constexpr,
    KEY_LIMITS: tl.constexpr,
):
    """Program (query block, KV head, split): ``BLOCK_Q`` consecutive query tokens of one
    sequence times the ``GROUP`` heads of one KV head, ``BLOCK_Q * GROUP_P`` rows in all,
    over the ``split``-th of ``num_splits`` contiguous runs of its key tiles. (With
    ``UNIFORM`` the grid has one axis: ``(query block * num_splits + split) * NUM_KV_HEADS
    + KV head``.)

    The tokens are the last ``q_len`` positions of a ``seq_len``-token context, so token
    ``t`` of the chunk sits at position ``seq_len - q_len + t`` and sees keys up to it (and,
    in local layers, from its ``local_start`` on: above ``pos - window``, or with ``CHUNKED``
    within its chunk of ``window`` tokens). With ``KEY_LIMITS`` a token sees keys up to
    ``last_key_pos[token]`` instead (int32, absolute, at least its own position, at most
    the context's last: a token of a bidirectional span, Gemma 3's image tokens, sees its
    whole span); the local start stays its own. Key tiles visible to every row skip the masks;
    only the tiles on the diagonal and at the local edge pay for them. With ``USE_SINKS``
    the first split starts each row's softmax from its head's sink logit (``sink_state``).
    With one split the result goes to ``out``; with more (a short chunk after a long
    context, whose few programs would leave most of the chip idle), each split writes its
    normalized partial output and log2-sum-exp to ``part_out[t, head, split]`` /
    ``part_lse[t, head, split]`` (``t`` counted from the first query token of
    ``req_offset``; split strides ``HEAD_DIM`` and 1) for ``varlen_reduce_kernel``.

    ``UNIFORM`` (a batch launched with uniform grids): the requests are
    ``prefill_range[1]`` from ``prefill_range[0]`` on (device int32), in place of
    ``num_seqs`` from ``req_offset``, and those with one query token are left to the
    decode kernel.
    """
    if UNIFORM:
        # One grid axis, the query block slowest: uniform grids size the grid for every
        # token of the step, the programs past its prompt tokens exit at once, and in this
        # order they are dispatched after the real ones rather than between them.
        kv_head = tl.program_id(0) % NUM_KV_HEADS
        split = (tl.program_id(0) // NUM_KV_HEADS) % num_splits
        pid = tl.program_id(0) // (NUM_KV_HEADS * num_splits)
    else:
        # A KV head's query blocks in order: they share its keys in L2.
        pid = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
    if UNIFORM:
        req_offset = tl.load(prefill_range_ptr)
        num_seqs = tl.load(prefill_range_ptr + 1)
        if num_seqs == 0:
            return
    seq = _find_seq(query_start_loc_ptr, req_offset, num_seqs, pid, BLOCK_Q)
    req = req_offset + seq
    first_token = tl.load(query_start_loc_ptr + req_offset)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block = pid - ((q_start - first_token) // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    if UNIFORM:
        if q_len == 1:
            return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    d = tl.arange(0, D_P)
    row_valid = (tok < q_len) & (rows % GROUP_P < GROUP)
    qo_mask = row_valid[:, None] & (d < HEAD_DIM)[None, :]
    qo_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + qo_rows[:, None] * stride_qt + head[:, None] * HEAD_DIM + d[None, :],
        mask=qo_mask,
        other=0.0,
    )
    q_pos = context_len + tok

    first_pos = context_len + q_block * BLOCK_Q
    end = tl.minimum(first_pos + BLOCK_Q, seq_len)  # one past the last query position
    q_last = q_pos
    if KEY_LIMITS:
        q_last = tl.maximum(tl.load(last_key_pos_ptr + qo_rows, mask=row_valid, other=0), q_pos)
        end = tl.minimum(tl.maximum(end, tl.max(tl.where(row_valid, q_last, 0), 0) + 1), seq_len)
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # tiles below it are causal for all rows
    kv_lo = 0  # the first row's local start: no row sees keys below it
    full_lo = 0  # the last row's local start, rounded up to a tile: every row sees above it
    if USE_WINDOW:
        kv_lo = tl.maximum(local_start(first_pos, window, CHUNKED), 0)
        last_lo = tl.maximum(local_start(end - 1, window, CHUNKED), 0)
        full_lo = tl.cdiv(last_lo, BLOCK_N) * BLOCK_N
    lo = kv_lo // BLOCK_N * BLOCK_N
    mid_lo = tl.minimum(tl.maximum(full_lo, lo), end)
    mid_hi = tl.maximum(full_end, mid_lo)  # full_end <= end
    # This split's run of key tiles, [split_lo, split_hi); each segment below is cut to it.
    tiles_per_split = tl.cdiv(tl.cdiv(end - lo, BLOCK_N), num_splits)
    split_lo = lo + split * tiles_per_split * BLOCK_N
    split_hi = split_lo + tiles_per_split * BLOCK_N

    acc = tl.zeros([BLOCK_M, D_P], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + M_INIT
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i, l_i = sink_state(sinks_ptr, head, row_valid, split == 0, m_i, l_i, USE_SINKS)
    block_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt
    kv_head_offset = kv_head * stride_ch
    acc, m_i, l_i = attend_tiles(
        acc, m_i, l_i, q, q_pos, q_last, k_cache_ptr, v_cache_ptr, block_row_ptr, kv_head_offset,
        kv_lo, seq_len, window, sm_scale, soft_cap, tl.maximum(lo, split_lo),
        tl.minimum(mid_lo, split_hi), stride_cb, stride_cs,
        True, USE_WINDOW, USE_SOFTCAP, HEAD_DIM, D_P, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
        CHUNKED,
    )  # fmt: skip
    acc, m_i, l_i = attend_tiles(
        acc, m_i, l_i, q, q_pos, q_last, k_cache_ptr, v_cache_ptr, block_row_ptr, kv_head_offset,
        kv_lo, seq_len, window, sm_scale, soft_cap, tl.maximum(mid_lo, split_lo),
        tl.minimum(mid_hi, split_hi), stride_cb, stride_cs,
        False, USE_WINDOW, USE_SOFTCAP, HEAD_DIM, D_P, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
        CHUNKED,
    )  # fmt: skip
    acc, m_i, l_i = attend_tiles(
        acc, m_i, l_i, q, q_pos, q_last, k_cache_ptr, v_cache_ptr, block_row_ptr, kv_head_offset,
        kv_lo, seq_len, window, sm_scale, soft_cap, tl.maximum(mid_hi, split_lo),
        tl.minimum(end, split_hi), stride_cb, stride_cs,
        True, USE_WINDOW, USE_SOFTCAP, HEAD_DIM, D_P, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
        CHUNKED,
    )  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if num_splits == 1:
        o_ptrs = out_ptr + qo_rows[:, None] * stride_ot + head[:, None] * HEAD_DIM + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=qo_mask)
    else:
        t = (q_start - first_token + tok).to(tl.int64)
        part = t * stride_pr + head * stride_ph + split * HEAD_DIM
        tl.store(part_out_ptr + part[:, None] + d[None, :], out, mask=qo_mask)
        lse = m_i + tl.log2(l_i)  # -inf where a row sees no key of this split
        tl.store(part_lse_ptr + t * stride_lr + head * stride_lh + split, lse, mask=row_valid)

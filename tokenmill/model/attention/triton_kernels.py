"""Triton kernels for paged attention: the shared-prefix kernel of cascade attention, a
varlen kernel for prompt chunks with its key-split reduction, and the tile loop and split
merge they share with the decode kernels (``triton_decode.py``; the KV-cache write is in
``triton_cache_write.py``).

All attention kernels use the online softmax of FlashAttention (Dao et al., NeurIPS 2022;
FlashAttention-2, Dao 2023): scores are kept in the log2 domain (``exp2`` is one instruction),
a running row maximum ``m`` and row sum ``l`` rescale the fp32 accumulator tile by tile, and
the output is ``acc / l``. Keys and values are read in place through the block table (paged
attention, Kwon et al. SOSP 2023): each key row of a tile looks up its own physical block, so a
tile may span several cache blocks and any ``block_size`` works.

GQA (Ainslie et al. 2023): one program serves all query heads that share a KV head, with the
(query token x head-in-group) pairs packed into the M dimension of ``tl.dot``, so K/V are read
once per group and the dot products run on tensor cores.

Launch logic, tile choices and the reasoning behind them live in ``triton_backend.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
# NOTE: the running maximum starts finite so that rows whose keys are all masked so far give
# exp2(-inf - (-1e30)) = 0 instead of exp2(-inf + inf) = NaN.
M_INIT: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _tanh(x):
    """tanh from one exp (portable: no libdevice, so it also runs in the interpreter)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def tile_rows(block_row_ptr, kv_head_offset, j, kv_valid, stride_cb, stride_cs,
              MASKED: tl.constexpr, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """Cache offsets ``[BLOCK_N]`` (int64) of keys ``j`` of one KV head, through the block
    table row ``block_row_ptr``; with ``MASKED`` only keys where ``kv_valid`` is set are
    looked up (the others point at block 0)."""
    if MASKED:
        block = tl.load(block_row_ptr + j // BLOCK_SIZE, mask=kv_valid, other=0)
    else:
        block = tl.load(block_row_ptr + j // BLOCK_SIZE)
    return block.to(tl.int64) * stride_cb + (j % BLOCK_SIZE) * stride_cs + kv_head_offset


@triton.jit
def scaled_scores(s, sm_scale, soft_cap, USE_SOFTCAP: tl.constexpr):
    """Raw scores ``q . k`` (fp32) scaled into the log2 domain, soft-capped if asked
    (Gemma 2: ``cap * tanh(s * scale / cap)``)."""
    if USE_SOFTCAP:
        s = soft_cap * _tanh(s * (sm_scale / soft_cap)) * LOG2E
    else:
        s = s * (sm_scale * LOG2E)
    return s


@triton.jit
def tile_scores(
    q, k, j, q_pos, kv_valid, window, sm_scale, soft_cap,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Scores ``[M, BLOCK_N]`` of ``q [M, D_P]`` against ``k [D_P, BLOCK_N]`` in the log2
    domain, soft-capped if asked, with the causal, sequence-end and window masks (-inf)."""
    s = scaled_scores(tl.dot(q, k, input_precision=DOT_PRECISION), sm_scale, soft_cap,
                      USE_SOFTCAP)  # fmt: skip
    if MASKED:
        visible = (j[None, :] <= q_pos[:, None]) & kv_valid[None, :]
        if USE_WINDOW:
            visible = visible & (j[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def softmax_step(m_i, l_i, s):
    """One online-softmax step over scores ``s [M, N]``: ``(m_new, l_new, alpha, p)``, where
    ``alpha [M]`` rescales the accumulator and ``p [M, N]`` weighs the tile's values."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def attend_tiles(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_cache_ptr,
    v_cache_ptr,
    block_row_ptr,
    kv_head_offset,
    kv_lo,
    seq_len,
    window,
    sm_scale,
    soft_cap,
    start,
    end,
    stride_cb,
    stride_cs,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold the key tiles ``[start, end)`` (step ``BLOCK_N``) into the online softmax state.

    ``acc`` ``[M, D_P]`` fp32, ``m_i``/``l_i`` ``[M]`` fp32 (log2 domain), ``q`` ``[M, D_P]``,
    ``q_pos`` ``[M]`` int32 positions of the query rows. ``MASKED`` tiles apply the causal,
    sequence-end and sliding-window masks and load no key outside ``[kv_lo, seq_len)`` (slots
    there may hold stale data, NaN included); unmasked tiles must be fully visible to every row.
    """
    d = tl.arange(0, D_P)
    d_valid = d < HEAD_DIM
    for j0 in range(start, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        kv_valid = (j >= kv_lo) & (j < seq_len)
        if MASKED:
            kt_mask = kv_valid[None, :] & d_valid[:, None]
            v_mask = kv_valid[:, None] & d_valid[None, :]
        else:
            kt_mask = d_valid[:, None]
            v_mask = d_valid[None, :]
        row = tile_rows(block_row_ptr, kv_head_offset, j, kv_valid, stride_cb, stride_cs,
                        MASKED, BLOCK_SIZE)  # fmt: skip
        # K is read transposed, [D_P, BLOCK_N], so q @ k needs no shuffle.
        k = tl.load(k_cache_ptr + row[None, :] + d[:, None], mask=kt_mask, other=0.0)
        s = tile_scores(q, k, j, q_pos, kv_valid, window, sm_scale, soft_cap,
                        MASKED, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION)  # fmt: skip
        m_i, l_i, alpha, p = softmax_step(m_i, l_i, s)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=v_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


# NOTE: every integer that changes from step to step is a runtime argument excluded from
# Triton's specialization (on 1 and on divisibility by 16): a new value must never trigger a
# compile in the middle of serving (each one stalls the engine for most of a second). These
# are the split count and the strides of the split workspaces, which every kernel that
# writes or merges splits takes.
SPLIT_RUNTIME_INTS = ["num_splits", "stride_pr", "stride_ph", "stride_lr", "stride_lh"]


@triton.jit
def merge_splits(
    out_ptr, out_row, stride_ot, part_out_ptr, part_lse_ptr, r, head, num_splits,
    stride_pr, stride_ph, stride_lr, stride_lh,
    HEAD_DIM: tl.constexpr, D_P: tl.constexpr, S_P: tl.constexpr,
):
    """Partial row ``r``, head ``head``: merge the splits' partial outputs, each weighted by
    ``exp2(lse_s - max lse)`` (the log-sum-exp merge of flash-decoding), into output row
    ``out_row``."""
    s = tl.arange(0, S_P)
    d = tl.arange(0, D_P)
    lse_ptrs = part_lse_ptr + r * stride_lr + head * stride_lh + s
    lse = tl.load(lse_ptrs, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    mask = (s < num_splits)[:, None] & (d < HEAD_DIM)[None, :]
    base = r.to(tl.int64) * stride_pr + head * stride_ph
    parts = tl.load(part_out_ptr + base + s[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + out_row.to(tl.int64) * stride_ot + head * HEAD_DIM + d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)



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
    ``decode_reduce_kernel``, with ``TOKENMILL_DECODE_SPLIT_SELF_MERGE=0``). Cascade
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
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_row_ptr, kv_head * stride_ch,
        0, prefix_len, 0, sm_scale, soft_cap, start, full_end, stride_cb, stride_cs,
        False, False, USE_SOFTCAP, HEAD_DIM, D_P, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = attend_tiles(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_row_ptr, kv_head * stride_ch,
        0, prefix_len, 0, sm_scale, soft_cap, full_end, end, stride_cb, stride_cs,
        True, False, USE_SOFTCAP, HEAD_DIM, D_P, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
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
    UNIFORM: tl.constexpr,
):
    """Program (query block, KV head, split): ``BLOCK_Q`` consecutive query tokens of one
    sequence times the ``GROUP`` heads of one KV head, ``BLOCK_Q * GROUP_P`` rows in all,
    over the ``split``-th of ``num_splits`` contiguous runs of its key tiles. (With
    ``UNIFORM`` the grid has one axis: ``(query block * num_splits + split) * NUM_KV_HEADS
    + KV head``.)

    The tokens are the last ``q_len`` positions of a ``seq_len``-token context, so token
    ``t`` of the chunk sits at position ``seq_len - q_len + t`` and sees keys up to it (and
    above ``pos - window``). Key tiles visible to every row skip the masks; only the tiles on
    the diagonal and at the window's edge pay for them. With one split the result goes to
    ``out``; with more (a short chunk after a long context, whose few programs would leave
    most of the chip idle), each split writes its normalized partial output and log2-sum-exp
    to ``part_out[t, head, split]`` / ``part_lse[t, head, split]`` (``t`` counted from the
    first query token of ``req_offset``; split strides ``HEAD_DIM`` and 1) for
    ``varlen_reduce_kernel``.

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
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # tiles below it are causal for all rows
    kv_lo = 0  # the first row's window start: no row sees keys below it
    full_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(first_pos - window + 1, 0)
        full_lo = tl.cdiv(tl.maximum(end - window, 0), BLOCK_N) * BLOCK_N
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
    block_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt
    kv_head_offset = kv_head * stride_ch
    acc, m_i, l_i = attend_tiles(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_row_ptr, kv_head_offset,
        kv_lo, seq_len, window, sm_scale, soft_cap, tl.maximum(lo, split_lo),
        tl.minimum(mid_lo, split_hi), stride_cb, stride_cs,
        True, USE_WINDOW, USE_SOFTCAP, HEAD_DIM, D_P, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = attend_tiles(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_row_ptr, kv_head_offset,
        kv_lo, seq_len, window, sm_scale, soft_cap, tl.maximum(mid_lo, split_lo),
        tl.minimum(mid_hi, split_hi), stride_cb, stride_cs,
        False, USE_WINDOW, USE_SOFTCAP, HEAD_DIM, D_P, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = attend_tiles(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_row_ptr, kv_head_offset,
        kv_lo, seq_len, window, sm_scale, soft_cap, tl.maximum(mid_hi, split_lo),
        tl.minimum(end, split_hi), stride_cb, stride_cs,
        True, USE_WINDOW, USE_SOFTCAP, HEAD_DIM, D_P, BLOCK_SIZE, BLOCK_N, DOT_PRECISION,
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

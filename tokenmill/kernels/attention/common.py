"""What every paged-attention kernel shares: the tile loop over paged keys, the scores and
masks, the online-softmax step and the log-sum-exp merge of key splits.

All attention kernels use the online softmax of FlashAttention (Dao et al., NeurIPS 2022;
FlashAttention-2, Dao 2023): scores are kept in the log2 domain (``exp2`` is one instruction),
a running row maximum ``m`` and row sum ``l`` rescale the fp32 accumulator tile by tile, and
the output is ``acc / l``. Keys and values are read in place through the block table (paged
attention, Kwon et al. SOSP 2023): each key row of a tile looks up its own physical block, so a
tile may span several cache blocks and any ``block_size`` works.

GQA (Ainslie et al. 2023): one program serves all query heads that share a KV head, with the
(query token x head-in-group) pairs packed into the M dimension of ``tl.dot``, so K/V are read
once per group and the dot products run on tensor cores.
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
def local_start(q_pos, window, CHUNKED: tl.constexpr):
    """The first key position a query at ``q_pos`` sees in a local layer: with ``CHUNKED``
    the start of its chunk of ``window`` tokens (``q_pos // window * window``, Llama 4's
    chunked attention), else the start of its sliding window (``q_pos - window + 1``; may
    be negative). Monotone in ``q_pos``, so a tile's first and last rows bound its rows'."""
    if CHUNKED:
        return q_pos // window * window
    return q_pos - window + 1


@triton.jit
def sink_state(sinks_ptr, head, head_valid, holds_sink, m_i, l_i, USE_SINKS: tl.constexpr):
    """The online-softmax state ``(m, l)`` ``[M]`` to start from: as given, or where
    ``holds_sink`` (one program per row: the first key split) with each row's sink logit
    (``sinks_ptr[head]``, scaled into the log2 domain) already folded in, as a key of value
    zero: ``m = sink``, ``l = 1``, and the accumulator stays zero."""
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head, mask=head_valid & holds_sink, other=0.0)
        sink = sink.to(tl.float32) * LOG2E
        take = head_valid & holds_sink
        m_i = tl.where(take, sink, m_i)
        l_i = tl.where(take, 1.0, l_i)
    return m_i, l_i


@triton.jit
def tile_scores(
    q, k, j, q_pos, q_last, kv_valid, window, sm_scale, soft_cap,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, CHUNKED: tl.constexpr,
):  # fmt: skip
    """Scores ``[M, BLOCK_N]`` of ``q [M, D_P]`` against ``k [D_P, BLOCK_N]`` in the log2
    domain, soft-capped if asked, with the causal, sequence-end and local masks (-inf): a
    query sees no key after ``q_last`` (its own position ``q_pos``, or later for a token of
    a bidirectional span) and, with ``USE_WINDOW``, none before ``local_start(q_pos)``."""
    s = scaled_scores(tl.dot(q, k, input_precision=DOT_PRECISION), sm_scale, soft_cap,
                      USE_SOFTCAP)  # fmt: skip
    if MASKED:
        visible = (j[None, :] <= q_last[:, None]) & kv_valid[None, :]
        if USE_WINDOW:
            visible = visible & (j[None, :] >= local_start(q_pos, window, CHUNKED)[:, None])
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
    q_last,
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
    CHUNKED: tl.constexpr,
):
    """Fold the key tiles ``[start, end)`` (step ``BLOCK_N``) into the online softmax state.

    ``acc`` ``[M, D_P]`` fp32, ``m_i``/``l_i`` ``[M]`` fp32 (log2 domain), ``q`` ``[M, D_P]``,
    ``q_pos`` ``[M]`` int32 positions of the query rows, ``q_last`` ``[M]`` int32 the last key
    position each row sees (``q_pos`` where attention is causal). ``MASKED`` tiles apply the causal,
    sequence-end and local (window or chunk: ``local_start``) masks and load no key outside
    ``[kv_lo, seq_len)`` (slots there may hold stale data, NaN included); unmasked tiles must
    be fully visible to every row.
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
        k = k.to(q.dtype)  # FP8 caches: widened for the product
        s = tile_scores(q, k, j, q_pos, q_last, kv_valid, window, sm_scale, soft_cap,
                        MASKED, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION, CHUNKED)  # fmt: skip
        m_i, l_i, alpha, p = softmax_step(m_i, l_i, s)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=v_mask, other=0.0)
        v = v.to(q.dtype)
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

"""The Triton kernel of ``skinny_gemm`` (its design, bandwidth model and launch logic are
described there): the CUDA-core and tensor-core main loops, the in-launch split-K combine,
and the prologues that compute the input (RMSNorm with the residual add, SiLU-and-mul) as
it is read, in place of a separate kernel before the product.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_tile(ptrs, k_ok, EVEN_K: tl.constexpr, EVICT: tl.constexpr):
    # k_ok: [1, BLOCK_K] or [BLOCK_K] mask of in-range K; unused when K is whole tiles.
    if EVEN_K:
        tile = tl.load(ptrs, eviction_policy=EVICT)
    else:
        tile = tl.load(ptrs, mask=k_ok, other=0.0, eviction_policy=EVICT)
    return tile

@triton.jit
def _row_rstd(x_ptr, r_ptr, res_out_ptr, row, stride_xm, stride_rm, K, eps, store,
              K_P: tl.constexpr):  # fmt: skip
    """RMSNorm's ``1 / rms`` (fp32) of row ``row`` of ``x + r``, the sum rounded to x's
    dtype first as ``fused_kernels.rms_norm`` stores it; also stores that sum into
    ``res_out`` (rows ``stride_rm``) when ``store``."""
    k = tl.arange(0, K_P)
    ok = k < K
    h = tl.load(x_ptr + row * stride_xm + k, mask=ok, other=0.0)
    r = tl.load(r_ptr + row * stride_rm + k, mask=ok, other=0.0)
    s = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
    tl.store(res_out_ptr + row * stride_rm + k, s, mask=ok & store)
    s = s.to(tl.float32)
    return tl.rsqrt(tl.sum(s * s, axis=0) / K + eps)


@triton.jit
def _prologue_tile(x_ptrs, r_ptrs, nw_ptrs, mask, rstd, norm_offset, up_offset,
                   PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """A tile of the product's input computed from what the previous kernel left: with
    ``PROLOGUE == 1`` RMSNorm of ``x + r`` (``rstd`` from ``_row_rstd``, weight tile at
    ``nw_ptrs``), with ``PROLOGUE == 2`` ``silu(gate) * up`` (up ``up_offset`` elements
    after gate). Each in fp32 and rounded to x's dtype as the separate kernels
    (``fused_kernels``) compute and store it."""
    if PROLOGUE == 1:
        h = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
        r = tl.load(r_ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
        nw = tl.load(nw_ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
        s = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype).to(tl.float32)
        tile = (s * rstd * (nw.to(tl.float32) + norm_offset)).to(h.dtype)
    else:
        g = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
        u = tl.load(x_ptrs + up_offset, mask=mask, other=0.0, eviction_policy="evict_last")
        gf = g.to(tl.float32)
        tile = (gf / (1.0 + tl.exp(-gf)) * u.to(tl.float32)).to(g.dtype)
    return tl.broadcast_to(tile, [BLOCK_N, tile.shape[1]])


@triton.jit
def _fma_mainloop(
    x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, pid_n, k_start, num_tiles,
    r_ptr, nw_ptr, res_out_ptr, stride_rm, eps, norm_offset, lead,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, PROLOGUE: tl.constexpr, K_P: tl.constexpr,
):  # fmt: skip
    """Partial sums ``[BLOCK_N, BLOCK_M]`` (fp32) on CUDA cores, BLOCK_M <= 4.

    Tile ``i + 1`` is loaded into registers before tile ``i`` is multiplied, so each
    program has two tiles of loads in flight (Triton's pipeliner stages only loads that
    feed ``tl.dot``).

    ``PROLOGUE`` (BLOCK_M <= 2) computes the input from the previous kernel's outputs
    instead of reading it (``_prologue_tile``): 1, RMSNorm of ``x + r`` (each program
    first reduces its rows over all of K; the ``lead`` program also stores ``x + r`` into
    ``res_out``); 2, ``silu(x[:, :K]) * x[:, K:]``.
    """
    # Rows past N re-read row N-1 so that the weight loads need no row mask.
    rows = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    offs_k = (k_start + tl.arange(0, BLOCK_K))[None, :]
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k
    # Rows of x as [1, BLOCK_K] tiles take the weight tile's register layout (a 1-D load
    # would be re-laid out through shared memory every iteration). Rows past M repeat
    # row M-1; their outputs are never stored.
    x0 = x_ptr + offs_k + tl.zeros([BLOCK_N, 1], dtype=tl.int32)
    x1 = x0 + tl.minimum(1, M - 1) * stride_xm
    x2 = x0 + tl.minimum(2, M - 1) * stride_xm
    x3 = x0 + tl.minimum(3, M - 1) * stride_xm
    ok = offs_k < K
    # The prologue's operands as [1, BLOCK_K] rows (rows 0 and 1 only): computed once per
    # tile and broadcast, not per weight row as x's tiles above are loaded.
    p0 = x_ptr + offs_k
    p1 = p0 + tl.minimum(1, M - 1) * stride_xm
    r0 = r_ptr + offs_k
    r1 = r0 + tl.minimum(1, M - 1) * stride_rm
    nw = nw_ptr + offs_k
    w = _load_tile(w_ptrs, ok, EVEN_K, "evict_first")
    if USE_PDL:  # the weight is ours; x may still be being written by the previous kernel
        tl.extra.cuda.gdc_wait()
    if PROLOGUE == 0:
        v0 = _load_tile(x0, ok, EVEN_K, "evict_last")
        v1 = _load_tile(x1, ok, EVEN_K, "evict_last")
        v2 = _load_tile(x2, ok, EVEN_K, "evict_last")
        v3 = _load_tile(x3, ok, EVEN_K, "evict_last")
    else:
        tl.static_assert(BLOCK_M <= 2, "a prologue takes at most 2 rows")
        rstd0 = 0.0
        rstd1 = 0.0
        if PROLOGUE == 1:
            rstd0 = _row_rstd(x_ptr, r_ptr, res_out_ptr, 0, stride_xm, stride_rm, K, eps,
                              lead, K_P)  # fmt: skip
            if BLOCK_M > 1:
                rstd1 = _row_rstd(x_ptr, r_ptr, res_out_ptr, tl.minimum(1, M - 1), stride_xm,
                                  stride_rm, K, eps, lead & (M > 1), K_P)  # fmt: skip
        v0 = _prologue_tile(p0, r0, nw, ok, rstd0, norm_offset, K, PROLOGUE, BLOCK_N)
        v1 = _prologue_tile(p1, r1, nw, ok, rstd1, norm_offset, K, PROLOGUE, BLOCK_N)
        v2 = v0
        v3 = v1
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for i in range(num_tiles):
        more = i + 1 < num_tiles  # the last prefetch is masked off entirely
        if EVEN_K:
            ok_next = more
        else:
            ok_next = (offs_k + (i + 1) * BLOCK_K < K) & more
        w_ptrs += BLOCK_K
        w_next = tl.load(w_ptrs, mask=ok_next, other=0.0, eviction_policy="evict_first")
        x0 += BLOCK_K
        if PROLOGUE == 0:
            v0_next = tl.load(x0, mask=ok_next, other=0.0, eviction_policy="evict_last")
        else:
            p0 += BLOCK_K
            r0 += BLOCK_K
            nw += BLOCK_K
            v0_next = _prologue_tile(p0, r0, nw, ok_next, rstd0, norm_offset, K, PROLOGUE,
                                     BLOCK_N)  # fmt: skip
        if BLOCK_M > 1:
            x1 += BLOCK_K
            if PROLOGUE == 0:
                v1_next = tl.load(x1, mask=ok_next, other=0.0, eviction_policy="evict_last")
            else:
                p1 += BLOCK_K
                r1 += BLOCK_K
                v1_next = _prologue_tile(p1, r1, nw, ok_next, rstd1, norm_offset, K, PROLOGUE,
                                         BLOCK_N)  # fmt: skip
        if BLOCK_M > 2:
            x2 += BLOCK_K
            x3 += BLOCK_K
            v2_next = tl.load(x2, mask=ok_next, other=0.0, eviction_policy="evict_last")
            v3_next = tl.load(x3, mask=ok_next, other=0.0, eviction_policy="evict_last")
        wf = w.to(tl.float32)
        acc0 += wf * v0.to(tl.float32)
        w = w_next
        v0 = v0_next
        if BLOCK_M > 1:
            acc1 += wf * v1.to(tl.float32)
            v1 = v1_next
        if BLOCK_M > 2:
            acc2 += wf * v2.to(tl.float32)
            acc3 += wf * v3.to(tl.float32)
            v2 = v2_next
            v3 = v3_next
    # One cross-lane reduction per row, after the loop; rows become columns of the tile.
    cols = tl.arange(0, BLOCK_M)[None, :]
    acc = tl.where(cols == 0, tl.sum(acc0, axis=1)[:, None], 0.0)
    if BLOCK_M > 1:
        acc = tl.where(cols == 1, tl.sum(acc1, axis=1)[:, None], acc)
    if BLOCK_M > 2:
        acc = tl.where(cols == 2, tl.sum(acc2, axis=1)[:, None], acc)
        acc = tl.where(cols == 3, tl.sum(acc3, axis=1)[:, None], acc)
    return acc

@triton.jit
def _dot_mainloop(
    x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, pid_n, k_start, num_tiles,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Partial sums ``[BLOCK_N, BLOCK_M]`` (fp32) on tensor cores: ``W_tile @ x_tile^T``."""
    rows = tl.minimum(pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
    offs_m = tl.minimum(tl.arange(0, BLOCK_M), M - 1)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for i in range(num_tiles):
        k_ok = (offs_k + i * BLOCK_K < K)[None, :]
        w = _load_tile(w_ptrs, k_ok, EVEN_K, "evict_first")
        xt = _load_tile(x_ptrs, k_ok, EVEN_K, "evict_last")
        acc = tl.dot(w, tl.trans(xt), acc, input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc

@triton.jit
def _store_output(
    acc, out_ptr, bias_ptr, pid_n, M, N, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc += b.to(tl.float32)[:, None]
    ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

@triton.jit
def _split_k_combine(
    acc, out_ptr, bias_ptr, part_ptr, lock_ptr, pid_n, pid_k, splits, M, N, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Publish this split's partial tile; the last split of the column block sums all
    of them in split order and writes the output."""
    TILE: tl.constexpr = BLOCK_N * BLOCK_M
    cols = tl.arange(0, BLOCK_M)[None, :]
    idx = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + cols
    live = (idx >= 0) & (cols < M)  # padded rows of x are neither written nor read
    tiles = part_ptr + pid_n.to(tl.int64) * splits * TILE + idx
    # .cg: partials go to L2, the one level every SM sees coherently.
    tl.store(tiles + pid_k * TILE, acc, mask=live, cache_modifier=".cg")
    # Every thread's partial store precedes the counter update (bar.sync), which is a
    # release at GPU scope; the reader's acquire orders its partial loads after it.
    tl.debug_barrier()
    arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == splits - 1:
        total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for s in range(0, splits):
            total += tl.load(tiles + s * TILE, mask=live, other=0.0, cache_modifier=".cg")
        # Leave the counter at zero for the next launch (kernel boundaries order it).
        tl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed", scope="gpu")
        _store_output(total, out_ptr, bias_ptr, pid_n, M, N, stride_om,
                      BLOCK_N, BLOCK_M, HAS_BIAS)  # fmt: skip

@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, r_ptr, nw_ptr, res_out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_rm, splits, k_per_split, eps,
    norm_offset,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    USE_DOT: tl.constexpr, USE_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
    PROLOGUE: tl.constexpr = 0, K_P: tl.constexpr = 1,
):  # fmt: skip
    """``out[M, N] = x[M, K] @ w[N, K]^T (+ bias)``; grid ``(cdiv(N, BLOCK_N) * splits,)``.

    The splits of one column block are adjacent program ids, so they run at the same
    time and their combine happens early rather than in a tail at the end. With a
    ``PROLOGUE`` (CUDA cores only; see ``_fma_mainloop``) the input is computed from
    ``x`` (and ``r``, ``nw``) as the tiles are read; program 0 stores the new residual.
    """
    pid = tl.program_id(0)
    pid_n = pid // splits
    pid_k = pid % splits
    k_start = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    num_tiles = tl.cdiv(tl.minimum(k_per_split, K - k_start), BLOCK_K)
    if USE_PDL:
        # Let the next kernel's programs take free slots as ours retire; it waits for
        # our completion before it reads what we write.
        tl.extra.cuda.gdc_launch_dependents()
    if USE_DOT:
        tl.static_assert(PROLOGUE == 0, "the tensor-core loop takes no prologue")
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        acc = _dot_mainloop(
            x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, pid_n, k_start, num_tiles,
            BLOCK_N, BLOCK_K, BLOCK_M, EVEN_K, DOT_PRECISION,
        )  # fmt: skip
    else:
        acc = _fma_mainloop(
            x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, pid_n, k_start, num_tiles,
            r_ptr, nw_ptr, res_out_ptr, stride_rm, eps, norm_offset, pid == 0,
            BLOCK_N, BLOCK_K, BLOCK_M, EVEN_K, USE_PDL, PROLOGUE, K_P,
        )  # fmt: skip
    if USE_SPLIT:
        _split_k_combine(acc, out_ptr, bias_ptr, part_ptr, lock_ptr, pid_n, pid_k, splits,
                         M, N, stride_om, BLOCK_N, BLOCK_M, HAS_BIAS)  # fmt: skip
    else:
        _store_output(acc, out_ptr, bias_ptr, pid_n, M, N, stride_om,
                      BLOCK_N, BLOCK_M, HAS_BIAS)  # fmt: skip

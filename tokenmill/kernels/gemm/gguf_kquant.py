"""llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K) in the product ``y = x @ W^T``: a GEMV for
one row of ``x`` and a tensor-core tile kernel for decode batches.

Batch-1 decode reads every weight byte once per token, so its speed is the rate at which the
kernel streams ``W [N, row_bytes]`` (uint8, ``K / 256`` super-blocks per row). The general
kernel of ``tokenmill.kernels.gemm.gguf`` builds a ``[BLOCK_K, BLOCK_N]`` tile weight by weight
for ``tl.dot``, which reads the blocks byte by byte across rows; these kernels instead read
each row's quant bytes as contiguous runs (16 or 32 bytes, vector loads) and factor the
block arithmetic out of the inner product, as llama.cpp's ``vec_dot_q4_K_q8_K`` and
``vec_dot_q6_K_q8_K`` do (ggml-quants.c), but with ``x`` kept in float32:

- Q4_K (144 bytes: ``d``, ``dmin``, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles):
  a 32-byte run holds the low-nibble sub-block ``2c`` and the high-nibble sub-block ``2c + 1``
  of chunk ``c``, so ``sum_j w_j x_j = d * sum_sb sc_sb * (q . x)_sb - dmin * sum_sb m_sb *
  (sum x)_sb``. Q5_K (176 bytes) is Q4_K's layout with each weight's fifth bit in 32 bytes of
  ``qh`` before the nibbles (bits 2c and 2c + 1 of byte t for run c).
- Q6_K (210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, ``d``):
  a 16-byte run of ``ql`` and its 16 ``qh`` bytes hold two 16-weight groups (low and high
  nibble), each with its own scale: ``sum_j w_j x_j = d * sum_g sc_g * (q . x)_g``.

A GEMV program takes ``BLOCK_N`` rows of ``W`` for one row of ``x`` over a range of
super-blocks (split-K; partial sums added with float32 atomics). The tile kernel reads the
same runs, applies the scales per run in float32 and feeds ``tl.dot`` twice per super-block:
the low-nibble weights against the columns of ``x`` they multiply, then the high ones.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.device import HAS_TRITON
from tokenmill.kernels.quant.gguf_blocks import block_info
from tokenmill.math_utils import cdiv

Q4_K, Q5_K, Q6_K = 12, 13, 14
KQUANT_TYPES = (Q4_K, Q5_K, Q6_K)
# One program per row of x: above this many rows the tensor-core kernel, which unpacks each
# weight once for all rows, takes over (H100: at 4 rows the GEMV took 1.7-2.0x its time).
GEMV_MAX_M = 1


if HAS_TRITON:
    import triton
    import triton.language as tl

    from tokenmill.kernels.gemm.gguf_bytes import load_f16, load_u8, store_row

    @triton.jit
    def _q4k_scale_min(scales_ptr, sb, mask):
        """Sub-block ``sb``'s 6-bit scale and min (ggml's ``get_scale_min_k4``), float32."""
        lo4 = sb < 4
        s_a = load_u8(scales_ptr + sb, mask & lo4)
        s_b = load_u8(scales_ptr + sb + 4, mask)
        s_c = load_u8(scales_ptr + sb - 4, mask & (sb >= 4))
        sc = tl.where(lo4, s_a & 63, (s_b & 0xF) | ((s_c >> 6) << 4))
        mn = tl.where(lo4, s_b & 63, (s_b >> 4) | ((load_u8(scales_ptr + sb, mask) >> 6) << 4))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _nibbles(qs, base, c, t, mask, FIVE: tl.constexpr):
        """The weights of Q4_K/Q5_K runs ``qs [BLOCK_N, G, 32]`` (chunk ``c [G]``): low
        nibbles (sub-block 2c) and high ones (2c + 1), with Q5_K's fifth bits from qh (bits
        2c and 2c + 1 of qh byte t)."""
        q_lo = qs & 0xF
        q_hi = qs >> 4
        if FIVE:
            qh = tl.load(base[:, :, None] + 16 + t[None, None, :], mask=mask[:, :, None],
                         other=0).to(tl.int32)
            shift = (2 * c)[None, :, None]
            q_lo = q_lo | (((qh >> shift) & 1) << 4)
            q_hi = q_hi | (((qh >> (shift + 1)) & 1) << 4)
        return q_lo, q_hi

    @triton.jit
    def _q4k_gemv_kernel(x_ptr, w_ptr, out_ptr, N, stride_xm, stride_om, row_bytes,
                         num_blocks, blocks_per_split,
                         ATOMIC: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr,
                         FIVE: tl.constexpr):
        # G = 4 * SB runs of 32 bytes per iteration: run g is chunk g % 4 of super-block g // 4.
        # FIVE: Q5_K, Q4_K's layout with a fifth bit per weight (qh, 32 bytes before qs).
        G: tl.constexpr = 4 * SB
        BLOCK_BYTES: tl.constexpr = 176 if FIVE else 144
        QS: tl.constexpr = 48 if FIVE else 16
        m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        g = tl.arange(0, G)
        c = g % 4
        t = tl.arange(0, 32)
        row = offs_n.to(tl.int64) * row_bytes
        x_row = x_ptr + m.to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_N, G), dtype=tl.float32)
        b_start = pid_k * blocks_per_split
        b_end = tl.minimum(b_start + blocks_per_split, num_blocks)
        for b0 in range(b_start, b_end, SB):
            blk = b0 + g // 4
            g_mask = blk < b_end
            mask = n_mask[:, None] & g_mask[None, :]
            base = w_ptr + row[:, None] + (blk * BLOCK_BYTES)[None, :]  # [BLOCK_N, G]
            qs = tl.load(base[:, :, None] + (QS + c * 32)[None, :, None] + t[None, None, :],
                         mask=mask[:, :, None], other=0).to(tl.int32)
            q_lo, q_hi = _nibbles(qs, base, c, t, mask, FIVE)
            xk = blk * 256 + c * 64
            x_lo = tl.load(x_row + xk[:, None] + t[None, :], mask=g_mask[:, None],
                           other=0.0).to(tl.float32)
            x_hi = tl.load(x_row + xk[:, None] + 32 + t[None, :], mask=g_mask[:, None],
                           other=0.0).to(tl.float32)
            qx_lo = tl.sum(q_lo.to(tl.float32) * x_lo[None, :, :], axis=2)
            qx_hi = tl.sum(q_hi.to(tl.float32) * x_hi[None, :, :], axis=2)
            sc_lo, mn_lo = _q4k_scale_min(base + 4, (2 * c)[None, :], mask)
            sc_hi, mn_hi = _q4k_scale_min(base + 4, (2 * c + 1)[None, :], mask)
            xs_lo = tl.sum(x_lo, axis=1)[None, :]
            xs_hi = tl.sum(x_hi, axis=1)[None, :]
            acc += load_f16(base, mask) * (sc_lo * qx_lo + sc_hi * qx_hi) \
                - load_f16(base + 2, mask) * (mn_lo * xs_lo + mn_hi * xs_hi)
        store_row(out_ptr + m.to(tl.int64) * stride_om + offs_n, tl.sum(acc, axis=1), n_mask,
                  ATOMIC)

    @triton.jit
    def _q6k_gemv_kernel(x_ptr, w_ptr, out_ptr, N, stride_xm, stride_om, row_bytes,
                         num_blocks, blocks_per_split,
                         ATOMIC: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr):
        # G = 8 * SB runs of 16 ql bytes per iteration: run g of super-block g // 8 is half
        # ``h`` of the 32-byte quarter (c, u): ql byte c*64 + h*32 + u*16 + t holds weight
        # c*128 + h*32 + u*16 + t (low nibble) and that + 64 (high nibble); their two high
        # bits are bit pairs h and h + 2 of qh byte c*32 + u*16 + t.
        G: tl.constexpr = 8 * SB
        m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        g = tl.arange(0, G)
        c = (g % 8) // 4
        h = (g % 4) // 2
        u = g % 2
        t = tl.arange(0, 16)
        row = offs_n.to(tl.int64) * row_bytes
        x_row = x_ptr + m.to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_N, G), dtype=tl.float32)
        b_start = pid_k * blocks_per_split
        b_end = tl.minimum(b_start + blocks_per_split, num_blocks)
        for b0 in range(b_start, b_end, SB):
            blk = b0 + g // 8
            g_mask = blk < b_end
            mask = n_mask[:, None] & g_mask[None, :]
            mask3 = mask[:, :, None]
            base = w_ptr + row[:, None] + (blk * 210)[None, :]  # [BLOCK_N, G]
            ql = tl.load(base[:, :, None] + (c * 64 + h * 32 + u * 16)[None, :, None]
                         + t[None, None, :], mask=mask3, other=0).to(tl.int32)
            qh = tl.load(base[:, :, None] + (128 + c * 32 + u * 16)[None, :, None]
                         + t[None, None, :], mask=mask3, other=0).to(tl.int32)
            shift = (2 * h)[None, :, None]
            q_lo = ((ql & 0xF) | (((qh >> shift) & 3) << 4)) - 32
            q_hi = ((ql >> 4) | (((qh >> (shift + 4)) & 3) << 4)) - 32
            xk = blk * 256 + c * 128 + h * 32 + u * 16
            x_lo = tl.load(x_row + xk[:, None] + t[None, :], mask=g_mask[:, None],
                           other=0.0).to(tl.float32)
            x_hi = tl.load(x_row + xk[:, None] + 64 + t[None, :], mask=g_mask[:, None],
                           other=0.0).to(tl.float32)
            qx_lo = tl.sum(q_lo.to(tl.float32) * x_lo[None, :, :], axis=2)
            qx_hi = tl.sum(q_hi.to(tl.float32) * x_hi[None, :, :], axis=2)
            s = base + 192 + (c * 8 + h * 2 + u)[None, :]
            sc_lo = tl.load(s, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            sc_hi = tl.load(s + 4, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            acc += load_f16(base + 208, mask) * (sc_lo * qx_lo + sc_hi * qx_hi)
        store_row(out_ptr + m.to(tl.int64) * stride_om + offs_n, tl.sum(acc, axis=1), n_mask,
                  ATOMIC)

    @triton.jit
    def _q4k_mm_kernel(x_ptr, w_ptr, out_ptr, M, N, stride_xm, stride_om, row_bytes,
                       num_blocks, blocks_per_split,
                       DOT_PRECISION: tl.constexpr, ATOMIC: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FIVE: tl.constexpr):
        # Per super-block: the 128 quant bytes as 4 runs of 32 (chunk c); byte t of run c
        # holds weight c*64 + t (low nibble, sub-block 2c) and c*64 + 32 + t (high, 2c + 1).
        pid_mn = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_n = tl.cdiv(N, BLOCK_N)
        offs_m = (pid_mn // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (pid_mn % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        c = tl.arange(0, 4)
        t = tl.arange(0, 32)
        kk = tl.arange(0, 128)
        x_cols = (kk // 32) * 64 + kk % 32  # the low nibbles' columns, in run order
        row = offs_n.to(tl.int64) * row_bytes
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        b_start = pid_k * blocks_per_split
        b_end = tl.minimum(b_start + blocks_per_split, num_blocks)
        BLOCK_BYTES: tl.constexpr = 176 if FIVE else 144
        QS: tl.constexpr = 48 if FIVE else 16
        for blk in range(b_start, b_end):
            base = w_ptr + row + blk * BLOCK_BYTES  # [BLOCK_N]
            nb = base[:, None]
            mask = n_mask[:, None]
            qs = tl.load(nb[:, :, None] + (QS + c * 32)[None, :, None] + t[None, None, :],
                         mask=mask[:, :, None], other=0).to(tl.int32)
            q_lo, q_hi = _nibbles(qs, nb, c, t, mask, FIVE)
            d = load_f16(nb, mask)
            dmin = load_f16(nb + 2, mask)
            sc_lo, mn_lo = _q4k_scale_min(nb + 4, (2 * c)[None, :], mask)
            sc_hi, mn_hi = _q4k_scale_min(nb + 4, (2 * c + 1)[None, :], mask)
            w_lo = (d * sc_lo)[:, :, None] * q_lo.to(tl.float32) - (dmin * mn_lo)[:, :, None]
            w_hi = (d * sc_hi)[:, :, None] * q_hi.to(tl.float32) - (dmin * mn_hi)[:, :, None]
            x_lo = tl.load(x_rows + blk * 256 + x_cols[None, :], mask=m_mask[:, None], other=0.0)
            x_hi = tl.load(x_rows + blk * 256 + 32 + x_cols[None, :], mask=m_mask[:, None],
                           other=0.0)
            w_lo = tl.reshape(w_lo, (BLOCK_N, 128)).to(x_lo.dtype)
            w_hi = tl.reshape(w_hi, (BLOCK_N, 128)).to(x_lo.dtype)
            acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision=DOT_PRECISION)
            acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision=DOT_PRECISION)
        _store_tile(out_ptr, acc, offs_m, offs_n, m_mask, n_mask, stride_om, ATOMIC)

    @triton.jit
    def _q6k_mm_kernel(x_ptr, w_ptr, out_ptr, M, N, stride_xm, stride_om, row_bytes,
                       num_blocks, blocks_per_split,
                       DOT_PRECISION: tl.constexpr, ATOMIC: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # Per super-block: ql as 8 runs of 16 (g = 4c + 2h + u, bytes 16g..16g+15, as in
        # the GEMV kernel), each run's qh bytes at 128 + 32c + 16u.
        pid_mn = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_n = tl.cdiv(N, BLOCK_N)
        offs_m = (pid_mn // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (pid_mn % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        g = tl.arange(0, 8)
        c = g // 4
        h = (g // 2) % 2
        u = g % 2
        t = tl.arange(0, 16)
        kk = tl.arange(0, 128)
        gk = kk // 16
        x_cols = (gk // 4) * 128 + ((gk // 2) % 2) * 32 + (gk % 2) * 16 + kk % 16
        row = offs_n.to(tl.int64) * row_bytes
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        b_start = pid_k * blocks_per_split
        b_end = tl.minimum(b_start + blocks_per_split, num_blocks)
        for blk in range(b_start, b_end):
            nb = (w_ptr + row + blk * 210)[:, None]
            mask = n_mask[:, None]
            mask3 = mask[:, :, None]
            ql = tl.load(nb[:, :, None] + (g * 16)[None, :, None] + t[None, None, :],
                         mask=mask3, other=0).to(tl.int32)
            qh = tl.load(nb[:, :, None] + (128 + c * 32 + u * 16)[None, :, None]
                         + t[None, None, :], mask=mask3, other=0).to(tl.int32)
            shift = (2 * h)[None, :, None]
            q_lo = ((ql & 0xF) | (((qh >> shift) & 3) << 4)) - 32
            q_hi = ((ql >> 4) | (((qh >> (shift + 4)) & 3) << 4)) - 32
            d = load_f16(nb + 208, mask)
            s = nb + 192 + (c * 8 + h * 2 + u)[None, :]
            sc_lo = tl.load(s, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            sc_hi = tl.load(s + 4, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            w_lo = (d * sc_lo)[:, :, None] * q_lo.to(tl.float32)
            w_hi = (d * sc_hi)[:, :, None] * q_hi.to(tl.float32)
            x_lo = tl.load(x_rows + blk * 256 + x_cols[None, :], mask=m_mask[:, None], other=0.0)
            x_hi = tl.load(x_rows + blk * 256 + 64 + x_cols[None, :], mask=m_mask[:, None],
                           other=0.0)
            w_lo = tl.reshape(w_lo, (BLOCK_N, 128)).to(x_lo.dtype)
            w_hi = tl.reshape(w_hi, (BLOCK_N, 128)).to(x_lo.dtype)
            acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision=DOT_PRECISION)
            acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision=DOT_PRECISION)
        _store_tile(out_ptr, acc, offs_m, offs_n, m_mask, n_mask, stride_om, ATOMIC)

    @triton.jit
    def _store_tile(out_ptr, acc, offs_m, offs_n, m_mask, n_mask, stride_om,
                    ATOMIC: tl.constexpr):
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        store_row(out_ptrs, acc, m_mask[:, None] & n_mask[None, :], ATOMIC)


def _check(x: torch.Tensor, raw: torch.Tensor, qtype: int) -> None:
    if not HAS_TRITON:
        raise ValueError("the GGUF K-quant kernels need Triton")
    if qtype not in KQUANT_TYPES:
        raise ValueError(f"the GGUF K-quant kernels read Q4_K, Q5_K and Q6_K, not type {qtype}")
    k = x.shape[1]
    row_bytes = raw.shape[1]
    if k % 256 or row_bytes != k // 256 * block_info(qtype)[2]:
        raise ValueError(f"GGUF K-quant product: K={k} does not match rows of {row_bytes} bytes")


def gemv_config(m: int, n: int, k: int, num_sms: int, qtype: int = Q4_K) -> dict[str, int]:
    """Rows per program, super-blocks per iteration, warps and the K split.

    Q4_K (and Q5_K, whose runs are read the same way): four rows and eight super-blocks
    (2,048 weights of a row) per iteration, two warps; Q6_K: eight rows, four super-blocks,
    four warps; K split until there are about two programs per SM. The fastest of a sweep
    over 4-16 rows, 2-8 super-blocks, 2-4 warps and 1-4 programs per SM at Llama-3.1-8B's
    shapes on an H100 (1.0-1.4 TB/s of blocks; gguf_kernel_bench.py).
    """
    block_n, sb, warps = (8, 4, 4) if qtype == Q6_K else (4, 8, 2)
    num_blocks = k // 256
    programs = cdiv(n, block_n) * m
    split = max(1, min(cdiv(2 * num_sms, programs), cdiv(num_blocks, sb)))
    return dict(BLOCK_N=block_n, SB=sb, SPLIT_K=split, num_warps=warps)


def gguf_gemv(x: torch.Tensor, raw: torch.Tensor, qtype: int,
              config: dict[str, int] | None = None, num_sms: int = 132) -> torch.Tensor:
    """``x @ W^T`` for ``W`` in Q4_K, Q5_K or Q6_K blocks.

    Args:
        x: ``[M, K]`` float16/bfloat16/float32, ``K`` a multiple of 256.
        raw: ``[N, row_bytes]`` uint8, ``K / 256`` super-blocks per row
            (``gguf_blocks.block_info``).
        qtype: 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K).
        config: ``gemv_config``'s keys; chosen by ``gemv_config`` if None.
        num_sms: the device's streaming multiprocessors (sizes the K split).

    Returns:
        ``[M, N]`` in ``x``'s dtype.

    Raises:
        ValueError: Triton missing, another block type, or ``raw`` not ``K``'s row size.
    """
    m, k = x.shape
    _check(x, raw, qtype)
    n, row_bytes = raw.shape
    x = x.contiguous()
    cfg = config or gemv_config(m, n, k, num_sms, qtype)
    num_blocks = k // 256
    per_split = cdiv(cdiv(num_blocks, cfg["SPLIT_K"]), cfg["SB"]) * cfg["SB"]
    split = cdiv(num_blocks, per_split)
    atomic = split > 1
    out = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if atomic
           else torch.empty(m, n, dtype=x.dtype, device=x.device))
    # The rows of x vary fastest, so the programs that read one weight tile run together and
    # all but the first find it in L2.
    grid = (m, cdiv(n, cfg["BLOCK_N"]), split)
    args = (x, raw, out, n, x.stride(0), out.stride(0), row_bytes, num_blocks, per_split)
    tiles = dict(ATOMIC=atomic, BLOCK_N=cfg["BLOCK_N"], SB=cfg["SB"], num_warps=cfg["num_warps"])
    if qtype == Q6_K:
        _q6k_gemv_kernel[grid](*args, **tiles)
    else:
        _q4k_gemv_kernel[grid](*args, **tiles, FIVE=qtype == Q5_K)
    return out.to(x.dtype) if atomic else out


def mm_config(m: int, n: int, k: int, dtype: torch.dtype, num_sms: int,
              qtype: int = Q4_K) -> dict[str, int]:
    """Tiles of the tensor-core kernel: 16 to 64 rows of ``x``; with 16, 128 rows of ``W``
    for Q4_K and 32 for Q6_K in three pipeline stages (the fastest of a sweep over 32-128
    rows, 4-8 warps and 1-3 stages at 16 rows of Llama-3.1-8B's shapes on an H100: 0.63-0.92
    of the time of 64 rows in two stages, which larger row tiles keep); the K split fills
    two waves of ``num_sms``. float32 (the interpreter) keeps tiles small."""
    if dtype == torch.float32:
        return dict(BLOCK_M=16, BLOCK_N=16, SPLIT_K=1, num_warps=4, num_stages=1)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n, stages = ((32 if qtype == Q6_K else 128), 3) if block_m == 16 else (64, 2)
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    split = max(1, min(cdiv(2 * num_sms, tiles), k // 256))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split, num_warps=4,
                num_stages=stages)


def kquant_mm(x: torch.Tensor, raw: torch.Tensor, qtype: int,
              config: dict[str, int] | None = None, num_sms: int = 132) -> torch.Tensor:
    """``x @ W^T`` for ``W`` in Q4_K, Q5_K or Q6_K blocks by the tensor-core tile kernel.

    Arguments, result and errors as ``gguf_gemv``; ``config``: ``mm_config``'s keys.
    """
    m, k = x.shape
    _check(x, raw, qtype)
    x = x.contiguous()
    n, row_bytes = raw.shape
    cfg = config or mm_config(m, n, k, x.dtype, num_sms, qtype)
    num_blocks = k // 256
    per_split = cdiv(num_blocks, cfg["SPLIT_K"])
    split = cdiv(num_blocks, per_split)
    atomic = split > 1
    out = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if atomic
           else torch.empty(m, n, dtype=x.dtype, device=x.device))
    grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]), split)
    args = (x, raw, out, m, n, x.stride(0), out.stride(0), row_bytes, num_blocks, per_split)
    tiles = dict(DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", ATOMIC=atomic,
                 BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
                 num_stages=cfg["num_stages"])
    if qtype == Q6_K:
        _q6k_mm_kernel[grid](*args, **tiles)
    else:
        _q4k_mm_kernel[grid](*args, **tiles, FIVE=qtype == Q5_K)
    return out.to(x.dtype) if atomic else out

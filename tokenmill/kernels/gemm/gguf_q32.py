"""GEMV for llama.cpp's 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): ``y = x @ W^T`` for
one row of ``x``.

``W [N, row_bytes]`` uint8 holds ``K / 32`` blocks per row (ggml-common.h): an fp16 scale
``d`` (and for the ``_1`` types an fp16 offset ``m``), for the 5-bit types 4 bytes ``qh``
of fifth bits (bit ``j`` for weight ``j``), then the quants: 16 bytes of nibbles (weight
``t`` in the low nibble of byte ``t``, weight ``16 + t`` in its high nibble) or, for Q8_0,
32 int8. Per block ``sum_j w_j x_j = d * sum_j q_j x_j + o * sum_j x_j`` with ``o = m`` for
the ``_1`` types and ``o = -8 d`` / ``-16 d`` for Q4_0 / Q5_0 (``w = d (q - 8)``), so the
scale and offset apply once per block, as in llama.cpp's ``vec_dot_q4_0_q8_0`` and kin.

A program takes ``BLOCK_N`` rows of ``W`` over a range of blocks (``NB`` per iteration,
split-K with float32 atomics), reading each row's quants as runs of 16 or 32 bytes.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.device import HAS_TRITON
from tokenmill.kernels.quant.gguf_blocks import block_info
from tokenmill.math_utils import cdiv

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
# Where each type's quants start in its block (after d [, m] [, qh]).
QS_OFFSET = {Q4_0: 2, Q4_1: 4, Q5_0: 6, Q5_1: 8, Q8_0: 2}
Q32_TYPES = tuple(QS_OFFSET)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from tokenmill.kernels.gemm.gguf_bytes import load_f16, store_row

    @triton.jit
    def _q32_gemv_kernel(x_ptr, w_ptr, out_ptr, N, stride_om, row_bytes, num_blocks,
                         blocks_per_split,
                         QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, QS: tl.constexpr,
                         ATOMIC: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        b = tl.arange(0, NB)
        row = offs_n.to(tl.int64) * row_bytes
        acc = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        b_start = pid_k * blocks_per_split
        b_end = tl.minimum(b_start + blocks_per_split, num_blocks)
        for b0 in range(b_start, b_end, NB):
            blk = b0 + b
            b_mask = blk < b_end
            mask = n_mask[:, None] & b_mask[None, :]
            mask3 = mask[:, :, None]
            base = w_ptr + row[:, None] + (blk * BLOCK_BYTES)[None, :]  # [BLOCK_N, NB]
            if QTYPE == 8:  # Q8_0: 32 int8
                t = tl.arange(0, 32)
                q = tl.load(base[:, :, None] + QS + t[None, None, :], mask=mask3,
                            other=0).to(tl.int8, bitcast=True).to(tl.float32)
                xv = tl.load(x_ptr + blk[:, None] * 32 + t[None, :], mask=b_mask[:, None],
                             other=0.0).to(tl.float32)
                acc += load_f16(base, mask) * tl.sum(q * xv[None, :, :], axis=2)
            else:
                t = tl.arange(0, 16)
                qs = tl.load(base[:, :, None] + QS + t[None, None, :], mask=mask3,
                             other=0).to(tl.int32)
                q_lo = qs & 0xF
                q_hi = qs >> 4
                if QTYPE == 6 or QTYPE == 7:  # fifth bits: qh bit t, and bit 16 + t
                    QH: tl.constexpr = 2 if QTYPE == 6 else 4
                    byte = (t // 8)[None, None, :]
                    bit = (t % 8)[None, None, :]
                    h_lo = tl.load(base[:, :, None] + QH + byte, mask=mask3, other=0)
                    h_hi = tl.load(base[:, :, None] + QH + 2 + byte, mask=mask3, other=0)
                    q_lo = q_lo | (((h_lo.to(tl.int32) >> bit) & 1) << 4)
                    q_hi = q_hi | (((h_hi.to(tl.int32) >> bit) & 1) << 4)
                x_lo = tl.load(x_ptr + blk[:, None] * 32 + t[None, :], mask=b_mask[:, None],
                               other=0.0).to(tl.float32)
                x_hi = tl.load(x_ptr + blk[:, None] * 32 + 16 + t[None, :],
                               mask=b_mask[:, None], other=0.0).to(tl.float32)
                qx = tl.sum(q_lo.to(tl.float32) * x_lo[None, :, :], axis=2) \
                    + tl.sum(q_hi.to(tl.float32) * x_hi[None, :, :], axis=2)
                xs = (tl.sum(x_lo, axis=1) + tl.sum(x_hi, axis=1))[None, :]
                d = load_f16(base, mask)
                if QTYPE == 3 or QTYPE == 7:  # w = d q + m
                    acc += d * qx + load_f16(base + 2, mask) * xs
                else:  # w = d (q - 8) / d (q - 16)
                    OFFSET: tl.constexpr = 8.0 if QTYPE == 2 else 16.0
                    acc += d * (qx - OFFSET * xs)
        store_row(out_ptr + offs_n, tl.sum(acc, axis=1), n_mask, ATOMIC)


def q32_gemv_config(n: int, k: int, num_sms: int) -> dict[str, int]:
    """Four rows and sixteen blocks (512 weights of a row) per program and iteration, two
    warps, K split until there are about two programs per SM: the shape of the fastest
    Q4_K GEMV tiles (``gguf_kquant.gemv_config``), not yet swept for these types."""
    block_n, nb = 4, 16
    split = max(1, min(cdiv(2 * num_sms, cdiv(n, block_n)), cdiv(k // 32, nb)))
    return dict(BLOCK_N=block_n, NB=nb, SPLIT_K=split, num_warps=2)


def q32_gemv(x: torch.Tensor, raw: torch.Tensor, qtype: int,
             config: dict[str, int] | None = None, num_sms: int = 132) -> torch.Tensor:
    """``x @ W^T`` for one row ``x`` and ``W`` in Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks.

    Args:
        x: ``[1, K]`` float16/bfloat16/float32, ``K`` a multiple of 32.
        raw: ``[N, row_bytes]`` uint8, ``K / 32`` blocks per row (``gguf_blocks.block_info``).
        qtype: a GGML type id of ``Q32_TYPES``.
        config: ``q32_gemv_config``'s keys; chosen by it if None.
        num_sms: the device's streaming multiprocessors (sizes the K split).

    Returns:
        ``[1, N]`` in ``x``'s dtype.

    Raises:
        ValueError: Triton missing, another block type, more than one row, or ``raw`` not
            ``K``'s row size.
    """
    if not HAS_TRITON:
        raise ValueError("the GGUF GEMV kernel needs Triton")
    if qtype not in QS_OFFSET:
        raise ValueError(f"the 32-weight-block GEMV reads Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, not type "
                         f"{qtype}")
    m, k = x.shape
    n, row_bytes = raw.shape
    if m != 1:
        raise ValueError(f"the 32-weight-block GEMV takes one row of x, got {m}")
    block_bytes = block_info(qtype)[2]
    if k % 32 or row_bytes != k // 32 * block_bytes:
        raise ValueError(f"GGUF GEMV: K={k} does not match rows of {row_bytes} bytes")
    x = x.contiguous()
    cfg = config or q32_gemv_config(n, k, num_sms)
    num_blocks = k // 32
    per_split = cdiv(cdiv(num_blocks, cfg["SPLIT_K"]), cfg["NB"]) * cfg["NB"]
    split = cdiv(num_blocks, per_split)
    atomic = split > 1
    out = (torch.zeros(1, n, dtype=torch.float32, device=x.device) if atomic
           else torch.empty(1, n, dtype=x.dtype, device=x.device))
    grid = (cdiv(n, cfg["BLOCK_N"]), split)
    _q32_gemv_kernel[grid](x, raw, out, n, out.stride(0), row_bytes, num_blocks, per_split,
                           QTYPE=qtype, BLOCK_BYTES=block_bytes, QS=QS_OFFSET[qtype],
                           ATOMIC=atomic, BLOCK_N=cfg["BLOCK_N"], NB=cfg["NB"],
                           num_warps=cfg["num_warps"])
    return out.to(x.dtype) if atomic else out

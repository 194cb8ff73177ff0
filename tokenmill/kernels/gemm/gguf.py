"""GGUF dequantize-in-GEMM in Triton: ``y = x @ W^T`` reading ``W`` as llama.cpp's blocks.

``W [N, K]`` stays as the file stores it: ``[N, row_bytes]`` uint8, each row ``K / QK``
blocks (``tokenmill.kernels.quant.gguf_blocks``). A program computes a ``[BLOCK_M,
BLOCK_N]`` output tile; for each ``[BLOCK_K, BLOCK_N]`` weight tile it reads, per weight,
the bytes its block type keeps it in (quant bits, the block's fp16 scale(s), the K-quants'
6-bit sub-block scales), forms ``scale * q (+ offset)`` in float32 with the same
arithmetic as ``gguf_blocks.unpack_blocks`` and feeds ``tl.dot``. Block layouts: ggml's
``block_q4_0 ... block_q6_K`` (ggml-common.h). Launch shapes as ``tokenmill.kernels.gemm.int4``
(split-K 16-row tiles for decode, 64 x 128 tiles for prefill). Q4_K, Q5_K and Q6_K (the bulk
of Q4_K_M and Q5_K_M files) take the kernels of ``tokenmill.kernels.gemm.gguf_kquant``
instead, which read each row's quant bytes as contiguous runs; from ``DEQUANT_MIN_M`` rows
every type is dequantized once (``gguf_dequantize``) and the product left to cuBLAS, as the
int4 path does (each tile of an in-loop kernel would decode the blocks again).
"""

from __future__ import annotations

import torch

from tokenmill.kernels.device import num_sms
from tokenmill.kernels.gemm.gguf_kquant import GEMV_MAX_M, KQUANT_TYPES, gguf_gemv, kquant_mm
from tokenmill.kernels.gemm.int4 import DECODE_MAX_M, DEQUANT_MIN_M
from tokenmill.kernels.quant.gguf_blocks import block_info
from tokenmill.math_utils import cdiv

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False


if HAS_TRITON:

    @triton.jit
    def _u8(ptr, mask):
        return tl.load(ptr, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _f16(ptr, mask):
        lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _dequant_tile(w_ptr, offs_k, offs_n, row_bytes, mask,
                      QTYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr):
        """``W^T[k, n]`` for a ``[BLOCK_K, BLOCK_N]`` tile, float32."""
        j = offs_k[:, None] % QK
        base = w_ptr + offs_n[None, :].to(tl.int64) * row_bytes \
            + (offs_k[:, None] // QK).to(tl.int64) * TYPE_SIZE
        if QTYPE == 8:  # Q8_0: d, 32 x int8
            q = tl.load(base + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True)
            w = q.to(tl.float32) * _f16(base, mask)
        elif QTYPE == 2 or QTYPE == 3 or QTYPE == 6 or QTYPE == 7:  # Q4_0, Q4_1, Q5_0, Q5_1
            QS: tl.constexpr = 2 if QTYPE == 2 else (4 if QTYPE == 3 else (6 if QTYPE == 6 else 8))
            byte = _u8(base + QS + j % 16, mask)
            q = tl.where(j < 16, byte & 0xF, byte >> 4)
            if QTYPE == 6 or QTYPE == 7:  # fifth bit from qh (4 bytes after d [, m])
                QH: tl.constexpr = 2 if QTYPE == 6 else 4
                q = q | (((_u8(base + QH + j // 8, mask) >> (j % 8)) & 1) << 4)
            d = _f16(base, mask)
            if QTYPE == 2:
                w = d * (q - 8).to(tl.float32)
            elif QTYPE == 6:
                w = d * (q - 16).to(tl.float32)
            else:
                w = d * q.to(tl.float32) + _f16(base + 2, mask)
        elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: d, dmin, 12 scale bytes, [qh,] qs
            sb = j // 32
            lo4 = sb < 4
            s_a = _u8(base + 4 + sb, mask & lo4)  # scales[sb] (sb < 4)
            s_b = _u8(base + 4 + sb + 4, mask)  # scales[sb + 4]
            s_c = _u8(base + 4 + sb - 4, mask & (sb >= 4))  # scales[sb - 4]
            sc = tl.where(lo4, s_a & 63, (s_b & 0xF) | ((s_c >> 6) << 4))
            mn = tl.where(lo4, s_b & 63, (s_b >> 4) | ((_u8(base + 4 + sb, mask) >> 6) << 4))
            QS: tl.constexpr = 16 if QTYPE == 12 else 48
            byte = _u8(base + QS + (j // 64) * 32 + j % 32, mask)
            q = tl.where((j % 64) < 32, byte & 0xF, byte >> 4)
            if QTYPE == 13:
                q = q | (((_u8(base + 16 + j % 32, mask) >> (j // 32)) & 1) << 4)
            scale = _f16(base, mask) * sc.to(tl.float32)
            offset = _f16(base + 2, mask) * mn.to(tl.float32)
            w = scale * q.to(tl.float32) - offset
        elif QTYPE == 14:  # Q6_K: ql[128], qh[64], int8 scales[16], d
            c = j // 128
            r = j % 128
            low = _u8(base + c * 64 + r % 64, mask)
            low = tl.where(r < 64, low & 0xF, low >> 4)
            high = (_u8(base + 128 + c * 32 + r % 32, mask) >> (2 * (r // 32))) & 3
            q = (low | (high << 4)) - 32
            sc = tl.load(base + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
            w = (_f16(base + 208, mask) * sc.to(tl.float32)) * q.to(tl.float32)
        elif QTYPE == 10:  # Q2_K: scales[16], qs[64], d, dmin
            c = j // 128
            r = j % 128
            q = (_u8(base + 16 + c * 32 + r % 32, mask) >> (2 * (r // 32))) & 3
            sc = _u8(base + j // 16, mask)
            dl = _f16(base + 80, mask) * (sc & 0xF).to(tl.float32)
            ml = _f16(base + 82, mask) * (sc >> 4).to(tl.float32)
            w = dl * q.to(tl.float32) - ml
        else:  # Q3_K (11): hmask[32], qs[64], scales[12], d
            c = j // 128
            r = j % 128
            ql = (_u8(base + 32 + c * 32 + r % 32, mask) >> (2 * (r // 32))) & 3
            hbit = (_u8(base + j % 32, mask) >> (j // 32)) & 1
            q = ql - 4 * (1 - hbit)
            g = j // 16
            low = (_u8(base + 96 + g % 8, mask) >> (4 * (g // 8))) & 0xF
            high = (_u8(base + 104 + g % 4, mask) >> (2 * (g // 4))) & 3
            sc = (low | (high << 4)) - 32
            w = (_f16(base + 108, mask) * sc.to(tl.float32)) * q.to(tl.float32)
        return w

    @triton.jit
    def _gguf_gemm_kernel(
        x_ptr, w_ptr, out_ptr,
        M, N, K, row_bytes, stride_xm, stride_om, k_per_split,
        QTYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr,
        DOT_PRECISION: tl.constexpr, ATOMIC: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_mn = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_n = tl.cdiv(N, BLOCK_N)
        offs_m = (pid_mn // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = (pid_mn % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_end
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = _dequant_tile(w_ptr, offs_k, offs_n, row_bytes,
                              k_mask[:, None] & n_mask[None, :], QTYPE, QK, TYPE_SIZE)
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        if ATOMIC:
            tl.atomic_add(out_ptrs, acc, mask=mask)
        else:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gguf_dequant_kernel(w_ptr, out_ptr, N, K, row_bytes,
                             QTYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
        w = _dequant_tile(w_ptr, offs_k, offs_n, row_bytes, mask, QTYPE, QK, TYPE_SIZE)
        out = out_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask)


def gguf_dequantize(raw: torch.Tensor, qtype: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """``W [N, K]`` in ``dtype`` from ``[N, row_bytes]`` blocks, computed in float32 with
    ``gguf_blocks.unpack_blocks``' arithmetic and rounded once (one Triton pass).

    Raises:
        ValueError: Triton is not installed, or an unsupported type.
    """
    if not HAS_TRITON:
        raise ValueError("the GGUF dequantize kernel needs Triton")
    _name, qk, type_size, _group = block_info(qtype)
    n, row_bytes = raw.shape
    out = torch.empty(n, k, dtype=dtype, device=raw.device)
    grid = (cdiv(n, 32), cdiv(k, 64))
    _gguf_dequant_kernel[grid](raw, out, n, k, row_bytes, QTYPE=qtype, QK=qk,
                               TYPE_SIZE=type_size, BLOCK_N=32, BLOCK_K=64, num_warps=4)
    return out


def launch_config(m: int, n: int, k: int, dtype: torch.dtype, num_sms: int) -> dict[str, int]:
    """Tiles and K split (see ``tokenmill.kernels.gemm.int4.launch_config``)."""
    if dtype == torch.float32:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=1)
    if m <= DECODE_MAX_M:
        block_n, block_k = 64, 64
        tiles = cdiv(m, 16) * cdiv(n, block_n)
        split = max(1, min(cdiv(2 * num_sms, tiles), cdiv(k, block_k)))
        return dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
                    num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, SPLIT_K=1, num_warps=8, num_stages=3)


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, qtype: int,
                config: dict[str, int] | None = None) -> torch.Tensor:
    """``x @ W^T`` for ``W`` in GGUF blocks.

    Args:
        x: ``[M, K]`` float16/bfloat16 (float32 under the interpreter).
        raw: ``[N, row_bytes]`` uint8 blocks of type ``qtype``.
        qtype: a GGML block type id (Q4_0 ... Q6_K).
        config: tiles of this module's kernel (``launch_config`` keys), or ``{"DEQUANT":
            1}`` for ``gguf_dequantize`` and cuBLAS. None: from ``DEQUANT_MIN_M`` rows the
            latter; else Q4_K/Q5_K/Q6_K take ``gguf_gemv`` (up to ``GEMV_MAX_M`` rows) or
            ``kquant_mm``, other types this module's kernel with ``launch_config``.

    Returns:
        ``[M, N]`` in ``x``'s dtype.

    Raises:
        ValueError: Triton is not installed, or an unsupported type.
    """
    if not HAS_TRITON:
        raise ValueError("the GGUF GEMM kernel needs Triton")
    _name, qk, type_size, _group = block_info(qtype)
    m, k = x.shape
    n, row_bytes = raw.shape
    if (config is None and m >= DEQUANT_MIN_M and x.dtype != torch.float32) or (
            config is not None and config.get("DEQUANT")):
        return x @ gguf_dequantize(raw, qtype, k, x.dtype).t()
    if config is None and qtype in KQUANT_TYPES:
        sms = num_sms(x.device)
        if m <= GEMV_MAX_M:
            return gguf_gemv(x, raw, qtype, num_sms=sms)
        return kquant_mm(x, raw, qtype, num_sms=sms)
    x = x.contiguous()
    cfg = config or launch_config(m, n, k, x.dtype, num_sms(x.device))
    k_per_split = cdiv(cdiv(k, cfg["SPLIT_K"]), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split = cdiv(k, k_per_split)
    atomic = split > 1
    out = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if atomic
           else torch.empty(m, n, dtype=x.dtype, device=x.device))
    grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]), split)
    _gguf_gemm_kernel[grid](
        x, raw, out, m, n, k, row_bytes, x.stride(0), out.stride(0), k_per_split,
        QTYPE=qtype, QK=qk, TYPE_SIZE=type_size,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        ATOMIC=atomic,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out.to(x.dtype) if atomic else out

"""GGUF weights in the product ``y = x @ W^T``, ``W`` kept as llama.cpp's blocks.

``W [N, K]`` stays as the file stores it: ``[N, row_bytes]`` uint8, each row ``K / QK``
blocks (``tokenmill.kernels.quant.gguf_blocks``; layouts: ggml's ``block_q4_0 ...
block_q6_K``, ggml-common.h). ``gguf_linear`` picks the product by type and rows:

- the K-quants Q4_K, Q5_K and Q6_K (the bulk of Q4_K_M and Q5_K_M files): a GEMV for one
  row and a tensor-core kernel for decode batches (``gguf_kquant``), both reading each
  row's quant bytes as contiguous runs;
- the 32-weight blocks Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0: a GEMV for one row (``gguf_q32``);
- everything else, and every type from ``DEQUANT_MIN_M`` rows: ``W`` dequantized once by a
  Triton pass (``gguf_dequantize``, the arithmetic of ``gguf_blocks.unpack_blocks`` in
  float32, rounded once) and the product left to cuBLAS, as the int4 path does. (A kernel
  that dequantized tile by tile into ``tl.dot``, reading each weight's bytes across rows,
  took 4.9-9.7x this path's time at 256 rows of Llama-3.1-8B's products on an H100, and
  about as long at 1 and 16 rows as at 256, while the dequantization costs the same at
  any batch size.)
"""

from __future__ import annotations

import torch

from tokenmill.kernels.device import num_sms
from tokenmill.kernels.gemm.gguf_kquant import GEMV_MAX_M, KQUANT_TYPES, gguf_gemv, kquant_mm
from tokenmill.kernels.gemm.gguf_q32 import Q32_TYPES, q32_gemv
from tokenmill.kernels.gemm.int4 import DEQUANT_MIN_M
from tokenmill.kernels.quant.gguf_blocks import block_info
from tokenmill.math_utils import cdiv

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False


if HAS_TRITON:
    from tokenmill.kernels.gemm.gguf_bytes import load_f16, load_u8

    @triton.jit
    def _dequant_tile(w_ptr, offs_k, offs_n, row_bytes, mask,
                      QTYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr):
        """``W^T[k, n]`` for a ``[BLOCK_K, BLOCK_N]`` tile, float32."""
        j = offs_k[:, None] % QK
        base = w_ptr + offs_n[None, :].to(tl.int64) * row_bytes \
            + (offs_k[:, None] // QK).to(tl.int64) * TYPE_SIZE
        if QTYPE == 8:  # Q8_0: d, 32 x int8
            q = tl.load(base + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True)
            w = q.to(tl.float32) * load_f16(base, mask)
        elif QTYPE == 2 or QTYPE == 3 or QTYPE == 6 or QTYPE == 7:  # Q4_0, Q4_1, Q5_0, Q5_1
            QS: tl.constexpr = 2 if QTYPE == 2 else (4 if QTYPE == 3 else (6 if QTYPE == 6 else 8))
            byte = load_u8(base + QS + j % 16, mask)
            q = tl.where(j < 16, byte & 0xF, byte >> 4)
            if QTYPE == 6 or QTYPE == 7:  # fifth bit from qh (4 bytes after d [, m])
                QH: tl.constexpr = 2 if QTYPE == 6 else 4
                q = q | (((load_u8(base + QH + j // 8, mask) >> (j % 8)) & 1) << 4)
            d = load_f16(base, mask)
            if QTYPE == 2:
                w = d * (q - 8).to(tl.float32)
            elif QTYPE == 6:
                w = d * (q - 16).to(tl.float32)
            else:
                w = d * q.to(tl.float32) + load_f16(base + 2, mask)
        elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: d, dmin, 12 scale bytes, [qh,] qs
            sb = j // 32
            lo4 = sb < 4
            s_a = load_u8(base + 4 + sb, mask & lo4)  # scales[sb] (sb < 4)
            s_b = load_u8(base + 4 + sb + 4, mask)  # scales[sb + 4]
            s_c = load_u8(base + 4 + sb - 4, mask & (sb >= 4))  # scales[sb - 4]
            sc = tl.where(lo4, s_a & 63, (s_b & 0xF) | ((s_c >> 6) << 4))
            mn = tl.where(lo4, s_b & 63, (s_b >> 4) | ((load_u8(base + 4 + sb, mask) >> 6) << 4))
            QS: tl.constexpr = 16 if QTYPE == 12 else 48
            byte = load_u8(base + QS + (j // 64) * 32 + j % 32, mask)
            q = tl.where((j % 64) < 32, byte & 0xF, byte >> 4)
            if QTYPE == 13:
                q = q | (((load_u8(base + 16 + j % 32, mask) >> (j // 32)) & 1) << 4)
            scale = load_f16(base, mask) * sc.to(tl.float32)
            offset = load_f16(base + 2, mask) * mn.to(tl.float32)
            w = scale * q.to(tl.float32) - offset
        elif QTYPE == 14:  # Q6_K: ql[128], qh[64], int8 scales[16], d
            c = j // 128
            r = j % 128
            low = load_u8(base + c * 64 + r % 64, mask)
            low = tl.where(r < 64, low & 0xF, low >> 4)
            high = (load_u8(base + 128 + c * 32 + r % 32, mask) >> (2 * (r // 32))) & 3
            q = (low | (high << 4)) - 32
            sc = tl.load(base + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
            w = (load_f16(base + 208, mask) * sc.to(tl.float32)) * q.to(tl.float32)
        elif QTYPE == 10:  # Q2_K: scales[16], qs[64], d, dmin
            c = j // 128
            r = j % 128
            q = (load_u8(base + 16 + c * 32 + r % 32, mask) >> (2 * (r // 32))) & 3
            sc = load_u8(base + j // 16, mask)
            dl = load_f16(base + 80, mask) * (sc & 0xF).to(tl.float32)
            ml = load_f16(base + 82, mask) * (sc >> 4).to(tl.float32)
            w = dl * q.to(tl.float32) - ml
        else:  # Q3_K (11): hmask[32], qs[64], scales[12], d
            c = j // 128
            r = j % 128
            ql = (load_u8(base + 32 + c * 32 + r % 32, mask) >> (2 * (r // 32))) & 3
            hbit = (load_u8(base + j % 32, mask) >> (j // 32)) & 1
            q = ql - 4 * (1 - hbit)
            g = j // 16
            low = (load_u8(base + 96 + g % 8, mask) >> (4 * (g // 8))) & 0xF
            high = (load_u8(base + 104 + g % 4, mask) >> (2 * (g // 4))) & 3
            sc = (low | (high << 4)) - 32
            w = (load_f16(base + 108, mask) * sc.to(tl.float32)) * q.to(tl.float32)
        return w

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


def gguf_linear(x: torch.Tensor, raw: torch.Tensor, qtype: int,
                dequantize_first: bool = False) -> torch.Tensor:
    """``x @ W^T`` for ``W`` in GGUF blocks.

    One row of Q4_K/Q5_K/Q6_K takes ``gguf_kquant.gguf_gemv`` and up to ``DEQUANT_MIN_M``
    rows ``gguf_kquant.kquant_mm``; one row of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 takes
    ``gguf_q32.q32_gemv``; everything else (and ``dequantize_first``) dequantizes ``W`` once
    (``gguf_dequantize``) and multiplies with torch (cuBLAS).

    Args:
        x: ``[M, K]`` float16/bfloat16 (float32 under the interpreter).
        raw: ``[N, row_bytes]`` uint8 blocks of type ``qtype``.
        qtype: a GGML block type id (Q4_0 ... Q6_K).
        dequantize_first: take the last path whatever the shape.

    Returns:
        ``[M, N]`` in ``x``'s dtype.

    Raises:
        ValueError: Triton is not installed, or an unsupported type.
    """
    if not HAS_TRITON:
        raise ValueError("the GGUF kernels need Triton")
    m, k = x.shape
    if not dequantize_first:
        if qtype in KQUANT_TYPES and m < DEQUANT_MIN_M:
            sms = num_sms(x.device)
            if m <= GEMV_MAX_M:
                return gguf_gemv(x, raw, qtype, num_sms=sms)
            return kquant_mm(x, raw, qtype, num_sms=sms)
        if qtype in Q32_TYPES and m == 1:
            return q32_gemv(x, raw, qtype, num_sms=num_sms(x.device))
    return x @ gguf_dequantize(raw, qtype, k, x.dtype).t()

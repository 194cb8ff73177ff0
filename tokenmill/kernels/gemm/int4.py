"""Group-quantized int4 GEMM in Triton: ``y = x @ W^T`` with ``W`` dequantized in registers.

Weights in the layout of ``tokenmill.kernels.quant.int4_pack.pack_k``: ``qweight [K/8, N]``
int32 (eight 4-bit values along K per word, value ``j`` in bits ``4j..4j+3``), ``scales
[K/G, N]`` in the activations' dtype and ``zeros [K/G, N]`` uint8, ``W^T[k, n] = (q[k, n] -
zeros[k // G, n]) * scales[k // G, n]`` (the AWQ/GPTQ dequantization).

Each program computes a ``[BLOCK_M, BLOCK_N]`` output tile over a range of K: it loads the
packed words of its ``[BLOCK_K, BLOCK_N]`` weight tile (each word serves eight rows), shifts
and masks out the values, applies the group's scale and zero in float32 and feeds
``tl.dot``. Two launch shapes:

- decode (``M <= DECODE_MAX_M``): 16-row tiles and split-K, so that small batches still
  spread the weight reads over every SM (partial sums added with float32 atomics);
- prefill: 64 x 128 tiles, no split.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.device import num_sms
from tokenmill.math_utils import cdiv

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False

DECODE_MAX_M = 32


if HAS_TRITON:

    @triton.jit
    def _int4_gemm_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr,
        M, N, K, stride_xm, stride_om, k_per_split,
        GROUP: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        ATOMIC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_mn = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_n = tl.cdiv(N, BLOCK_N)
        pid_m = pid_mn // num_n
        pid_n = pid_mn % num_n
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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
            w_mask = k_mask[:, None] & n_mask[None, :]
            words = tl.load(qw_ptr + (offs_k // 8)[:, None].to(tl.int64) * N + offs_n[None, :],
                            mask=w_mask, other=0)
            q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
            g = (offs_k // GROUP)[:, None].to(tl.int64) * N + offs_n[None, :]
            s = tl.load(s_ptr + g, mask=w_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g, mask=w_mask, other=0).to(tl.float32)
            w = ((q.to(tl.float32) - z) * s).to(x.dtype)
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        if ATOMIC:
            tl.atomic_add(out_ptrs, acc, mask=mask)
        else:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def launch_config(m: int, n: int, k: int, dtype: torch.dtype, num_sms: int) -> dict[str, int]:
    """Tile sizes and the K split for an ``[m, k] x [k, n]`` product.

    float32 (the interpreter, CPU tests) keeps tiles small; small batches split K until
    the grid covers the SMs about twice.
    """
    if dtype == torch.float32:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=1)
    if m <= DECODE_MAX_M:
        block_n, block_k = 64, 128
        tiles = cdiv(m, 16) * cdiv(n, block_n)
        split = max(1, min(cdiv(2 * num_sms, tiles), cdiv(k, block_k)))
        return dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
                    num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, num_warps=8, num_stages=3)


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """``x @ W^T`` for int4 ``W`` (layout in the module docstring).

    Args:
        x: ``[M, K]`` float16/bfloat16 (float32 under the interpreter).
        qweight: ``[K/8, N]`` int32. scales: ``[K/G, N]``. zeros: ``[K/G, N]`` uint8.
        group: ``G``, input channels per group (a multiple of ``BLOCK_K`` or of 8 dividing it).
        config: tiles (``launch_config`` keys); chosen by ``launch_config`` if None.

    Returns:
        ``[M, N]`` in ``x``'s dtype.

    Raises:
        ValueError: Triton is not installed.
    """
    if not HAS_TRITON:
        raise ValueError("the int4 GEMM kernel needs Triton")
    m, k = x.shape
    n = qweight.shape[1]
    x = x.contiguous()
    cfg = config or launch_config(m, n, k, x.dtype, num_sms(x.device))
    split = cfg["SPLIT_K"]
    k_per_split = cdiv(cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split = cdiv(k, k_per_split)
    atomic = split > 1
    out = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if atomic
           else torch.empty(m, n, dtype=x.dtype, device=x.device))
    grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]), split)
    _int4_gemm_kernel[grid](
        x, qweight, scales, zeros, out,
        m, n, k, x.stride(0), out.stride(0), k_per_split,
        GROUP=group,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        ATOMIC=atomic,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out.to(x.dtype) if atomic else out

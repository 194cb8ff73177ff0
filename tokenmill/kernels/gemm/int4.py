"""Group-quantized int4 GEMM in Triton: ``y = x @ W^T`` with ``W`` dequantized in registers.

Weights in the layout of ``tokenmill.kernels.quant.int4_pack.pack_k``: ``qweight [K/8, N]``
int32 (eight 4-bit values along K per word, value ``j`` in bits ``4j..4j+3``), ``scales
[K/G, N]`` in the activations' dtype and ``zeros [K/G, N]`` uint8, ``W^T[k, n] = (q[k, n] -
zeros[k // G, n]) * scales[k // G, n]`` (the AWQ/GPTQ dequantization).

Each program computes a ``[BLOCK_M, BLOCK_N]`` output tile over a range of K: it loads the
packed words of its ``[BLOCK_K, BLOCK_N]`` weight tile (each word serves eight rows), shifts
and masks out the values, dequantizes each in float32 (one scale and zero row per tile where
the tile lies in one group) and feeds ``tl.dot``. Launch shapes:

- one row (``M <= GEMV_MAX_M``, batch-1 decode): a GEMV without
  tensor cores. Each program unpacks its ``[BLOCK_K, BLOCK_N]`` tile once for all rows and
  applies the group's scale and zero point once per group instead of per weight, by
  ``sum_k x_k (q_k - z) s = s (sum_k x_k q_k - z sum_k x_k)`` (the factoring of exllama's
  and Marlin's decode kernels); split-K spreads the weight reads over every SM;
- up to ``DEQUANT_MIN_M`` rows: the tensor-core kernel, tiles by row count (``TC_TILES``),
  K split where the output has few tiles (partial sums added with float32 atomics);
- from ``DEQUANT_MIN_M`` rows: the weight dequantized once (``int4_dequantize``) and the
  product left to cuBLAS.
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

# Two rows and more run faster on the tensor-core kernel (int4_kernel_bench.py, H100).
GEMV_MAX_M = 1
# From this many rows the weight is dequantized to x's dtype once and multiplied by cuBLAS:
# one pass over the weight costs less than the in-loop dequantization of a tensor-core
# kernel whose tiles each unpack it again (H100, Llama-3.1-8B's four products at 256 rows:
# 0.53-0.71 of the in-loop kernel's time; at 1,024 rows 0.35-0.39; int4_kernel_bench.py).
DEQUANT_MIN_M = 256


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
            if GROUP % BLOCK_K == 0:
                # The tile lies in one group: each packed word is loaded once and unpacked
                # into its eight rows, and one scale/zero row serves the whole tile.
                rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)
                words = tl.load(qw_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :],
                                mask=(rows * 8 < k_end)[:, None] & n_mask[None, :], other=0)
                q = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
                q = tl.reshape(q, (BLOCK_K, BLOCK_N))
                g = offs_n.to(tl.int64) + (k0 // GROUP) * N
                s = tl.load(s_ptr + g, mask=n_mask, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + g, mask=n_mask, other=0).to(tl.float32)
                w = ((q.to(tl.float32) - z[None, :]) * s[None, :]).to(x.dtype)
                acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
            else:
                w_mask = k_mask[:, None] & n_mask[None, :]
                words = tl.load(qw_ptr + (offs_k // 8)[:, None].to(tl.int64) * N
                                + offs_n[None, :], mask=w_mask, other=0)
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

    @triton.jit
    def _int4_gemv_kernel(
        x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr,
        M, N, K, stride_xm, stride_om, k_per_split,
        GROUP: tl.constexpr,
        ATOMIC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_KW: tl.constexpr,
    ):
        # BLOCK_KW packed words along K (8 * BLOCK_KW input channels) per iteration; the
        # launcher keeps 8 * BLOCK_KW a divisor of GROUP, so one scale/zero row per iteration.
        BLOCK_K: tl.constexpr = 8 * BLOCK_KW
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        shifts = tl.arange(0, 8) * 4
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            rows = k0 // 8 + tl.arange(0, BLOCK_KW)
            words = tl.load(qw_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :],
                            mask=(rows * 8 < k_end)[:, None] & n_mask[None, :], other=0)
            g = offs_n.to(tl.int64) + (k0 // GROUP) * N
            s = tl.load(s_ptr + g, mask=n_mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g, mask=n_mask, other=0).to(tl.float32)
            q = (words[:, None, :] >> shifts[None, :, None]) & 0xF
            q = tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & (offs_k < k_end)[None, :], other=0.0
                        ).to(tl.float32)
            xq = tl.sum(x[:, :, None] * q[None, :, :], axis=1)
            acc += s[None, :] * (xq - z[None, :] * tl.sum(x, axis=1)[:, None])
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        if ATOMIC:
            tl.atomic_add(out_ptrs, acc, mask=mask)
        else:
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def _int4_dequant_kernel(
        qw_ptr, s_ptr, z_ptr, w_ptr, N, K, stride_q, stride_w,
        GROUP: tl.constexpr, BLOCK_KW: tl.constexpr, BLOCK_N: tl.constexpr,
        STREAM: tl.constexpr,
    ):  # fmt: skip
        # W^T[k, n] = (q - z) * s over a [8 * BLOCK_KW, BLOCK_N] tile, rounded once to the
        # output dtype as the GEMM kernels round their weight tiles. ``STREAM``: the packed
        # words, scales and zeros are read once, so they are marked first to leave the L2
        # cache, which then keeps the written tile for the product that follows.
        BLOCK_K: tl.constexpr = 8 * BLOCK_KW
        policy: tl.constexpr = "evict_first" if STREAM else ""
        rows = tl.program_id(0) * BLOCK_KW + tl.arange(0, BLOCK_KW)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        words = tl.load(qw_ptr + rows[:, None].to(tl.int64) * stride_q + offs_n[None, :],
                        mask=(rows * 8 < K)[:, None] & n_mask[None, :], other=0,
                        eviction_policy=policy)
        q = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))
        offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (offs_k < K)[:, None] & n_mask[None, :]
        g = (offs_k // GROUP)[:, None].to(tl.int64) * stride_q + offs_n[None, :]
        s = tl.load(s_ptr + g, mask=mask, other=0.0, eviction_policy=policy).to(tl.float32)
        z = tl.load(z_ptr + g, mask=mask, other=0, eviction_policy=policy).to(tl.float32)
        w = (q.to(tl.float32) - z) * s
        tl.store(w_ptr + offs_k[:, None].to(tl.int64) * stride_w + offs_n[None, :],
                 w.to(w_ptr.dtype.element_ty), mask=mask)


# Tensor-core tiles by batch rows (up to the first bound): (BLOCK_M, BLOCK_N, widest K step,
# warps, stages) -- the fastest over Llama-3.1-8B's four products at 8, 32, 64 and 128 rows of
# an H100 sweep (int4_kernel_bench.py --tc-sweep).
TC_TILES = ((16, (16, 64, 128, 4, 3)), (32, (32, 64, 128, 4, 3)), (64, (64, 128, 128, 8, 3)),
            (DEQUANT_MIN_M, (128, 128, 64, 8, 3)))


def launch_config(
    m: int, n: int, k: int, dtype: torch.dtype, num_sms: int, group: int = 128
) -> dict[str, int]:
    """Tile sizes and the K split for an ``[m, k] x [k, n]`` product of ``group``-channel
    groups.

    float32 (the interpreter, CPU tests) keeps tiles small. 16-bit tiles come from
    ``TC_TILES`` by row count; K is split until the grid covers the SMs once, keeping at
    least four K steps per split (Llama-8B's down projection has 32 column tiles). The K step
    never exceeds a group (down to 32 channels), so each tile takes one scale and zero row.
    """
    if dtype == torch.float32:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, num_warps=4, num_stages=1)
    tile = next((t for bound, t in TC_TILES if m <= bound), TC_TILES[-1][1])
    block_m, block_n, widest, warps, stages = tile
    block_k = _k_step(widest, group)
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    split = max(1, min(cdiv(num_sms, tiles), cdiv(k, 4 * block_k)))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
                num_warps=warps, num_stages=stages)


def _k_step(widest: int, group: int) -> int:
    """The widest K step up to ``widest`` (a power of two, at least 32) dividing ``group``;
    ``widest`` for a group it cannot divide (per-element scales)."""
    step = widest
    while step > 32 and group % step:
        step //= 2
    return step if group % step == 0 else widest


def gemv_config(m: int, n: int, k: int, group: int, num_sms: int) -> dict[str, int] | None:
    """The GEMV kernel's tiles and K split for ``m <= GEMV_MAX_M`` rows, or None where its
    K step cannot divide ``group``.

    [128, 256] weight tiles (K x N), four warps and about four programs per SM (the fastest
    of a sweep over BLOCK_N 64-256, BLOCK_K 64-128, 4-8 warps and 2-4 programs per SM at
    Llama-3.1-8B's shapes on an H100, 0.92 of the time of 128-wide tiles:
    benchmarks/device/int4_kernel_bench.py --sweep). The K step halves for groups smaller
    than 128.
    """
    block_m, block_n, block_k = 1 << (m - 1).bit_length(), 256, 128
    while block_k > 32 and group % block_k:
        block_k //= 2
    if group % block_k:
        return None
    tiles = cdiv(n, block_n)
    split = max(1, min(cdiv(4 * num_sms, tiles), cdiv(k, block_k)))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KW=block_k // 8, SPLIT_K=split,
                num_warps=4, num_stages=3)


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """``W^T [K, N]`` in ``dtype``, ``(q - zeros) * scales`` (layout in the module docstring),
    computed in float32 and rounded once.

    Raises:
        ValueError: Triton is not installed.
    """
    if not HAS_TRITON:
        raise ValueError("the int4 dequantization kernel needs Triton")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty(k, n, dtype=dtype, device=qweight.device)
    _dequantize_into(qweight, scales, zeros, group, w, stream=False)
    return w


def _dequantize_into(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group: int, w: torch.Tensor, stream: bool) -> None:  # fmt: skip
    """Writes ``W^T`` of the (possibly column- or group-row-sliced) packed weight into ``w``
    ``[K, N]`` (row stride ``w.stride(0)``); the packed views share one row stride."""
    k, n = w.shape
    _int4_dequant_kernel[(cdiv(k, 32), cdiv(n, 128))](
        qweight, scales, zeros, w, n, k, qweight.stride(0), w.stride(0),
        GROUP=group, BLOCK_KW=4, BLOCK_N=128, STREAM=stream, num_warps=4,
    )  # fmt: skip


def _dequantize_mm_chunked(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                           zeros: torch.Tensor, group: int, chunk_n: int = 0,
                           chunk_k: int = 0) -> torch.Tensor:  # fmt: skip
    """``x @ W^T`` with ``W^T`` dequantized a slab at a time into one scratch buffer small
    enough to stay in the L2 cache for the cuBLAS product that reads it: ``chunk_n``
    output columns a slab (each product complete), or ``chunk_k`` input channels a slab
    (products accumulated in float32)."""
    m, k = x.shape
    n = qweight.shape[1]
    if chunk_n:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        scratch = torch.empty(k, min(chunk_n, n), dtype=x.dtype, device=x.device)
        for c0 in range(0, n, chunk_n):
            c1 = min(n, c0 + chunk_n)
            w = scratch[:, : c1 - c0]
            _dequantize_into(qweight[:, c0:c1], scales[:, c0:c1], zeros[:, c0:c1], group, w,
                             stream=True)
            torch.mm(x, w, out=out[:, c0:c1])
        return out
    acc = None
    scratch = torch.empty(min(chunk_k, k), n, dtype=x.dtype, device=x.device)
    for r0 in range(0, k, chunk_k):
        r1 = min(k, r0 + chunk_k)
        w = scratch[: r1 - r0]
        _dequantize_into(qweight[r0 // 8 : r1 // 8], scales[r0 // group : r1 // group],
                         zeros[r0 // group : r1 // group], group, w, stream=True)
        xs = x[:, r0:r1]
        if acc is None:
            acc = torch.mm(xs, w, out_dtype=torch.float32)
        else:
            torch.addmm(acc, xs, w, out_dtype=torch.float32, out=acc)
    return acc.to(x.dtype)


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
        config: tiles: ``gemv_config``'s keys for the GEMV kernel, ``launch_config``'s for
            the tensor-core one, ``{"DEQUANT": 1}`` for ``int4_dequantize`` and cuBLAS
            (with ``"CHUNK_N"`` or ``"CHUNK_K"`` a slab of that many output columns or
            input channels at a time through an L2-sized buffer; CUDA for ``CHUNK_K``);
            chosen if None: the GEMV for up to ``GEMV_MAX_M`` rows in float16/bfloat16, the
            dequantized weight from ``DEQUANT_MIN_M`` rows.

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
    cfg = config
    if cfg is None and m >= DEQUANT_MIN_M and x.dtype != torch.float32:
        cfg = {"DEQUANT": 1}
    if cfg is not None and cfg.get("DEQUANT"):
        if cfg.get("CHUNK_N") or cfg.get("CHUNK_K"):
            return _dequantize_mm_chunked(x, qweight, scales, zeros, group,
                                          cfg.get("CHUNK_N", 0), cfg.get("CHUNK_K", 0))
        return x @ int4_dequantize(qweight, scales, zeros, group, x.dtype)
    if cfg is None and m <= GEMV_MAX_M and x.dtype != torch.float32:
        cfg = gemv_config(m, n, k, group, num_sms(x.device))
    if cfg is None:
        cfg = launch_config(m, n, k, x.dtype, num_sms(x.device), group)
    gemv = "BLOCK_KW" in cfg
    block_k = 8 * cfg["BLOCK_KW"] if gemv else cfg["BLOCK_K"]
    split = cfg["SPLIT_K"]
    k_per_split = cdiv(cdiv(k, split), block_k) * block_k
    split = cdiv(k, k_per_split)
    atomic = split > 1
    out = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if atomic
           else torch.empty(m, n, dtype=x.dtype, device=x.device))
    if gemv:
        _int4_gemv_kernel[(cdiv(n, cfg["BLOCK_N"]), split)](
            x, qweight, scales, zeros, out,
            m, n, k, x.stride(0), out.stride(0), k_per_split,
            GROUP=group, ATOMIC=atomic,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_KW=cfg["BLOCK_KW"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        return out.to(x.dtype) if atomic else out
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

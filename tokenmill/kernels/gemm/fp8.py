"""Products with FP8 (float8_e4m3fn) weights on CUDA, and the activation quantization W8A8
needs. Decode-sized products of per-channel-scaled weights run on the skinny GEMM
(``kernels.gemm.skinny``, ``weight_scale``); this module has the rest:

- ``quantize_rows``: activations to FP8 with one scale per row (dynamic) or the
  checkpoint's static scale, in one launch.
- ``scaled_mm_rowwise``: W8A8 through ``torch._scaled_mm`` (cuBLASLt / CUTLASS on FP8
  tensor cores, sm_89+): activations quantized to FP8 with one scale per row, weights with
  one scale per output channel, fp32 accumulation, bf16 output. For prefill-sized batches,
  where the product is compute-bound and FP8 tensor cores double the bf16 rate.
- ``fp8_weight_gemm``: W8A16 in Triton: FP8 weight tiles converted to the activations'
  dtype in registers and multiplied on bf16/fp16 tensor cores, the weight scale applied
  per output channel after the K loop or, for 128x128 block scales (DeepSeek-V3,
  arXiv:2412.19437), to each K tile's partial product. The product of block-scaled weights
  at every batch size, of W8A16 checkpoints above the skinny GEMM's rows, and of shapes
  the skinny GEMM does not take.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.device import triton_can_run
from tokenmill.kernels.quant.fp8 import FP8_MAX, MIN_SCALE
from tokenmill.math_utils import cdiv, next_power_of_2

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False

# Rows of x up to which ``fp8_weight_gemm`` uses its small output tiles.
SKINNY_MAX_M = 16
# Elements of a row ``quantize_rows`` holds at once; longer rows take two passes.
QUANT_BLOCK = 8192


def scaled_mm_supported(device: torch.device) -> bool:
    """FP8 tensor cores: CUDA compute capability 8.9 (Ada) or 9.0+ (Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_mm_rowwise(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    wq: torch.Tensor,
    w_scale_row: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(xq * x_scale) @ (wq * w_scale)^T`` on FP8 tensor cores.

    Args:
        xq: ``[M, K]`` float8_e4m3fn, contiguous.
        x_scale: ``[M, 1]`` float32.
        wq: ``[N, K]`` float8_e4m3fn, contiguous (read as the column-major ``[K, N]``).
        w_scale_row: ``[1, N]`` float32.
        out_dtype: the result's dtype (computed in bf16, the dtype row-wise scaling
            writes, then cast).

    Returns:
        ``[M, N]`` of ``out_dtype``.
    """
    y = torch._scaled_mm(
        xq, wq.t(), scale_a=x_scale.contiguous(), scale_b=w_scale_row,
        out_dtype=torch.bfloat16,
    )  # fmt: skip
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)


def quantize_rows(x: torch.Tensor, static_scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 activations for ``scaled_mm_rowwise`` in one launch: ``x [M, K]`` (bf16/fp16,
    contiguous along K) -> ``(q [M, K] float8_e4m3fn, scale [M, 1] float32)``.

    Dynamic per token (``static_scale`` None): ``scale = max(amax(|x_row|) / 448, 1e-12)``;
    static: the checkpoint's ``[]`` scale for every row. Then ``q = clamp(x / scale, -448,
    448)`` rounded to nearest, the rule of ``kernels.quant.fp8.quantize_per_token`` and
    ``quantize_static``.

    Raises:
        ValueError: x not 2-D and contiguous along K, or not on CUDA (without
            ``TRITON_INTERPRET=1``).
    """
    if not HAS_TRITON or not triton_can_run(x):
        raise ValueError("quantize_rows runs on CUDA tensors (or under TRITON_INTERPRET=1)")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"expected x [M, K] contiguous along K, got {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = min(next_power_of_2(k), QUANT_BLOCK)
    if m:
        _quantize_rows_kernel[(m,)](
            x, q, scale, static_scale if static_scale is not None else scale, k, x.stride(0),
            STATIC=static_scale is not None, BLOCK=block, ONE_BLOCK=block >= k,
            FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
            num_warps=max(1, min(16, block // 512)),
        )  # fmt: skip
    return q, scale


def fp8_weight_gemm(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``y = x (wq * w_scale)^T (+ bias)`` with fp32 accumulation, one launch.

    Args:
        x: ``[M, K]`` bfloat16/float16 (float32 under the Triton interpreter), contiguous
            along K.
        wq: ``[N, K]`` float8_e4m3fn, contiguous.
        w_scale: ``[N]`` float32 per output channel, or with ``block = (bn, bk)``
            ``[ceil(N/bn), ceil(K/bk)]`` float32 per block.
        bias: ``[N]`` or None.
        block: the weight's scale blocks; ``bk`` must be a multiple of 16.

    Returns:
        ``[M, N]`` of x's dtype.

    Raises:
        ValueError: shapes, dtypes or devices the kernel cannot address.
    """
    if not HAS_TRITON or not triton_can_run(x):
        raise ValueError("fp8_weight_gemm runs on CUDA tensors (or under TRITON_INTERPRET=1)")
    (m, k), n = x.shape, wq.shape[0]
    if wq.dtype != torch.float8_e4m3fn or wq.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"expected x [M, K] contiguous along K and float8_e4m3fn weight "
                         f"[N, {k}], got {tuple(x.shape)} and {wq.dtype} {tuple(wq.shape)}")
    if not wq.is_contiguous():
        raise ValueError("the FP8 weight must be contiguous")
    bn, bk = block or (1, k)
    if block is not None and (bk % 16 or w_scale.shape != (cdiv(n, bn), cdiv(k, bk))):
        raise ValueError(f"block scales {tuple(w_scale.shape)} do not tile [{n}, {k}] by "
                         f"{block} (block_k a multiple of 16)")
    block_m = 16 if m <= 16 else 64
    block_n = 16 if m <= SKINNY_MAX_M else 128
    block_k = min(128 if block is None else bk, 128)
    while block is not None and bk % block_k:
        block_k //= 2
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    s = w_scale.float().contiguous()
    _fp8_weight_gemm_kernel[grid](
        x, wq, s, bias if bias is not None else y, y, m, n, k,
        x.stride(0), wq.stride(0), y.stride(0), s.stride(0) if block else 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SCALE_BN=bn, SCALE_BK=bk,
        BLOCKWISE=block is not None, HAS_BIAS=bias is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=4,
    )  # fmt: skip
    return y


if HAS_TRITON:

    @triton.jit
    def _fp8_weight_gemm_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
        stride_sn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, BLOCKWISE: tl.constexpr,
        HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One ``[BLOCK_M, BLOCK_N]`` output tile over all of K (see ``fp8_weight_gemm``)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < M
        n_ok = offs_n < N
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k + k0 < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0,
                        eviction_policy="evict_last")
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
            part = tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
            if BLOCKWISE:
                s = tl.load(s_ptr + (offs_n // SCALE_BN) * stride_sn + k0 // SCALE_BK,
                            mask=n_ok, other=0.0)
                acc += part * s[None, :]
            else:
                acc += part
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if not BLOCKWISE:
            acc *= tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr, q_ptr, scale_ptr, static_ptr, K, stride_x,
        STATIC: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr,
        FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
    ):  # fmt: skip
        """One row of ``quantize_rows``: its amax (unless ``STATIC``), then the FP8 values."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        x_row = x_ptr + row * stride_x
        if STATIC:
            s = tl.load(static_ptr).to(tl.float32)
        else:
            if ONE_BLOCK:
                v = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
                amax = tl.max(tl.abs(v), axis=0)
            else:
                amax = 0.0
                for k0 in range(0, K, BLOCK):
                    v = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0)
                    amax = tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32)), axis=0))
            s = tl.maximum(amax / FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, s)
        for k0 in range(0, K, BLOCK):
            ok = k0 + cols < K
            v = tl.load(x_row + k0 + cols, mask=ok, other=0.0).to(tl.float32)
            qv = tl.clamp(tl.div_rn(v, s), -FP8_MAX, FP8_MAX)
            tl.store(q_ptr + row * K + k0 + cols, qv.to(q_ptr.dtype.element_ty), mask=ok)

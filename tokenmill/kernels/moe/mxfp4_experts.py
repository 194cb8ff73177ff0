"""The grouped MoE GEMM over MXFP4 expert weights (gpt-oss), with the weights as the left
operand.

``fused_moe.py`` sorts the (token, expert) assignments by expert and pads each expert's group
to the row-tile height; this kernel computes one output tile of ``C[slot] = A[row] @ W[e]^T``
as its transpose, ``W[e] tile [BLOCK_N, K] @ A^T [K, BLOCK_M]``: the weight tile, the operand
to decode, is the left one, and the few token rows an expert gets in a decode step fill the
narrow side of the product (down to 16). Each K tile of packed bytes is decoded once per
output tile, by Triton's scaled dot on CUDA (``tl.dot_scaled`` with an ``e2m1`` operand and
its E8M0 scales, which Triton lowers for the GPU it compiles for) or bit by bit
(``mxfp4.mxfp4_rows``) under the interpreter, which has no scaled dot.

Weights: ``w`` uint8 ``[E, rows, K / 2]`` with E8M0 scales ``[E, rows, K / 32]`` (``mxfp4.py``
for the format). With ``GATED`` the tile computes the gate rows ``n`` and the up rows
``N + n`` and stores the activation; otherwise it scales each row by its routing weight.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.device import HAS_TRITON
from tokenmill.kernels.moe.tiles import GatedActivation
from tokenmill.math_utils import cdiv

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tokenmill.kernels.moe.mxfp4 import mxfp4_rows
    from tokenmill.kernels.moe.tiles import gated_tile, grouped_tile_ids

# The activation dtypes ``tl.dot_scaled`` takes as its plain operand, by name.
_SCALED_DOT_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def mxfp4_tile_config(num_slots: int, num_experts: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes of the MXFP4 expert GEMM, from the average rows per expert: ``BLOCK_N``
    weight rows by ``BLOCK_M`` token rows by ``BLOCK_K`` reduction values per tile.

    Measured on an H100 at gpt-oss-20b's experts (``benchmarks/moe_bench.py --mxfp4
    --sweep-tiles``): 16 x 64 tiles up to 16 rows per expert, 32 x 128 up to 64, then
    128 x 128 with 64-wide K tiles and 8 warps (2.26 ms at 1,024 tokens, against 3.26 with
    128-wide K tiles). float32 (the interpreter) keeps tiles small.
    """
    if dtype == torch.float32:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=2)
    rows_per_expert = num_slots / max(1, num_experts)
    if rows_per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    if rows_per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)


if HAS_TRITON:

    @triton.jit
    def _mxfp4_dot(packed, scale, a, acc, SCALED_DOT: tl.constexpr, A_FORMAT: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):  # fmt: skip
        """``acc + decode(packed, scale) @ a``: packed ``[R, BLOCK_K / 2]``, scale
        ``[R, BLOCK_K / 32]``, a ``[BLOCK_K, C]``; by the scaled dot (``A_FORMAT`` names
        ``a``'s dtype) or decoded bit by bit."""
        if SCALED_DOT:
            return tl.dot_scaled(packed, scale, "e2m1", a, None, A_FORMAT, acc)
        w = mxfp4_rows(packed, scale, a.dtype)
        return tl.dot(w, a, acc, input_precision=DOT_PRECISION)

    @triton.jit
    def _moe_mxfp4_kernel(
        a_ptr, w_ptr, scale_ptr, c_ptr, weights_ptr, sorted_slots_ptr, block_experts_ptr,
        num_padded_ptr, bias_ptr, N, K, num_slots, max_padded,
        stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm, stride_bias,
        alpha, limit,
        A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
        HAS_BIAS: tl.constexpr, SWIGLUOAI: tl.constexpr, SCALED_DOT: tl.constexpr,
        A_FORMAT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        """One output tile of ``C[slot, n] = A[slot // A_ROW_DIV] . W[e, n]``, computed as
        ``acc [BLOCK_N, BLOCK_M]`` (see the module docstring)."""
        pid_m, pid_n = grouped_tile_ids(tl.program_id(0), max_padded, N, BLOCK_M, BLOCK_N,
                                        GROUP_M)  # fmt: skip
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        HALF: tl.constexpr = BLOCK_K // 2
        SCALES: tl.constexpr = BLOCK_K // 32
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slots = tl.load(sorted_slots_ptr + offs_m)
        row_mask = slots < num_slots
        expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        offs_h = tl.arange(0, HALF)
        offs_s = tl.arange(0, SCALES)
        a_rows = (slots // A_ROW_DIV).to(tl.int64)
        a_ptrs = a_ptr + a_rows[None, :] * stride_am + offs_k[:, None]
        rows = offs_n.to(tl.int64)[:, None]
        w_ptrs = w_ptr + expert * stride_we + rows * stride_wn + offs_h[None, :]
        s_ptrs = scale_ptr + expert * stride_se + rows * stride_sn + offs_s[None, :]
        up_w = N * stride_wn
        up_s = N * stride_sn
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            left = K - k0
            a = tl.load(a_ptrs, mask=(offs_k < left)[:, None] & row_mask[None, :], other=0.0)
            w_mask = n_mask[:, None] & (offs_h < left // 2)[None, :]
            s_mask = n_mask[:, None] & (offs_s < left // 32)[None, :]
            packed = tl.load(w_ptrs, mask=w_mask, other=0)
            scale = tl.load(s_ptrs, mask=s_mask, other=0)
            acc = _mxfp4_dot(packed, scale, a, acc, SCALED_DOT, A_FORMAT, DOT_PRECISION)
            if GATED:
                packed = tl.load(w_ptrs + up_w, mask=w_mask, other=0)
                scale = tl.load(s_ptrs + up_s, mask=s_mask, other=0)
                acc_up = _mxfp4_dot(packed, scale, a, acc_up, SCALED_DOT, A_FORMAT,
                                    DOT_PRECISION)  # fmt: skip
            a_ptrs += BLOCK_K
            w_ptrs += HALF
            s_ptrs += SCALES
        if HAS_BIAS:
            bias = bias_ptr + expert * stride_bias + offs_n
            acc += tl.load(bias, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            if GATED:
                acc_up += tl.load(bias + N, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if GATED:
            acc = gated_tile(acc, acc_up, alpha, limit, SWIGLUOAI)
        if MUL_WEIGHT:
            acc = acc * tl.load(weights_ptr + slots, mask=row_mask, other=0.0)[None, :]
        c_ptrs = c_ptr + slots.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=n_mask[:, None] & row_mask[None, :])


def launch_mxfp4_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_slots: int,
    a_row_div: int,
    gated: bool,
    config: dict[str, int],
    bias: torch.Tensor | None,
    activation: GatedActivation,
) -> None:
    """One grouped GEMM over MXFP4 experts into ``c [num_slots, N]``.

    Args:
        a: ``[rows, K]`` activations (bf16/fp16 on CUDA; float32 under the interpreter).
        w, scale: uint8 ``[E, rows_w, K / 2]`` and ``[E, rows_w, K / 32]``; ``rows_w`` is
            ``2N`` with ``gated`` (gate rows, then up rows), else ``N``.
        topk_weights: ``[num_slots]`` float32 routing weights (read unless ``gated``).
        aligned: ``fused_moe.align_tokens_by_expert``'s result for ``config["BLOCK_M"]``.
        a_row_div: slot ``s`` reads row ``s // a_row_div`` of ``a``.
        bias: ``[E, rows_w]`` or None.
        activation: how gate and up combine (read with ``gated``).
    """
    sorted_slots, block_experts, num_padded = aligned
    n, k = c.shape[1], a.shape[1]
    max_padded = sorted_slots.numel()
    grid = (cdiv(max_padded, config["BLOCK_M"]) * cdiv(n, config["BLOCK_N"]),)
    # The scaled dot on CUDA (the interpreter has none), bf16/fp16 activations.
    a_format = _SCALED_DOT_FORMATS.get(a.dtype) if a.is_cuda else None
    bias_arg = bias if bias is not None else c  # unread stand-in, a fixed dtype
    _moe_mxfp4_kernel[grid](
        a, w, scale, c, topk_weights, sorted_slots, block_experts, num_padded, bias_arg,
        n, k, num_slots, max_padded,
        a.stride(0), w.stride(0), w.stride(1), scale.stride(0), scale.stride(1), c.stride(0),
        bias.stride(0) if bias is not None else 0,
        float(activation.alpha), float(activation.limit),
        A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=not gated, HAS_BIAS=bias is not None,
        SWIGLUOAI=activation.kind == "swigluoai", SCALED_DOT=a_format is not None,
        A_FORMAT=a_format or "bf16",
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
        GROUP_M=config["GROUP_M"], num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )  # fmt: skip

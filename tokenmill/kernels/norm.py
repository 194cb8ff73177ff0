"""RMSNorm (Zhang & Sennrich 2019) with the residual add in one Triton kernel: one pass over
the activations instead of several torch kernels that read and write them again. The torch
code of ``model/layers/norm.py`` is the CPU path and this kernel's reference."""

from __future__ import annotations

import torch

from tokenmill.kernels import pdl
from tokenmill.kernels.device import HAS_TRITON
from tokenmill.math_utils import next_power_of_2

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tokenmill.kernels.pdl import wait_for_prior_grid

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
        n_cols, x_stride, res_stride, out_stride, eps, offset,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        wait_for_prior_grid(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * res_stride + cols, mask=mask, other=0.0)
            x = x + r.to(tl.float32)
            # The new residual is stored in the activations' dtype, as the torch path does.
            tl.store(residual_out_ptr + row * res_stride + cols,
                     x.to(residual_out_ptr.dtype.element_ty), mask=mask)
            x = x.to(residual_out_ptr.dtype.element_ty).to(tl.float32)
        var = tl.sum(x * x, axis=0) / n_cols
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
        y = x * tl.rsqrt(var + eps) * w
        tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``y / sqrt(mean(y^2) + eps) * (weight + offset)`` per row of ``y = x + residual``
    (``y = x`` without one), in float32, stored in x's dtype.

    Shapes: ``x`` and ``residual`` ``[T, H]`` with contiguous rows, ``weight [H]``.

    Returns:
        ``normed``, or ``(normed, x + residual)`` with the new residual rounded to x's dtype
        (as the torch path stores it); the inputs are not modified.
    """
    x2 = x.reshape(-1, x.shape[-1])
    n_rows, n_cols = x2.shape
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    res = residual.reshape(-1, n_cols) if residual is not None else x2
    if n_rows:
        _rms_norm_kernel[(n_rows,)](
            x2, res, weight, out, res_out, n_cols, x2.stride(0), res.stride(0), out.stride(0),
            eps, offset, HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(n_cols),
            num_warps=min(16, max(1, next_power_of_2(n_cols) // 256)),
            **pdl.launch_options(x.device),
        )  # fmt: skip
    if residual is None:
        return out.view_as(x)
    return out.view_as(x), res_out.view_as(x)


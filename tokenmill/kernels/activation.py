"""SiLU-and-mul (the SwiGLU gate, Shazeer 2020) in one Triton kernel; the torch code of
``model/layers/activation.py`` is the CPU path and this kernel's reference."""

from __future__ import annotations

import torch

from tokenmill.kernels import pdl
from tokenmill.kernels.device import HAS_TRITON
from tokenmill.math_utils import cdiv

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tokenmill.kernels.pdl import wait_for_prior_grid

    @triton.jit
    def _silu_and_mul_kernel(
        x_ptr, out_ptr, d, x_stride, out_stride, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
    ):
        wait_for_prior_grid(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` in one pass: ``[T, 2d] -> [T, d]``, rows contiguous,
    computed in float32 and stored in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    d = x2.shape[-1] // 2
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    block = 1024
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], cdiv(d, block))](
            x2, out, d, x2.stride(0), out.stride(0), BLOCK=block, **pdl.launch_options(x.device)
        )
    return out.view(*x.shape[:-1], d)

"""Rotary embedding of a vision tower's patches (Qwen2-VL/Qwen2.5-VL's 2-D RoPE) in one
Triton pass over q and k, in place.

The tower gives every patch its own angles (height and width frequencies side by side), so
there is no position table to index as in the text model's ``rotary.py``, and its head
dimension (80 for Qwen2.5-VL) has a half that is no power of two. Unfused, the rotation is
about ten torch passes over q and k in float32. ``vision_rotary_torch`` is the reference
and the CPU path.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.device import HAS_TRITON
from tokenmill.math_utils import next_power_of_2

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rotate_heads(base, stride, head_stride, row, h, i, half, cos, sin, mask):
        a_ptr = base + row * stride + h * head_stride + i[None, :]
        a = tl.load(a_ptr, mask=mask).to(tl.float32)
        b = tl.load(a_ptr + half, mask=mask).to(tl.float32)
        tl.store(a_ptr, (a * cos - b * sin).to(base.dtype.element_ty), mask=mask)
        tl.store(a_ptr + half, (b * cos + a * sin).to(base.dtype.element_ty), mask=mask)

    @triton.jit
    def _vision_rotary_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr,
        q_stride, k_stride, head_stride, cs_stride, num_heads, half,
        HEADS: tl.constexpr, HALF_P: tl.constexpr,
    ):
        # One program per patch, all its q and k heads as [HEADS, HALF_P] tiles.
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, HALF_P)
        cols = i < half
        cos = tl.load(cos_ptr + row * cs_stride + i, mask=cols, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + row * cs_stride + i, mask=cols, other=0.0).to(tl.float32)
        cos, sin = cos[None, :], sin[None, :]
        h = tl.arange(0, HEADS)[:, None]
        mask = (h < num_heads) & cols[None, :]
        _rotate_heads(q_ptr, q_stride, head_stride, row, h, i, half, cos, sin, mask)
        _rotate_heads(k_ptr, k_stride, head_stride, row, h, i, half, cos, sin, mask)


def vision_rotary_torch(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """``x cos + rotate_half(x) sin`` in float32, returned in x's dtype (transformers'
    ``apply_rotary_pos_emb_vision``).

    Shapes: ``x [S, H, D]``, ``cos``/``sin`` ``[S, D]``.
    """
    c, s = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * c + torch.cat((-x2, x1), dim=-1) * s).to(x.dtype)


def vision_rotary_inplace(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotate ``q`` and ``k`` in place by each patch's angles (NeoX halves).

    Args:
        q, k: ``[S, H, D]`` views (e.g. of a fused qkv output), the same head stride, the
            last dimension contiguous.
        cos, sin: ``[S, D]`` of the angles repeated over both halves (the towers build them
            as ``cat(freqs, freqs)``), so only the first ``D / 2`` columns are read.

    Raises:
        ValueError: a layout the kernel does not take.
    """
    s, num_heads, head_dim = q.shape
    if k.shape != q.shape or k.stride(1) != q.stride(1):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share a layout")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or head_dim % 2:
        raise ValueError("q and k need contiguous heads of an even dimension")
    if cos.shape != (s, head_dim) or sin.shape != cos.shape or cos.stride() != sin.stride() \
            or cos.stride(-1) != 1:
        raise ValueError(f"cos/sin must be [{s}, {head_dim}] with one layout")
    if s == 0:
        return
    half = head_dim // 2
    _vision_rotary_kernel[(s,)](
        q, k, cos, sin, q.stride(0), k.stride(0), q.stride(1), cos.stride(0), num_heads, half,
        HEADS=next_power_of_2(num_heads), HALF_P=next_power_of_2(half),
    )  # fmt: skip

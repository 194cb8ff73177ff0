"""Triton helpers shared by the GGUF kernels: reading the blocks' bytes and fp16 fields, and
storing a GEMV's output row (``gguf``, ``gguf_kquant``, ``gguf_q32``)."""

from __future__ import annotations

from tokenmill.kernels.device import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def load_u8(ptr, mask):
        """Bytes at ``ptr`` (any shape), as int32; 0 where masked."""
        return tl.load(ptr, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def load_f16(ptr, mask):
        """The little-endian fp16 at ``ptr`` (two bytes, any alignment), as float32."""
        lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def store_row(out_ptrs, y, mask, ATOMIC: tl.constexpr):
        """A product's partial output (``ATOMIC``: added in float32, split-K) or its whole
        output, at ``out_ptrs`` (a row or a tile)."""
        if ATOMIC:
            tl.atomic_add(out_ptrs, y, mask=mask)
        else:
            tl.store(out_ptrs, y.to(out_ptrs.dtype.element_ty), mask=mask)

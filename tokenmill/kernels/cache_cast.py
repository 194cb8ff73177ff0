"""The conversion of values to the KV cache's element type, shared by the kernels that write
the cache (attention's cache writes, the fused rotary-and-cache-write kernels)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast_to_cache(x, cache_ptr):
    """``x`` in the KV cache's element type; FP8 caches (e4m3, e5m2) saturate at their
    largest finite value rather than overflow to NaN."""
    ty = cache_ptr.dtype.element_ty
    if ty == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
    elif ty == tl.float8e5:
        x = tl.clamp(x.to(tl.float32), -57344.0, 57344.0)
    return x.to(ty)

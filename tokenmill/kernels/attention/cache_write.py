"""Writing new keys and values into the paged KV cache: one Triton kernel and its launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.cache_cast import cast_to_cache
from tokenmill.math_utils import next_power_of_2


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_vt,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_P: tl.constexpr,
    D_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program per token: copy its ``[Hkv, D]`` K and V rows to its slot (skip slot < 0)."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, H_P)[:, None]
    d = tl.arange(0, D_P)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    src = h * HEAD_DIM + d
    dst = block * stride_cb + offset * stride_cs + h * stride_ch + d
    k = tl.load(key_ptr + t.to(tl.int64) * stride_kt + src, mask=mask)
    tl.store(k_cache_ptr + dst, cast_to_cache(k, k_cache_ptr), mask=mask)
    v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + src, mask=mask)
    tl.store(v_cache_ptr + dst, cast_to_cache(v, v_cache_ptr), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
) -> None:
    """Write the first ``num_tokens`` tokens' K/V into their slots of the paged cache.

    Args:
        key, value: ``[T, num_kv_heads * head_dim]`` (rows may be strided, e.g. views of
            a fused QKV output; the last dimension must be contiguous).
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, last dim
            contiguous; values are cast to its dtype (FP8 saturating).
        slot_mapping: ``[>= num_tokens]`` int32/int64, ``block_id * block_size + offset``;
            tokens with a negative slot (padding) are skipped.
        num_tokens: tokens to write (``metadata.num_actual_tokens``).

    Raises:
        ValueError: a layout the kernel cannot address.
    """
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    for name, t in (("key", key), ("value", value), ("kv_cache", kv_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if key.shape[-1] != num_kv_heads * head_dim or value.shape[-1] != key.shape[-1]:
        raise ValueError(f"K/V width {key.shape[-1]} != {num_kv_heads} x {head_dim}")
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), value.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        H_P=next_power_of_2(num_kv_heads), D_P=next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        num_warps=4,
    )  # fmt: skip

"""Rotary embedding (RoPE, Su et al. 2021) in Triton: applied in place, or fused with the
KV-cache write; ``rotary_pairs`` is shared with the decode attention kernel.

Unfused, the rotation is ~10 torch passes over q and k in float32; here it is one. The
torch code of ``model/layers/rotary.py`` is the CPU path and these kernels' reference.
"""

from __future__ import annotations

import torch

from tokenmill.kernels import pdl
from tokenmill.kernels.device import HAS_TRITON
from tokenmill.math_utils import next_power_of_2

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tokenmill.kernels.cache_cast import cast_to_cache
    from tokenmill.kernels.pdl import wait_for_prior_grid

    @triton.jit
    def _rotate_heads(
        base, row_stride, num_heads, cos, sin,
        HEADS: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr,
    ):
        # One token's heads as a [HEADS, HALF] tile: rows past ``num_heads`` are masked.
        h = tl.arange(0, HEADS)[:, None]
        i = tl.arange(0, HALF)[None, :]
        mask = (h < num_heads) & (i < HALF)
        if NEOX:
            a_ptr = base + h * row_stride + i
            b_ptr = a_ptr + HALF
        else:
            a_ptr = base + h * row_stride + 2 * i
            b_ptr = a_ptr + 1
        a = tl.load(a_ptr, mask=mask).to(tl.float32)
        b = tl.load(b_ptr, mask=mask).to(tl.float32)
        tl.store(a_ptr, (a * cos - b * sin).to(base.dtype.element_ty), mask=mask)
        tl.store(b_ptr, (b * cos + a * sin).to(base.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(
        q_ptr, k_ptr, pos_ptr, cache_ptr,
        q_stride, k_stride, cache_stride,
        num_q_heads, num_k_heads, head_dim,
        HALF: tl.constexpr, NEOX: tl.constexpr,
        Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr,
    ):
        # One program per token, all its heads at once: a program per (token, head) moved
        # 256 bytes each and ran at a fifth of the memory bandwidth.
        token = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + token).to(tl.int64)
        i = tl.arange(0, HALF)
        cos = tl.load(cache_ptr + pos * cache_stride + i)[None, :]
        sin = tl.load(cache_ptr + pos * cache_stride + HALF + i)[None, :]
        _rotate_heads(
            q_ptr + token * q_stride, head_dim, num_q_heads, cos, sin, Q_HEADS, HALF, NEOX
        )
        _rotate_heads(
            k_ptr + token * k_stride, head_dim, num_k_heads, cos, sin, K_HEADS, HALF, NEOX
        )

    @triton.jit
    def rotary_pairs(cs_row, D_P: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr):
        """For one position's ``cos | sin`` row: per dimension ``[D_P]`` of a head, its
        rotary partner, cos, signed sin and whether it rotates, so that the rotated head is
        ``x * cos + x[partner] * sin`` where it rotates (the first ``2 * HALF``
        dimensions: halves with ``NEOX``, else adjacent pairs) and ``x`` elsewhere."""
        d = tl.arange(0, D_P)
        rotates = d < 2 * HALF
        if NEOX:
            partner = tl.where(d < HALF, d + HALF, d - HALF)
            freq = d % HALF
            sign = tl.where(d < HALF, -1.0, 1.0)
        else:
            partner = d ^ 1
            freq = d // 2
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
        cos = tl.load(cs_row + freq, mask=rotates, other=1.0)
        sin = tl.load(cs_row + HALF + freq, mask=rotates, other=0.0) * sign
        return partner, cos, sin, rotates

    # A step's token count changes every step; Triton specializes integers on being 1 and
    # on divisibility by 16, so a count that changed either would compile another variant
    # in the middle of serving.
    @triton.jit(do_not_specialize=["num_tokens"])
    def _rotary_cache_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
        num_tokens, q_stride, k_stride, v_stride, cos_sin_stride,
        stride_cb, stride_cs, stride_ch,
        num_q_heads, num_k_heads, head_dim,
        HALF: tl.constexpr, NEOX: tl.constexpr, Q_HEADS: tl.constexpr,
        K_HEADS: tl.constexpr, D_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        # One program per token: rotate its query heads in place, then write its rotated
        # key and its value straight into the cache slot (the rotated key is not written
        # back to ``k``: only the cache reads it).
        wait_for_prior_grid(USE_PDL)
        token = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + token).to(tl.int64)
        cs_row = cos_sin_ptr + pos * cos_sin_stride
        i = tl.arange(0, HALF)
        cos = tl.load(cs_row + i)[None, :]
        sin = tl.load(cs_row + HALF + i)[None, :]
        _rotate_heads(
            q_ptr + token * q_stride, head_dim, num_q_heads, cos, sin, Q_HEADS, HALF, NEOX
        )
        if token >= num_tokens:
            return
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot < 0:
            return
        h = tl.arange(0, K_HEADS)[:, None]
        d = tl.arange(0, D_P)[None, :]
        mask = (h < num_k_heads) & (d < head_dim)
        # Each rotated element pairs with a partner in its head: out = x cos + x' (sign sin).
        partner, c, s, rotates = rotary_pairs(cs_row, D_P, HALF, NEOX)
        k_row = k_ptr + token * k_stride + h * head_dim
        k = tl.load(k_row + d, mask=mask, other=0.0).to(tl.float32)
        pair_mask = mask & rotates[None, :]
        k_pair = tl.load(k_row + partner[None, :], mask=pair_mask, other=0.0).to(tl.float32)
        rotated = k * c[None, :] + k_pair * s[None, :]
        k = tl.where(rotates[None, :], rotated, k).to(k_ptr.dtype.element_ty)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
        tl.store(k_cache_ptr + dst, cast_to_cache(k, k_cache_ptr), mask=mask)
        v = tl.load(v_ptr + token * v_stride + h * head_dim + d, mask=mask)
        tl.store(v_cache_ptr + dst, cast_to_cache(v, v_cache_ptr), mask=mask)


def rotary_half(rotary_dim: int) -> int:
    """Half the rotary dimension, which the fused kernels' tiles (and the decode kernel's
    rotary path) need to be a power of two.

    Raises:
        ValueError: it is not (or is 0).
    """
    half = rotary_dim // 2
    if half < 1 or half & (half - 1):
        raise ValueError(f"fused rotary needs a power-of-two rotary_dim/2, got {half}")
    return half


def rotary_inplace(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
    is_neox_style: bool,
) -> None:
    """Rotate ``q [T, Hq*D]`` and ``k [T, Hk*D]`` in place (first ``rotary_dim`` dims of each
    head) with the float32 ``cos | sin`` table ``[max_pos, rotary_dim]``."""
    t = positions.shape[0]
    if t == 0:
        return
    half = rotary_half(rotary_dim)
    num_q, num_k = q.shape[1] // head_dim, k.shape[1] // head_dim
    _rotary_kernel[(t,)](
        q, k, positions, cos_sin_cache, q.stride(0), k.stride(0), cos_sin_cache.stride(0),
        num_q, num_k, head_dim, HALF=half, NEOX=is_neox_style,
        Q_HEADS=next_power_of_2(num_q), K_HEADS=next_power_of_2(num_k),
    )  # fmt: skip


def rotary_and_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
    is_neox_style: bool,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
) -> None:
    """Rotate ``q [T, Hq*D]`` in place and write the rotated ``k [T, Hk*D]`` and ``v`` into
    their slots of the paged cache, in one launch; ``k`` itself is left unrotated.

    Equal to ``rotary_inplace`` followed by ``reshape_and_cache`` (the rotated key is cast
    to ``k``'s dtype, then to the cache's, as that pair does) up to the last bit of the keys
    (the compiler may contract the products into FMAs differently), minus a pass over the
    keys and one launch per layer.

    Args:
        positions: ``[T]`` int positions; every row of ``q`` is rotated.
        cos_sin_cache: float32 ``cos | sin`` table ``[max_pos, rotary_dim]``.
        kv_cache: ``[2, num_blocks, block_size, Hk, D]``, last dim contiguous.
        slot_mapping: ``[>= num_tokens]`` int, ``block_id * block_size + offset``; tokens
            with a negative slot (padding) are not written.
        num_tokens: the leading tokens whose K/V are written.

    Raises:
        ValueError: ``rotary_dim / 2`` is not a power of two, or a layout the kernel
            cannot address.
    """
    t = positions.shape[0]
    if t == 0:
        return
    half = rotary_half(rotary_dim)
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim or k.shape[1] != num_kv_heads * head_dim:
        raise ValueError(f"K width {k.shape[1]} != {num_kv_heads} x {head_dim} of the cache")
    for name, x in (("q", q), ("k", k), ("v", v), ("kv_cache", kv_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_q = q.shape[1] // head_dim
    _rotary_cache_kernel[(t,)](
        q, k, v, positions, cos_sin_cache, slot_mapping, k_cache, v_cache,
        num_tokens, q.stride(0), k.stride(0), v.stride(0), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_q, num_kv_heads, head_dim, HALF=half, NEOX=is_neox_style,
        Q_HEADS=next_power_of_2(num_q), K_HEADS=next_power_of_2(num_kv_heads),
        D_P=next_power_of_2(head_dim), BLOCK_SIZE=block_size, **pdl.launch_options(q.device),
    )  # fmt: skip

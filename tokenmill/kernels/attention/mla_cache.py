"""Multi-head latent attention's cache write (DeepSeek-V2, arXiv:2405.04434) in one Triton
launch: rotate each query's rotary part in place and store the token's latent with its
rotated rotary key, ``[c | rope(k_pe)]``, in its slot of the paged latent cache.

The torch code of ``model/attention/mla.py`` and ``model/layers/rotary.py`` is the CPU path
and this kernel's reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.rotary import rotary_half
from tokenmill.math_utils import next_power_of_2


@triton.jit
def _rotated_halves(a, b, cos, sin):
    """The rotation of pairs ``(a, b)`` by the angles whose ``cos`` and ``sin`` are given."""
    return a * cos - b * sin, b * cos + a * sin


# A step's token count changes every step (see ``kernels/rotary.py``).
@triton.jit(do_not_specialize=["num_tokens"])
def _mla_rope_cache_kernel(
    q_ptr, kv_c_ptr, k_pe_ptr, pos_ptr, cos_sin_ptr, slot_ptr, cache_ptr,
    num_tokens, num_heads, stride_qt, stride_qh, stride_ct, stride_pt, stride_cos,
    stride_cb, stride_cs,
    NOPE: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr, HEADS_P: tl.constexpr,
    RANK: tl.constexpr, RANK_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """One program per token: rotate its query heads' rotary parts (after ``NOPE`` values
    each) in place, then, for the first ``num_tokens`` tokens with a slot, write the latent
    ``c`` (``RANK`` values) and the rotated rotary key into the slot."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    i = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cos + i)
    sin = tl.load(cos_sin_ptr + pos * stride_cos + HALF + i)
    h = tl.arange(0, HEADS_P)[:, None]
    hmask = (h < num_heads) & (i[None, :] < HALF)
    q_rows = q_ptr + token * stride_qt + h * stride_qh + NOPE
    if NEOX:
        a_off, b_off = i[None, :], i[None, :] + HALF
    else:
        a_off, b_off = 2 * i[None, :], 2 * i[None, :] + 1
    qa = tl.load(q_rows + a_off, mask=hmask).to(tl.float32)
    qb = tl.load(q_rows + b_off, mask=hmask).to(tl.float32)
    ra, rb = _rotated_halves(qa, qb, cos[None, :], sin[None, :])
    tl.store(q_rows + a_off, ra.to(q_ptr.dtype.element_ty), mask=hmask)
    tl.store(q_rows + b_off, rb.to(q_ptr.dtype.element_ty), mask=hmask)
    if token >= num_tokens:
        return
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    r = tl.arange(0, RANK_P)
    c = tl.load(kv_c_ptr + token * stride_ct + r, mask=r < RANK)
    tl.store(dst + r, c.to(cache_ptr.dtype.element_ty), mask=r < RANK)
    if NEOX:
        ka_off, kb_off = i, i + HALF
    else:
        ka_off, kb_off = 2 * i, 2 * i + 1
    ka = tl.load(k_pe_ptr + token * stride_pt + ka_off).to(tl.float32)
    kb = tl.load(k_pe_ptr + token * stride_pt + kb_off).to(tl.float32)
    ra, rb = _rotated_halves(ka, kb, cos, sin)
    # Rounded to the key's dtype first, as the torch rotation then the write round it.
    ra = ra.to(k_pe_ptr.dtype.element_ty).to(cache_ptr.dtype.element_ty)
    rb = rb.to(k_pe_ptr.dtype.element_ty).to(cache_ptr.dtype.element_ty)
    tl.store(dst + RANK + ka_off, ra)
    tl.store(dst + RANK + kb_off, rb)


def mla_rope_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
    num_heads: int,
    qk_nope_head_dim: int,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
) -> None:
    """Rotate ``query``'s rotary parts in place and write ``[kv_c | rope(k_pe)]`` into the
    slots of the first ``num_tokens`` tokens.

    Args:
        positions: ``[T]`` int positions; every row of ``query`` is rotated.
        query: ``[T, num_heads * (nope + P)]``, each head's last ``P`` values rotated.
        kv_c: ``[>= num_tokens, R]`` normalised latents (rows may be strided).
        k_pe: ``[>= num_tokens, P]`` unrotated rotary keys (rows may be strided).
        cos_sin_cache: float32 ``cos | sin`` table ``[max_pos, P]``.
        is_neox_style: rotate the two halves (else adjacent pairs).
        kv_cache: ``[num_blocks, block_size, R + P]``, contiguous rows.
        slot_mapping: ``[>= num_tokens]`` int; negative slots (padding) are not written.
        num_tokens: the leading tokens whose latents are written.

    Raises:
        ValueError: ``P / 2`` is not a power of two, or a layout the kernel cannot address.
    """
    t = positions.shape[0]
    if t == 0:
        return
    rank, rope_dim = kv_c.shape[-1], k_pe.shape[-1]
    half = rotary_half(rope_dim)
    if kv_cache.shape[-1] != rank + rope_dim:
        raise ValueError(f"latent cache width {kv_cache.shape[-1]} != {rank} + {rope_dim}")
    for name, x in (("query", query), ("kv_c", kv_c), ("k_pe", k_pe), ("kv_cache", kv_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    head = qk_nope_head_dim + rope_dim
    _mla_rope_cache_kernel[(t,)](
        query, kv_c, k_pe, positions, cos_sin_cache, slot_mapping, kv_cache,
        num_tokens, num_heads, query.stride(0), head, kv_c.stride(0), k_pe.stride(0),
        cos_sin_cache.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        NOPE=qk_nope_head_dim, HALF=half, NEOX=is_neox_style,
        HEADS_P=next_power_of_2(num_heads), RANK=rank, RANK_P=next_power_of_2(rank),
        BLOCK_SIZE=kv_cache.shape[1], num_warps=4,
    )  # fmt: skip

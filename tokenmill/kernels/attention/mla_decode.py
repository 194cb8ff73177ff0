"""Multi-head latent attention's decode kernel (DeepSeek-V2, arXiv:2405.04434) over the paged
latent cache: split-K (flash-decoding) attention in the latent space, with the absorbed
query.

Each decode request's ``H`` absorbed queries ``q_lat`` (``R`` values each, ``W_UK^T q_nope``)
and rotary queries ``q_pe`` (``P`` values) attend over its cached ``[c | k_pe]`` entries:
score ``= (q_lat . c + q_pe . k_pe) * scale``, output ``= softmax . c`` (``R`` values). One
program takes ``BLOCK_H`` heads of one request over one split of its context, so each
latent tile it loads serves ``BLOCK_H`` heads (a key tile is shared by every head: MLA's
cache is a single "KV head"). Online softmax within a split (FlashAttention-2, Dao 2023);
with several splits, each writes its normalised partial output and log-sum-exp and a
second launch merges them (Flash-Decoding, Dao et al. 2023).

The float32 torch code of ``model/attention/mla.py`` (``attend_latent_torch``) is the
reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.device import num_sms
from tokenmill.math_utils import cdiv, next_power_of_2

# Split counts are powers of two up to this (each count compiles its own merge).
MAX_SPLITS = 16
# A split gets at least this many tokens of context.
MIN_TOKENS_PER_SPLIT = 256


@dataclass(frozen=True)
class MLADecodeTiles:
    """Tile sizes of the decode kernel.

    Attributes:
        block_h: heads per program (at least 16: the smallest ``tl.dot`` tile).
        block_n: context tokens per loop iteration.
        num_warps, num_stages: Triton launch options.
        heads_major: the head blocks of one request are neighbouring programs, which run
            together, so each latent tile can come from memory once and from the L2 cache
            for the other head blocks; else (the default, the order measured) neighbouring
            programs are different requests. ``benchmarks/mla_bench.py`` times both.
    """

    block_h: int = 16
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    heads_major: bool = False


def mla_decode_tiles(dtype: torch.dtype) -> MLADecodeTiles:
    """16 heads and 32 tokens per tile, 4 warps, for 16-bit caches (vLLM's Triton MLA
    decode uses the same head block); float32 (the interpreter) takes 16-token tiles."""
    if dtype == torch.float32:
        return MLADecodeTiles(block_n=16, num_stages=1)
    return MLADecodeTiles()


def mla_num_splits(batch: int, num_head_blocks: int, max_seq_len: int, sms: int) -> int:
    """Splits of each context: enough programs to fill the SMs once when the batch alone
    does not, a power of two, at most ``MAX_SPLITS`` and one per ``MIN_TOKENS_PER_SPLIT``
    tokens of ``max_seq_len``."""
    programs = batch * num_head_blocks
    if programs >= sms:
        return 1
    want = next_power_of_2(cdiv(sms, max(1, programs)))
    by_length = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    cap = min(MAX_SPLITS, 1 << (by_length.bit_length() - 1))
    return max(1, min(want, cap))


@triton.jit(do_not_specialize=["num_heads", "num_splits"])
def _mla_decode_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, out_ptr, part_ptr, lse_ptr,
    num_heads, num_splits, qk_scale,
    stride_qlh, stride_qlb, stride_qpb, stride_qph, stride_cb, stride_cs, stride_bt,
    stride_oh, stride_ob, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    RANK: tl.constexpr, RANK_P: tl.constexpr, ROPE: tl.constexpr, ROPE_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, HEADS_MAJOR: tl.constexpr,
):  # fmt: skip
    """Program (request ``b``, head block, split): ``BLOCK_H`` heads over the split's
    tokens. ``qk_scale`` is the softmax scale times ``log2(e)`` (scores in base 2). With
    ``SPLIT`` it writes the normalised partial and its base-2 log-sum-exp (``-inf`` for an
    empty split), else the output (zeros for a context of 0)."""
    if HEADS_MAJOR:
        b = tl.program_id(1)
        heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    else:
        b = tl.program_id(0)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    r = tl.arange(0, RANK_P)
    p = tl.arange(0, ROPE_P)
    hm = heads < num_heads
    q_lat = tl.load(
        q_lat_ptr + heads[:, None].to(tl.int64) * stride_qlh + b.to(tl.int64) * stride_qlb
        + r[None, :], mask=hm[:, None] & (r < RANK)[None, :], other=0.0,
    )  # fmt: skip
    q_pe = tl.load(
        q_pe_ptr + b.to(tl.int64) * stride_qpb + heads[:, None] * stride_qph + p[None, :],
        mask=hm[:, None] & (p < ROPE)[None, :], other=0.0,
    )  # fmt: skip
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_P], dtype=tl.float32)
    table = block_table_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        km = offs < end
        block = tl.load(table + offs // BLOCK_SIZE, mask=km, other=0).to(tl.int64)
        rows = cache_ptr + block * stride_cb + (offs % BLOCK_SIZE) * stride_cs
        c = tl.load(rows[:, None] + r[None, :], mask=km[:, None] & (r < RANK)[None, :], other=0.0)
        pe = tl.load(rows[:, None] + RANK + p[None, :], mask=km[:, None] & (p < ROPE)[None, :],
                     other=0.0)  # fmt: skip
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(pe), s, input_precision=DOT_PRECISION)
        s = tl.where(km[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        probs = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(probs, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(probs.to(c.dtype), c, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    rm = hm[:, None] & (r < RANK)[None, :]
    if SPLIT:
        parts = (part_ptr + b.to(tl.int64) * stride_pb + heads[:, None].to(tl.int64) * stride_ph
                 + split * stride_ps + r[None, :])  # fmt: skip
        tl.store(parts, out, mask=rm)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=hm)
    else:
        o = out_ptr + heads[:, None].to(tl.int64) * stride_oh + b.to(tl.int64) * stride_ob
        tl.store(o + r[None, :], out.to(out_ptr.dtype.element_ty), mask=rm)


@triton.jit
def _mla_merge_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_oh, stride_ob,
    RANK: tl.constexpr, RANK_P: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Program (request, head): the splits' partials weighed by their log-sum-exp."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, SPLITS)
    r = tl.arange(0, RANK_P)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    parts = tl.load(part_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps
                    + r[None, :], mask=(r < RANK)[None, :], other=0.0)  # fmt: skip
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + h * stride_oh + b * stride_ob + r, out.to(out_ptr.dtype.element_ty),
             mask=r < RANK)  # fmt: skip


def mla_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    tiles: MLADecodeTiles | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention in the latent space (see the module docstring).

    Launch arguments depend only on the shapes, ``max_seq_len`` and the device, so a CUDA
    graph captured for a batch size replays any contexts up to its ``max_seq_len``.

    Args:
        q_lat: ``[H, B, R]`` absorbed queries (last dimension contiguous).
        q_pe: ``[B, H, P]`` rotated rotary queries (last dimension contiguous).
        kv_cache: ``[num_blocks, block_size, R + P]``, contiguous rows.
        block_table: ``[B, *]`` int32 block ids of each request.
        seq_lens: ``[B]`` int32 context lengths (at most ``max_seq_len``; 0 gives zeros).
        scale: softmax scale.
        max_seq_len: the longest context the launch must cover (sets the split count).
        tiles: tile sizes; ``mla_decode_tiles`` if None.
        num_splits: splits per context (a power of two); ``mla_num_splits`` if None.

    Returns:
        ``[H, B, R]`` in ``q_lat``'s dtype.

    Raises:
        ValueError: a layout the kernel cannot address.
    """
    num_heads, batch, rank = q_lat.shape
    rope = q_pe.shape[-1]
    if kv_cache.shape[-1] != rank + rope:
        raise ValueError(f"latent cache width {kv_cache.shape[-1]} != {rank} + {rope}")
    for name, x in (("q_lat", q_lat), ("q_pe", q_pe), ("kv_cache", kv_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    out = torch.empty(num_heads, batch, rank, dtype=q_lat.dtype, device=q_lat.device)
    if batch == 0:
        return out
    tiles = tiles or mla_decode_tiles(kv_cache.dtype)
    head_blocks = cdiv(num_heads, tiles.block_h)
    splits = num_splits or mla_num_splits(batch, head_blocks, max_seq_len, num_sms(q_lat.device))
    if splits & (splits - 1):
        raise ValueError(f"the split count must be a power of two, got {splits}")
    split = splits > 1
    part = lse = out  # unused without splits
    if split:
        part = torch.empty(batch, num_heads, splits, rank, dtype=torch.float32,
                           device=q_lat.device)  # fmt: skip
        lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q_lat.device)
    consts = dict(RANK=rank, RANK_P=next_power_of_2(rank))
    grid = (head_blocks, batch, splits) if tiles.heads_major else (batch, head_blocks, splits)
    _mla_decode_kernel[grid](
        q_lat, q_pe, kv_cache, block_table, seq_lens, out, part, lse,
        num_heads, splits, scale * 1.4426950408889634,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1),
        part.stride(0) if split else 0, part.stride(1) if split else 0,
        part.stride(2) if split else 0, lse.stride(0) if split else 0,
        lse.stride(1) if split else 0,
        ROPE=rope, ROPE_P=next_power_of_2(rope), BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n,
        BLOCK_SIZE=kv_cache.shape[1], SPLIT=split,
        DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
        HEADS_MAJOR=tiles.heads_major,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **consts,
    )  # fmt: skip
    if split:
        _mla_merge_kernel[(batch, num_heads)](
            part, lse, out, part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            SPLITS=splits, num_warps=4, **consts,
        )  # fmt: skip
    return out

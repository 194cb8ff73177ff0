"""Nucleus (top-p) truncation on CUDA without sorting the vocabulary: a radix select of the
cut-off logit.

Top-p (Holtzman et al. 2019) keeps the most likely tokens whose probability first reaches
``p``. The sort route (``sampler.apply_top_k_top_p``, the CPU path) sorts each row of the
vocabulary, then takes a softmax and a cumulative sum of the sorted row; on the GPU that is
most of a decode step at large batch. Here the kept set is found as a threshold instead.

Each float32 ``x`` maps to an unsigned 32-bit key that orders like ``x`` (the sign bit set
for non-negative floats, all bits flipped for negative ones: the radix-sort order of IEEE
754 floats). With ``M(t)`` the probability mass of the tokens whose key is at least ``t``,
non-increasing in ``t``, the cut-off is the largest ``t*`` with ``M(t*) >= p``: the kept set
``{key >= t*}`` is the smallest set of top tokens whose mass reaches ``p`` (up to the tokens
tied with the last one), and always holds the most likely token. ``t*`` is built four bits
at a time from the top (a radix select, as in Alabi et al. 2012, "Fast k-selection
algorithms for graphics processing units"): each of eight passes measures ``M`` at the 16
keys that extend the bits found so far by one hex digit, in one read of the row, and keeps
the largest digit whose mass still reaches ``p``. A pass is two launches: ``(B, chunks)``
programs sum the candidates' masses over slices of their row, one program per row adds the
slices up and extends its key. Nothing leaves the GPU, so the step stays capturable in a
CUDA graph (timings against the sort route: ``benchmarks/device/sampler_bench.py``).

Ties: tokens whose logit equals the cut-off are all kept (the sort route keeps those the
sort placed first). Logits rounded to bf16 tie often: on 128k-token rows that keeps ~1-7%
more tokens than the sort route, ~0.2-1% of probability mass past ``p``. Sums run in another
order than the sort route's cumulative sum, so a token whose mass above sits within float32
rounding of ``p`` may land on the other side.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.device import triton_can_run
from tokenmill.math_utils import row_slices

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False

# Key bits decided per pass: 16 candidates per pass, 32 / DIGIT_BITS passes.
DIGIT_BITS = 4
DIGITS = 1 << DIGIT_BITS
PASSES = 32 // DIGIT_BITS
# Columns per inner step of a pass program, and programs to aim for across the batch.
BLOCK = 512
TARGET_PROGRAMS = 528
MAX_CHUNKS = 256
# Load the next block of the row before summing the current one (one block of loads in
# flight per program while it computes). Off until measured against the plain loop
# (``benchmarks/device/sampler_bench.py``: ``top_p_0.9_radix_prefetch``).
PREFETCH = False


def chunk_plan(rows: int, vocab: int) -> tuple[int, int]:
    """``(chunks, chunk_cols)``: each row cut into at most ``MAX_CHUNKS`` slices of
    ``chunk_cols`` columns (a multiple of ``BLOCK``) so that the batch makes about
    ``TARGET_PROGRAMS`` programs."""
    return row_slices(rows, vocab, BLOCK, TARGET_PROGRAMS, MAX_CHUNKS)


def top_p_threshold(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest logit top-p keeps: token ``i`` survives iff ``logits[i] >=
    threshold``.

    Args:
        logits: ``[B, V]`` float32, contiguous along V, each row at most 0 with its maximum
            at 0 (``logits - row max``, temperature applied); dropped tokens at -inf.
        top_p: ``[B]`` float32 in (0, 1]; rows at 1.0 keep every token (threshold -inf).

    Returns:
        ``[B]`` float32 thresholds.

    Raises:
        ValueError: shapes or dtypes the kernels cannot take, or tensors off CUDA without
            ``TRITON_INTERPRET=1``.
    """
    if not HAS_TRITON:
        raise ValueError("top_p_threshold needs Triton")
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] float32 contiguous along V, got "
                         f"{tuple(logits.shape)} {logits.dtype}")  # fmt: skip
    if top_p.shape != (logits.shape[0],) or top_p.dtype != torch.float32:
        raise ValueError(f"top_p must be [{logits.shape[0]}] float32")
    if not triton_can_run(logits):
        raise ValueError("top_p_threshold runs on CUDA tensors (or under TRITON_INTERPRET=1)")
    rows, vocab = logits.shape
    device = logits.device
    threshold = torch.empty(rows, dtype=torch.float32, device=device)
    if rows == 0:
        return threshold
    chunks, chunk_cols = chunk_plan(rows, vocab)
    key = torch.zeros(rows, dtype=torch.int64, device=device)  # uint32 values in int64
    total = torch.empty(rows, dtype=torch.float32, device=device)
    partial = torch.empty(rows, chunks, DIGITS, dtype=torch.float32, device=device)
    for i in range(PASSES):
        shift = 32 - DIGIT_BITS * (i + 1)
        _mass_kernel[(rows, chunks)](
            logits, key, partial, vocab, logits.stride(0), chunk_cols, shift,
            BLOCK=BLOCK, DIGITS=DIGITS, PREFETCH=PREFETCH, num_warps=4,
        )  # fmt: skip
        _select_kernel[(rows,)](
            partial, key, total, top_p, threshold, chunks, shift, FIRST=i == 0,
            LAST=i == PASSES - 1, DIGITS=DIGITS, CHUNKS_P=MAX_CHUNKS, num_warps=4,
        )  # fmt: skip
    return threshold


if HAS_TRITON:

    @triton.jit
    def _ordered_key(x):
        """uint32 keys that order like the float32 ``x`` (non-NaN)."""
        bits = x.to(tl.uint32, bitcast=True)
        flip = tl.where((bits >> 31) != 0, 0xFFFFFFFF, 0x80000000).to(tl.uint32)
        return bits ^ flip

    @triton.jit(do_not_specialize=["vocab", "stride", "chunk_cols", "shift"])
    def _mass_kernel(
        x_ptr, key_ptr, part_ptr, vocab, stride, chunk_cols, shift,
        BLOCK: tl.constexpr, DIGITS: tl.constexpr, PREFETCH: tl.constexpr,
    ):  # fmt: skip
        """Program (row, chunk): the probability mass (unnormalised, ``exp(x)``) of the
        chunk's tokens at or above each of the 16 candidate keys ``key | d << shift``."""
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        prefix = tl.load(key_ptr + row).to(tl.uint32)
        d = tl.arange(0, DIGITS).to(tl.uint32)
        cand = prefix | (d << shift.to(tl.uint32))
        # Per-lane sums, reduced across lanes once after the loop: a cross-lane reduction
        # of each candidate in every iteration made the pass compute-bound.
        acc = tl.zeros([DIGITS, BLOCK], dtype=tl.float32)
        start = chunk * chunk_cols
        end = tl.minimum(start + chunk_cols, vocab)
        cols = tl.arange(0, BLOCK)
        row_ptr = x_ptr + row * stride
        if PREFETCH:
            x_next = tl.load(row_ptr + start + cols, mask=start + cols < end, other=float("-inf"))
        for off in range(start, end, BLOCK):
            idx = off + cols
            if PREFETCH:
                x = x_next
                ahead = idx + BLOCK
                x_next = tl.load(row_ptr + ahead, mask=ahead < end, other=float("-inf"))
            else:
                x = tl.load(row_ptr + idx, mask=idx < end, other=float("-inf"))
            w = tl.exp(x)
            keys = _ordered_key(x)
            hit = keys[None, :] >= cand[:, None]
            acc += tl.where(hit, w[None, :], 0.0)
        mass = tl.sum(acc, axis=1)
        tl.store(part_ptr + (row * tl.num_programs(1) + chunk) * DIGITS + d, mass)

    @triton.jit(do_not_specialize=["chunks", "shift"])
    def _select_kernel(
        part_ptr, key_ptr, total_ptr, top_p_ptr, threshold_ptr, chunks, shift,
        FIRST: tl.constexpr, LAST: tl.constexpr, DIGITS: tl.constexpr,
        CHUNKS_P: tl.constexpr,
    ):  # fmt: skip
        """Program (row): extend the row's key by the largest digit whose mass reaches
        ``top_p`` of the total; the first pass's digit-0 candidate (key 0) is the total."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, CHUNKS_P)
        d = tl.arange(0, DIGITS)
        ptrs = part_ptr + (row * chunks + c[:, None]) * DIGITS + d[None, :]
        mass = tl.sum(tl.load(ptrs, mask=(c < chunks)[:, None], other=0.0), axis=0)
        if FIRST:
            total = tl.sum(tl.where(d == 0, mass, 0.0), axis=0)
            tl.store(total_ptr + row, total)
        else:
            total = tl.load(total_ptr + row)
        p = tl.load(top_p_ptr + row)
        # mass > 0: a top_p that float32 rounds to 0 must keep the top token, not everything.
        digit = tl.max(tl.where((mass >= p * total) & (mass > 0.0), d, 0), axis=0)
        prefix = tl.load(key_ptr + row).to(tl.uint32) | (digit.to(tl.uint32) << shift.to(tl.uint32))
        tl.store(key_ptr + row, prefix.to(tl.int64))
        if LAST:
            # Back from key to float32: the inverse of ``_ordered_key``.
            bits = (prefix ^ tl.where((prefix >> 31) != 0, 0x80000000, 0xFFFFFFFF)).to(tl.uint32)
            x = bits.to(tl.float32, bitcast=True)
            tl.store(threshold_ptr + row, tl.where(p >= 1.0, float("-inf"), x))

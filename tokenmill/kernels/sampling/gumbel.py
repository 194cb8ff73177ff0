"""One-pass sampling on CUDA: greedy and temperature rows in two small Triton launches.

For a row with temperature ``t > 0`` the token is ``argmax_i(l_i + t * g_i)`` with
``g_i = -log(-log(u_i))`` standard Gumbel noise and ``u_i`` uniform: the Gumbel-max trick
(Gumbel 1954; Maddison, Tarlow and Minka 2014, "A* Sampling"), which draws token ``i`` with
probability ``softmax(l / t)_i`` because ``l + t * g = t * (l / t + g)`` has the argmax of
``l / t + g``. A greedy row (``t = 0``) takes ``argmax_i l_i``, ties to the lowest id as
``torch.argmax``.

Why a kernel: the torch route reads and writes ``[B, V]`` float32 tensors about eight times
(copy, max, shift, scale, noise, clamp, log, add, argmax). Here the logits are read once in
their own dtype, the noise is made in registers (Philox4x32-10, Salmon et al. 2011,
"Parallel random numbers: as easy as 1, 2, 3", four 32-bit draws per call; ``_gumbel``
turns them into noise), and only ``[B, chunks]`` partial winners reach memory.

Precision: the score is formed in float64. In float32, ``l + t * g`` at ``t = 1e-5`` and
``l ~ 30`` would round the noise to a few units in the last place (ties, then the lower id
wins); no row maximum is needed first, so each row's chunks run in parallel.

Noise: each row has its own 64-bit Philox key (``seeds``). Column ``i`` of a row uses output
``(i % BLOCK) // QUARTER`` of counter ``QUARTER * (i // BLOCK) + i % QUARTER``, whatever
the chunking, so a row's draw depends only on its key and its logits, not on the batch
around it. NaN logits never win (``torch.argmax`` would pick them).
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

# Columns per inner step of a program: four contiguous quarters, one Philox output each.
QUARTER = 256
BLOCK = 4 * QUARTER
# Programs to aim for across the batch (~4 per SM of an H200), so that few rows still fill
# the chip; every program covers at least one BLOCK.
TARGET_PROGRAMS = 528
# Chunks per row never exceed TARGET_PROGRAMS: the reduction's one block size, so that a
# batch size never compiles a new variant in the middle of serving.
MAX_CHUNKS = 1024


def chunk_plan(rows: int, vocab: int) -> tuple[int, int]:
    """``(chunks, chunk_cols)``: each row is cut into ``chunks <= TARGET_PROGRAMS`` slices of
    ``chunk_cols`` columns (a multiple of ``BLOCK``; the last slice may be shorter)."""
    return row_slices(rows, vocab, BLOCK, TARGET_PROGRAMS, MAX_CHUNKS)


def gumbel_argmax(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """One token per row: greedy where ``temperature`` is 0, else a draw from
    ``softmax(logits / temperature)`` (see the module docstring).

    Args:
        logits: ``[B, V]`` float16, bfloat16 or float32, contiguous along V; not modified.
        temperature: ``[B]`` float32, ``>= 0``.
        seeds: ``[B]`` int64, the rows' Philox keys (ignored for greedy rows).

    Returns:
        ``[B]`` int64 token ids.

    Raises:
        ValueError: shapes or dtypes the kernels cannot take, or tensors off CUDA without
            ``TRITON_INTERPRET=1``.
    """
    if not HAS_TRITON:
        raise ValueError("gumbel_argmax needs Triton")
    if not triton_can_run(logits):
        raise ValueError("gumbel_argmax runs on CUDA tensors (or under TRITON_INTERPRET=1)")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] and contiguous along V, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if temperature.shape != (rows,) or seeds.shape != (rows,):
        raise ValueError(f"temperature and seeds must be [{rows}]")
    if temperature.dtype != torch.float32 or seeds.dtype != torch.int64:
        raise ValueError("temperature must be float32 and seeds int64")
    chunks, chunk_cols = chunk_plan(rows, vocab)
    best = torch.empty((rows, chunks), dtype=torch.float64, device=logits.device)
    best_idx = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    _chunk_kernel[(rows, chunks)](
        logits, temperature, seeds, best, best_idx, vocab, logits.stride(0), chunk_cols,
        chunks, QUARTER=QUARTER, num_warps=4,
    )  # fmt: skip
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _reduce_kernel[(rows,)](best, best_idx, out, chunks, CHUNKS_P=MAX_CHUNKS)
    return out


if HAS_TRITON:

    @triton.jit
    def _gumbel(x):
        """Gumbel noise ``-log E`` from uint32 draws ``x``, with ``E = -log(1 - v) ~ Exp(1)``
        and ``v = (x + 1/2) / 2**32``. The winning columns are those with the smallest E,
        where ``-log(u)`` of a float32 ``u`` near 1 would keep only a few significant bits;
        E comes from ``v`` instead: ``v + v**2/2 + v**3/3`` below 2**-7 (relative error
        < 2**-23), and above it ``-log(w)`` with ``w = 1 - v`` formed from the complement
        ``2**32 - 1 - x``, exact and never 0 (``1 - v`` in float32 would round to 0 for the top 128
        draws, an infinite E and a column that could never win, even a row's only one)."""
        v = (x.to(tl.float32) + 0.5) * 2.3283064365386963e-10
        w = ((4294967295 - x.to(tl.int64)).to(tl.float32) + 0.5) * 2.3283064365386963e-10
        e = tl.where(v < 0.0078125, v + v * v * (0.5 + v * 0.3333333333333333), -tl.log(w))
        return -tl.log(e)

    @triton.jit
    def _score(logit, x, t):
        """float64 scores of one quarter: ``logit`` (float32), uint32 draws ``x``,
        temperature ``t`` (0: greedy, the logit itself)."""
        if t > 0.0:
            s = logit.to(tl.float64) + t.to(tl.float64) * _gumbel(x).to(tl.float64)
        else:
            s = logit.to(tl.float64)
        return s

    @triton.jit
    def _keep(best, best_col, s, col):
        # Per lane, strictly greater: on ties the earlier (lower) column stays.
        better = s > best
        return tl.where(better, s, best), tl.where(better, col, best_col)

    @triton.jit(do_not_specialize=["chunks"])
    def _chunk_kernel(
        logits_ptr, temp_ptr, seed_ptr, best_ptr, best_idx_ptr,
        vocab, stride_row, chunk_cols, chunks, QUARTER: tl.constexpr,
    ):  # fmt: skip
        """Grid ``(B, chunks)``: the best score of one row's slice and its column.

        Each lane keeps its own best score and column across the slice; the one
        cross-lane reduction runs at the end (the largest score, then the lowest column
        holding it).
        """
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        t = tl.load(temp_ptr + row)
        seed = tl.load(seed_ptr + row)
        base = logits_ptr + row.to(tl.int64) * stride_row
        start = chunk * chunk_cols
        end = tl.minimum(start + chunk_cols, vocab)
        lanes = tl.arange(0, QUARTER)
        best = tl.full((QUARTER,), float("-inf"), tl.float64)
        best_col = start + lanes * 0
        for off in range(start, end, 4 * QUARTER):
            c0 = off + lanes
            c1 = c0 + QUARTER
            c2 = c1 + QUARTER
            c3 = c2 + QUARTER
            l0 = tl.load(base + c0, mask=c0 < end, other=float("-inf")).to(tl.float32)
            l1 = tl.load(base + c1, mask=c1 < end, other=float("-inf")).to(tl.float32)
            l2 = tl.load(base + c2, mask=c2 < end, other=float("-inf")).to(tl.float32)
            l3 = tl.load(base + c3, mask=c3 < end, other=float("-inf")).to(tl.float32)
            # One Philox call per four columns; counters are unique within the row.
            x0, x1, x2, x3 = tl.randint4x(seed, off // 4 + lanes)
            best, best_col = _keep(best, best_col, _score(l0, x0, t), c0)
            best, best_col = _keep(best, best_col, _score(l1, x1, t), c1)
            best, best_col = _keep(best, best_col, _score(l2, x2, t), c2)
            best, best_col = _keep(best, best_col, _score(l3, x3, t), c3)
        top = tl.max(best, axis=0)
        # The lowest column holding the maximum; the slice's first when all are -inf.
        col = tl.min(tl.where(best == top, best_col, 2147483647), axis=0)
        tl.store(best_ptr + row * chunks + chunk, top)
        tl.store(best_idx_ptr + row * chunks + chunk, col)

    @triton.jit(do_not_specialize=["chunks"])
    def _reduce_kernel(best_ptr, best_idx_ptr, out_ptr, chunks, CHUNKS_P: tl.constexpr):
        """Grid ``(B,)``: the row's winner over its chunks (ties: the lowest chunk)."""
        row = tl.program_id(0)
        k = tl.arange(0, CHUNKS_P)
        ok = k < chunks
        s = tl.load(best_ptr + row * chunks + k, mask=ok, other=float("-inf"))
        i = tl.load(best_idx_ptr + row * chunks + k, mask=ok, other=0)
        top = tl.max(s, axis=0)
        # The first chunk holding the maximum; chunk 0 when the whole row is -inf.
        first = tl.min(tl.where((s == top) & ok, k, CHUNKS_P), axis=0)
        first = tl.where(first == CHUNKS_P, 0, first)
        tok = tl.sum(tl.where(k == first, i, 0), axis=0)
        tl.store(out_ptr + row, tok.to(tl.int64))

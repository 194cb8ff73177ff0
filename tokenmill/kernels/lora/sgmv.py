"""Multi-adapter LoRA for a mixed batch: ``y[t] += (x[t] A[s_t]^T) B[s_t]`` for every
row ``t`` of a flat batch, ``s_t`` the row's adapter slot (0: no adapter, rows left as they are).

The segmented/batched gather-matmul idea of Punica (Chen et al. 2023, "Punica: Multi-Tenant
LoRA Serving": SGMV for prefill segments, BGMV for decode rows) and S-LoRA (Sheng et al.
2023), in one pair of Triton kernels for mixed prefill/decode batches:

- ``shrink``: ``t = x A[s]^T``, ``x [T, K]``, ``A [S, R, K]`` -> ``t [T, R]`` float32;
- ``expand``: ``y += t B[s]``, ``B [S, R, N]``, added in place into ``y [T, N]``.

A program owns a tile of ``BLOCK_M`` rows and one adapter slot: a tensor-core product
masked to that slot's rows (all the rows of one request's prompt; a few of a tile of decode
rows). Programs of a slot absent from their tile, and tiles of rows without adapters, do no
work; with one program per slot, a program's serial work does not grow with the number of
adapters in the batch. The shrink splits K into chunks (split-K) so that a decode batch, one
or two row tiles, still spreads over the GPU; the chunks' partial sums are added by one
reduction (deterministic, no atomics) before the expand, which then reads each row's ``t``
once per column tile (summed inside the expand, the chunks would be summed again in every
column tile and slot program). The expand of a
merged layer (q/k/v, gate/up) reads, per column tile, only the rank block of the part that
owns those columns. The slot ids are read on the device, so CUDA graphs replay the launches
for any mix of adapters.

``lora_torch`` is the CPU path: every slot's shrink in one GEMM, the rows' own blocks kept by
a one-hot mask, one expand GEMM (no per-request loop). ``lora_reference`` is the per-row
reference both are tested against.

The shrink and the expand also run apart (``lora_shrink_*``, ``lora_expand_*``): a layer
whose adapters are sharded over tensor-parallel ranks puts a collective on ``t`` between
them (``tokenmill.lora.layers``).
"""

from __future__ import annotations

import torch

from tokenmill.kernels.device import HAS_TRITON, num_sms
from tokenmill.math_utils import cdiv

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _shrink_kernel(
        x_ptr, a_ptr, slot_ptr, t_ptr, T, K, R, K_CHUNK, RANK_TILES,
        sx, sa0, sa1, st_split, st,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        # Program (row tile, slot x rank tile, K chunk): the chunk's partial product of the
        # tile's rows of one slot with that slot's A, stored in the chunk's plane of t (the
        # expand sums the planes). One slot per program keeps a program's loop to its chunk
        # of K; programs of a slot absent from the tile return at once. Slot 0's program
        # stores zeros for its rows, so every entry of t is written.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        s = tl.program_id(1) // RANK_TILES
        ranks = (tl.program_id(1) % RANK_TILES) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < T
        slots = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
        mine = slots == s
        if tl.sum(mine.to(tl.int32)) > 0:
            k_lo = tl.program_id(2) * K_CHUNK
            k_hi = tl.minimum(k_lo + K_CHUNK, K)
            rows64 = rows.to(tl.int64)
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            if s > 0:
                a_base = a_ptr + s.to(tl.int64) * sa0
                for k0 in range(k_lo, k_hi, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    xt = tl.load(
                        x_ptr + rows64[:, None] * sx + ks[None, :],
                        mask=mine[:, None] & (ks[None, :] < k_hi),
                        other=0.0,
                    )
                    at = tl.load(
                        a_base + ranks[None, :] * sa1 + ks[:, None],
                        mask=(ranks[None, :] < R) & (ks[:, None] < k_hi),
                        other=0.0,
                    )
                    if IEEE:
                        acc += tl.dot(xt, at, input_precision="ieee")
                    else:
                        acc += tl.dot(xt, at)
            tl.store(
                t_ptr + tl.program_id(2) * st_split + rows64[:, None] * st + ranks[None, :],
                acc,
                mask=mine[:, None] & (ranks[None, :] < R),
            )

    @triton.jit
    def _expand_kernel(
        t_ptr, b_ptr, slot_ptr, y_ptr, T, N, R, PART_R, START1, START2,
        st, sb0, sb1, sy,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        # Program (row tile, column tile, slot 1..S-1): the tile's rows of that slot only
        # (slots own disjoint rows, so programs never write the same entry of y).
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        c0 = tl.program_id(1) * BLOCK_N
        cols = c0 + tl.arange(0, BLOCK_N)
        s = tl.program_id(2) + 1
        row_ok = rows < T
        slots = tl.load(slot_ptr + rows, mask=row_ok, other=0)
        mine = (slots == s) & row_ok
        if tl.sum(mine.to(tl.int32)) > 0:
            # The merged part whose output features hold this column tile: only its block
            # of PART_R ranks has non-zero B entries here.
            p = (c0 >= START1).to(tl.int32) + (c0 >= START2).to(tl.int32)
            r_lo = p * PART_R
            r_hi = tl.minimum(r_lo + PART_R, R)
            rows64 = rows.to(tl.int64)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for r0 in range(r_lo, r_hi, BLOCK_R):
                ranks = r0 + tl.arange(0, BLOCK_R)
                tt = tl.load(
                    t_ptr + rows64[:, None] * st + ranks[None, :],
                    mask=mine[:, None] & (ranks[None, :] < r_hi),
                    other=0.0,
                )
                bt = tl.load(
                    b_ptr + s.to(tl.int64) * sb0 + ranks[:, None] * sb1 + cols[None, :],
                    mask=(ranks[:, None] < r_hi) & (cols[None, :] < N),
                    other=0.0,
                )
                if IEEE:
                    acc += tl.dot(tt, bt.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(tt.to(bt.dtype), bt)
            ptrs = y_ptr + rows64[:, None] * sy + cols[None, :]
            mask = mine[:, None] & (cols[None, :] < N)
            y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


SHRINK_BLOCK_K = 64
EXPAND_BLOCK_N = 64
MAX_SHRINK_CHUNKS = 16


def _block_m(num_rows: int) -> int:
    """Row tile: the batch rounded up to 16 or 32 for decode-sized batches, 64 above (a
    tile's rows share the slots' A and B loads)."""
    return 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64


def _rank_tile(rank: int) -> int:
    """Ranks per tile: at least 16 (the tensor-core product's minimum), at most 64 (a slot's
    stacked rank reaches parts x max_lora_rank, 1,536 for q/k/v at rank 512, which one tile
    could not hold in registers or shared memory)."""
    return min(64, max(16, triton.next_power_of_2(rank)))


def shrink_split(num_tiles: int, k: int, sms: int) -> tuple[int, int]:
    """``(chunks, chunk size)`` of the shrink's reduction dimension: enough chunks that the
    row x rank tiles times the chunks fill two waves of ``sms`` programs (a batch of a few
    rows over K = 4,096 would otherwise be a handful of programs each streaming its slot's
    whole A), each chunk at least ``SHRINK_BLOCK_K`` wide, at most ``MAX_SHRINK_CHUNKS`` (past 16,
    more chunks cost more in the reduction than they gain: H100, ``lora_kernel_bench.py``)."""
    chunks = max(1, min((2 * sms) // max(num_tiles, 1), cdiv(k, SHRINK_BLOCK_K), MAX_SHRINK_CHUNKS))
    size = cdiv(cdiv(k, chunks), SHRINK_BLOCK_K) * SHRINK_BLOCK_K
    return cdiv(k, size), size


def lora_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    part_starts: tuple[int, ...] = (),
) -> None:
    """``y[t] += (x[t] A[slots[t]]^T) B[slots[t]]`` in place, by the two kernels.

    Args:
        y: ``[T, N]`` output (rows contiguous), updated in place.
        x: ``[T, K]`` input, rows contiguous, the dtype of ``a`` and ``b``.
        a: ``[S, R, K]`` A stacks by slot (slot 0 unused: no adapter).
        b: ``[S, R, N]`` B stacks by slot, the adapter scale folded in.
        slots: ``[T]`` int32 slot per row, in ``[0, S)``.
        part_starts: for a merged layer of ``P`` (2 or 3) parts, the first output feature
            of parts 1.. ``P-1``: part ``p`` owns ranks ``[p R/P, (p+1) R/P)`` and B is zero
            outside them, so the expand reads only that block. Empty: every rank.
    """
    if x.shape[0] == 0:
        return
    lora_expand_triton(y, lora_shrink_triton(x, a, slots), b, slots, part_starts)


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The shrink alone: ``t[t] = x[t] A[slots[t]]^T`` (zero for rows of slot 0).

    Args:
        x: ``[T, K]``, rows contiguous, the dtype of ``a``.
        a: ``[S, R, K]`` A stacks by slot.
        slots: ``[T]`` int32.

    Returns:
        ``t [T, R]`` float32, contiguous.
    """
    num_rows, k = x.shape
    rank = a.shape[1]
    block_m, block_r = _block_m(num_rows), _rank_tile(rank)
    row_tiles, rank_tiles = cdiv(num_rows, block_m), cdiv(rank, block_r)
    chunks, chunk = shrink_split(row_tiles * rank_tiles, k, num_sms(x.device))
    t = torch.empty(chunks, num_rows, rank, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return t[0]
    # every slot's programs, slot 0's included (they zero its rows)
    _shrink_kernel[(row_tiles, a.shape[0] * rank_tiles, chunks)](
        x, a, slots, t, num_rows, k, rank, chunk, rank_tiles,
        x.stride(0), a.stride(0), a.stride(1), t.stride(0), t.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=SHRINK_BLOCK_K,
        IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    # the K chunks' partial sums, added in one fixed order
    return t[0] if chunks == 1 else t.sum(0)


def lora_expand_triton(
    y: torch.Tensor,
    t: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    part_starts: tuple[int, ...] = (),
) -> None:
    """The expand alone: ``y[t] += t[t] B[slots[t]]`` in place (rows of slot 0 untouched).

    Args:
        y: ``[T, N]``, rows contiguous (a column slice of a wider output is fine).
        t: ``[T, R]`` float32, contiguous (``lora_shrink_triton``'s, or gathered).
        b: ``[S, R, N]`` B stacks by slot.
        slots: ``[T]`` int32.
        part_starts: as ``lora_triton``'s.
    """
    num_rows, rank, n = t.shape[0], b.shape[1], b.shape[2]
    if num_rows == 0 or b.shape[0] == 1:
        return
    part_rank, starts = rank, (n, n)
    if part_starts and all(s % EXPAND_BLOCK_N == 0 for s in part_starts):
        part_rank = rank // (len(part_starts) + 1)
        starts = (tuple(part_starts) + (n,))[:2]
    block_m = _block_m(num_rows)
    # programs for slots 1..S-1 (slot 0's rows keep y as it is)
    _expand_kernel[(cdiv(num_rows, block_m), cdiv(n, EXPAND_BLOCK_N), b.shape[0] - 1)](
        t, b, slots, y, num_rows, n, rank, part_rank, starts[0], starts[1],
        t.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=EXPAND_BLOCK_N, BLOCK_R=_rank_tile(part_rank),
        IEEE=b.dtype == torch.float32,
    )  # fmt: skip


def _slot_mask(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``[T, S]`` bool: each row's own slot, none for rows of slot 0."""
    keep = slots.to(torch.int64)[:, None] == torch.arange(num_slots, device=slots.device)
    keep[:, 0] = False
    return keep


def lora_torch(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> None:
    """``lora_triton``'s product in torch (the CPU path): shrink by every slot in one GEMM
    (``[T, S*R]``), zero all but each row's own slot, expand in one GEMM. Costs ``S`` times
    the one-adapter FLOPs, small at CPU batch sizes; no Python loop over rows or adapters.

    Shapes as ``lora_triton``.
    """
    lora_expand_torch(y, lora_shrink_torch(x, a, slots), b, slots)


def lora_shrink_torch(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``lora_shrink_triton`` in torch: every slot's shrink in one GEMM, then each row's own
    block (zero for slot 0). Shapes as ``lora_shrink_triton``; returns float32 ``[T, R]``."""
    num_slots, rank, k = a.shape
    t = (x @ a.reshape(num_slots * rank, k).T).view(-1, num_slots, rank)
    idx = slots.to(torch.int64)
    t = t[torch.arange(t.shape[0], device=x.device), idx]
    return (t * (idx > 0)[:, None].to(t.dtype)).float()


def lora_expand_torch(
    y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> None:
    """``lora_expand_triton`` in torch: each row's ``t`` placed in its slot's block of a
    ``[T, S*R]`` operand, one GEMM with every slot's B. Shapes as ``lora_expand_triton``."""
    num_slots, rank, n = b.shape
    keep = _slot_mask(slots, num_slots).to(b.dtype)
    tt = (t.to(b.dtype)[:, None, :] * keep[:, :, None]).view(-1, num_slots * rank)
    y += (tt @ b.reshape(num_slots * rank, n)).to(y.dtype)


def lora_reference(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> None:
    """The per-row definition, in float32 (tests): row by row, ``y[t] += (x[t] A^T) B``."""
    for row, slot in enumerate(slots.tolist()):
        if slot:
            t = x[row].float() @ a[slot].float().T
            y[row] += (t @ b[slot].float()).to(y.dtype)

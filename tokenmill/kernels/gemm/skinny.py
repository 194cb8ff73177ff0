"""Skinny matrix products ``y = x W^T (+ b)`` for decode-sized batches (M <= 32 rows) on CUDA.

**Bandwidth model.** With ``x [M, K]``, ``W [N, K]`` and ``y [M, N]`` in 2-byte dtypes, a
product moves ``2 * (N*K + M*K + M*N)`` bytes for ``2*M*N*K`` FLOPs: ``M`` FLOP per byte,
far below an H200's ridge (~186 FLOP/byte), so the floor is the time to stream ``W`` once
(``2*N*K`` bytes at ~4.25 TB/s). Reaching it takes every weight byte read once with 16-byte
loads along K, enough bytes in flight to cover DRAM latency (Little's law: ~3 MB on the
chip, ~23 KB per SM) and about ``TARGET_PROGRAMS_PER_SM`` programs per SM so that the last
wave is short; cuBLAS leaves the shapes with few output columns short of programs.

**Design.** One program computes ``BLOCK_N`` outputs (for all M rows) over one K-slice. When
``N / BLOCK_N`` programs are too few to fill the chip, K is split over ``split_k`` programs
(split-K; Hoque et al. 2024, arXiv:2402.00025), combined inside the same launch: each
program writes its fp32 partial tile to a workspace and counts itself on a per-column-block
counter; the last to arrive sums the partials in split order (deterministic), adds the
bias, writes ``y`` and resets the counter (CUDA's threadFenceReduction "last block"
pattern; CUTLASS's serial split-K). Two main loops:

- CUDA cores (``M <= FMA_MAX_M``; the default for ``M <= FMA_DEFAULT_MAX_M``): one fp32
  register accumulator ``[BLOCK_N, BLOCK_K]`` per row of ``x``, reduced across lanes once
  after the K loop, the next weight tile loaded while the current one is multiplied;
- tensor cores (any M): ``acc[BLOCK_N, BLOCK_M] += W_tile @ x_tile^T`` with ``BLOCK_M``
  padded to 16 or 32, the weight as the ``tl.dot`` left operand so that its 64-row tiles use
  Hopper's ``wgmma`` ("swap AB"), ``num_stages`` pipelining its loads through shared memory.

**FP8 weights.** A float8_e4m3fn weight with one scale per output row (W8A16) streams
half the bytes: its tiles are converted in registers (to fp32 on the CUDA cores, to x's dtype
for the tensor cores) and the scale multiplies the fp32 sums once, before the bias; the
default tiles take twice the K elements so that a tile keeps its bytes and its 16-byte loads.

Weights are loaded with ``evict_first`` (read once) and ``x`` with ``evict_last`` (every
program reads it).

**Dependent launches.** On sm_90+ each launch is a programmatic dependent launch: its
programs may start while the previous kernel finishes, issue their first weight loads, and
wait for that kernel (``griddepcontrol.wait``) before they read ``x``.

**CUDA graphs.** No host sync and no device-to-host read. The partial workspace is allocated
per call; under capture it comes from the graph's memory pool, which keeps it for replays.
The counters (``split_k.counters``) are zero before every launch and created by the
first call outside capture; a call made during capture before that runs without split-K.
Launches that share the counters must not run concurrently: one stream at a time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tokenmill.kernels.device import triton_can_run
from tokenmill.kernels.gemm import split_k
from tokenmill.kernels.gemm.skinny_configs import (  # noqa: F401 (re-exported)
    DEFAULT_NUM_SMS,
    FMA_DEFAULT_MAX_M,
    FMA_MAX_M,
    MAX_SPLIT_K,
    MIN_TILES_PER_SPLIT,
    PARTIAL_TRAFFIC_BUDGET,
    TARGET_PROGRAMS_PER_SM,
    TUNED_CONFIGS,
    TUNED_GPU,
    SkinnyConfig,
    block_m,
    default_config,
    has_tuned_config,
    launch_config,
    m_bucket,
    num_sms,
    split_plan,
)
from tokenmill.kernels.pdl import supported as supports_pdl
from tokenmill.kernels.quant.fp8 import FP8_DTYPE
from tokenmill.math_utils import cdiv

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False

# Largest M (rows of x) sent to this kernel: at M = 32 a product does 32 FLOP per weight
# byte, still ~6x below the H200's ridge point, so streaming W is the whole cost; above it
# cuBLAS's large-M tiles become efficient and the workspace traffic of split-K grows with M.
MAX_M = 32
# Smaller products are launch-bound whichever kernel runs: leave them to cuBLAS.
MIN_N = 256
MIN_K = 256
MIN_WEIGHT_BYTES = 1 << 20


def use_skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``skinny_linear(x, weight, ...)`` should replace ``F.linear`` here.

    True for CUDA tensors of bf16/fp16 with ``1 <= M <= MAX_M`` rows, a contiguous weight of
    x's dtype (or float8_e4m3fn, with its scales) of at least ``MIN_N`` x ``MIN_K`` (and
    ``MIN_WEIGHT_BYTES``) with 16-byte aligned rows, and ``x`` contiguous along K.
    """
    return HAS_TRITON and x.is_cuda and weight.device == x.device and _eligible(x, weight)


def _eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The device-independent part of ``use_skinny_gemm``."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype not in (x.dtype, FP8_DTYPE):
        return False
    (m, k), n = x.shape, weight.shape[0]
    return (
        1 <= m <= MAX_M
        and n >= MIN_N
        and k >= MIN_K
        and n * k * weight.element_size() >= MIN_WEIGHT_BYTES
        and weight.is_contiguous()
        and (k * weight.element_size()) % 16 == 0
        and weight.data_ptr() % 16 == 0
        and x.stride(1) == 1
    )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: SkinnyConfig | None = None,
    out: torch.Tensor | None = None,
    pdl: bool | None = None,
    gated: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y = x W^T (+ b)`` with fp32 accumulation, one kernel launch; with ``gated``, the
    SwiGLU gate of it, ``silu(y[:, :N/2]) * y[:, N/2:]`` (Shazeer 2020), in the same launch.

    Args:
        x: ``[M, K]``, float16/bfloat16 (float32 too under the Triton interpreter); rows may
            be strided, columns must be contiguous.
        weight: ``[N, K]`` of x's dtype, or float8_e4m3fn with ``weight_scale``, contiguous
            along K.
        bias: ``[N]`` or None; added in fp32 before the cast.
        config: launch configuration (default: ``launch_config`` for this shape, or
            ``default_config(..., weight_bytes=1)`` for an FP8 weight).
        out: ``[M, N]`` (``[M, N/2]`` gated) of x's dtype, contiguous along N, to write
            into (default: a new tensor).
        pdl: launch as a programmatic dependent launch (CUDA Programming Guide,
            "Programmatic Dependent Launch and Synchronization"): the kernel may start while
            the previous kernel of the stream finishes, issues its first weight loads, and
            waits (``griddepcontrol.wait``) before it reads ``x`` or writes anything, so it
            is safe after any kernel that does not write ``weight``. Default: on CUDA
            devices of compute capability 9.0 and up.
        gated: ``weight`` is a gate projection over an up projection (``[gate; up]``, as
            ``MergedColumnParallelLinear`` holds them). Each program computes ``BLOCK_N / 2``
            outputs from their gate and up rows and writes the gated values, each of ``y``
            rounded to x's dtype first as the separate product would store it; the gate is
            computed in fp32 as ``kernels.activation.silu_and_mul`` computes it.
        weight_scale: ``[N]`` float32, one scale per row of an FP8 ``weight``
            (``W = weight * weight_scale[:, None]``); None for a 16-bit weight.

    Returns:
        ``out``, or a new contiguous ``[M, N]`` (``[M, N/2]`` gated) tensor of x's dtype.

    Raises:
        ValueError: shapes, dtypes, devices or strides the kernel cannot address, a
            CUDA-core ``config`` with more than ``FMA_MAX_M`` rows, a tensor-core one with
            ``block_n < 16``, an odd N or ``block_n`` when gated, a missing or misshapen
            ``weight_scale``, or tensors off CUDA without ``TRITON_INTERPRET=1``.
    """
    _check_operands(x, weight, bias, weight_scale)
    (m, k), n = x.shape, weight.shape[0]
    if config is not None:
        cfg = config
    elif weight_scale is not None:
        cfg = default_config(m, n, k, num_sms(x.device), weight_bytes=1)
    else:
        cfg = launch_config(m, n, k, num_sms(x.device))
    plan = _launch_plan(m, n, k, cfg, gated)
    width = n // 2 if gated else n
    if out is None:
        out = torch.empty((m, width), dtype=x.dtype, device=x.device)
    elif out.shape != (m, width) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{m}, {width}] {x.dtype} contiguous along N")
    pdl = supports_pdl(x.device) if pdl is None else pdl and supports_pdl(x.device)
    locks = split_k.counters(x.device)
    splits, k_per_split = plan.splits, plan.k_per_split
    if splits > 1 and (locks is None or plan.n_blocks > split_k.COUNTER_SLOTS):
        splits, k_per_split = 1, cdiv(k, cfg.block_k) * cfg.block_k
    if splits > 1:
        partials = torch.empty(plan.partial_elems, dtype=torch.float32, device=x.device)
    else:
        locks = partials = out  # never touched without split-K
    _skinny_gemm_kernel[(plan.n_blocks * splits,)](
        x, weight, bias if bias is not None else out,
        weight_scale if weight_scale is not None else out, out, partials, locks, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0), splits, k_per_split,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M=plan.block_m, USE_DOT=cfg.use_dot,
        USE_SPLIT=splits > 1, HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", USE_PDL=pdl,
        ONE_TILE=k_per_split == cfg.block_k, GATED=gated, W_SCALED=weight_scale is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class _LaunchPlan:
    block_m: int  # rows of x per program, padded
    splits: int  # K-slices actually launched
    k_per_split: int  # elements of K per slice, a multiple of block_k
    n_blocks: int  # column blocks of BLOCK_N outputs (BLOCK_N / 2 gated)
    partial_elems: int  # fp32 elements of the split-K workspace


@functools.lru_cache(maxsize=1024)
def _launch_plan(m: int, n: int, k: int, cfg: SkinnyConfig, gated: bool = False) -> _LaunchPlan:
    """Host arithmetic of a launch, cached: in eager decode the CPU issues every layer."""
    if gated and (n % 2 or cfg.block_n % 2):
        raise ValueError(f"a gated product needs an even N and block_n, got {n} and {cfg.block_n}")
    if not cfg.use_dot and m > FMA_MAX_M:
        raise ValueError(f"the CUDA-core main loop takes at most {FMA_MAX_M} rows, got {m}")
    if cfg.use_dot and cfg.block_n < 16:
        raise ValueError(f"tl.dot needs block_n >= 16, got {cfg.block_n}")
    bm = block_m(m, cfg.use_dot)
    splits, k_per_split = split_plan(k, cfg.block_k, cfg.split_k)
    n_blocks = cdiv(n // 2, cfg.block_n // 2) if gated else cdiv(n, cfg.block_n)
    return _LaunchPlan(bm, splits, k_per_split, n_blocks, n_blocks * splits * cfg.block_n * bm)


def _check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    weight_scale: torch.Tensor | None = None) -> None:
    if not HAS_TRITON:
        raise ValueError("skinny_linear needs Triton")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if x.shape[0] < 1 or x.shape[0] > MAX_M:
        raise ValueError(f"x must have 1..{MAX_M} rows, got {x.shape[0]}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or weight.dtype != (
        FP8_DTYPE if weight_scale is not None else x.dtype
    ):
        raise ValueError(f"unsupported dtypes: x {x.dtype}, weight {weight.dtype} (an FP8 "
                         "weight comes with weight_scale, a 16-bit one without)")
    if weight_scale is not None and (
        weight_scale.shape != (weight.shape[0],) or weight_scale.dtype != torch.float32
        or weight_scale.stride(0) != 1
    ):
        raise ValueError(f"weight_scale must be a contiguous [{weight.shape[0]}] float32 "
                         f"vector, got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous along K")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [N] vector, got {tuple(bias.shape)}")
    devices = {t.device for t in (x, weight, bias, weight_scale) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"operands on several devices: {sorted(map(str, devices))}")
    if not triton_can_run(x):
        raise ValueError("skinny_linear runs on CUDA tensors (or under TRITON_INTERPRET=1)")


if HAS_TRITON:
    from tokenmill.kernels.gemm.split_k import publish_partial, sum_partials

    @triton.jit
    def _load_tile(ptrs, k_ok, EVEN_K: tl.constexpr, EVICT: tl.constexpr):
        # k_ok: [1, BLOCK_K] or [BLOCK_K] mask of in-range K; unused when K is whole tiles.
        if EVEN_K:
            tile = tl.load(ptrs, eviction_policy=EVICT)
        else:
            tile = tl.load(ptrs, mask=k_ok, other=0.0, eviction_policy=EVICT)
        return tile

    @triton.jit
    def _weight_rows(pid_n, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
        """The ``BLOCK_N`` weight rows of column block ``pid_n`` (int64). Gated: its
        ``BLOCK_N / 2`` gate rows, then the up rows ``N / 2`` further. Rows past the end
        re-read the last one, so that loads need no row mask."""
        r = tl.arange(0, BLOCK_N)
        if GATED:
            HALF: tl.constexpr = BLOCK_N // 2
            j = tl.minimum(pid_n * HALF + r % HALF, N // 2 - 1)
            rows = j + (r // HALF) * (N // 2)
        else:
            rows = tl.minimum(pid_n * BLOCK_N + r, N - 1)
        return rows.to(tl.int64)

    @triton.jit
    def _fma_mainloop(
        x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, pid_n, k_start, num_tiles,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
        EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, ONE_TILE: tl.constexpr,
        GATED: tl.constexpr,
    ):  # fmt: skip
        """Partial sums ``[BLOCK_N, BLOCK_M]`` (fp32) on CUDA cores, BLOCK_M <= 4.

        Tile ``i + 1`` is loaded into registers before tile ``i`` is multiplied, so each
        program has two tiles of loads in flight (Triton's pipeliner stages only loads that
        feed ``tl.dot``). ``ONE_TILE`` (every program's K-slice is one tile): the whole
        slice is loaded before the wait and reduced at once, with neither a prefetch
        buffer nor a ``[BLOCK_N, BLOCK_K]`` accumulator, so that a large slice fits in
        registers and all of it is read while the previous kernel runs.
        """
        rows = _weight_rows(pid_n, N, BLOCK_N, GATED)
        offs_k = (k_start + tl.arange(0, BLOCK_K))[None, :]
        w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k
        # Rows of x as [1, BLOCK_K] tiles take the weight tile's register layout (a 1-D load
        # would be re-laid out through shared memory every iteration). Rows past M repeat
        # row M-1; their outputs are never stored.
        x0 = x_ptr + offs_k + tl.zeros([BLOCK_N, 1], dtype=tl.int32)
        x1 = x0 + tl.minimum(1, M - 1) * stride_xm
        x2 = x0 + tl.minimum(2, M - 1) * stride_xm
        x3 = x0 + tl.minimum(3, M - 1) * stride_xm
        ok = offs_k < K
        w = _load_tile(w_ptrs, ok, EVEN_K, "evict_first")
        if USE_PDL:  # the weight is ours; x may still be being written by the previous kernel
            tl.extra.cuda.gdc_wait()
        cols = tl.arange(0, BLOCK_M)[None, :]
        if ONE_TILE:
            wf = w.to(tl.float32)
            v = _load_tile(x0, ok, EVEN_K, "evict_last")
            acc = tl.where(cols == 0, tl.sum(wf * v.to(tl.float32), axis=1)[:, None], 0.0)
            if BLOCK_M > 1:
                v = _load_tile(x1, ok, EVEN_K, "evict_last")
                acc = tl.where(cols == 1, tl.sum(wf * v.to(tl.float32), axis=1)[:, None], acc)
            if BLOCK_M > 2:
                v = _load_tile(x2, ok, EVEN_K, "evict_last")
                acc = tl.where(cols == 2, tl.sum(wf * v.to(tl.float32), axis=1)[:, None], acc)
                v = _load_tile(x3, ok, EVEN_K, "evict_last")
                acc = tl.where(cols == 3, tl.sum(wf * v.to(tl.float32), axis=1)[:, None], acc)
            return acc
        v0 = _load_tile(x0, ok, EVEN_K, "evict_last")
        v1 = _load_tile(x1, ok, EVEN_K, "evict_last")
        v2 = _load_tile(x2, ok, EVEN_K, "evict_last")
        v3 = _load_tile(x3, ok, EVEN_K, "evict_last")
        acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for i in range(num_tiles):
            more = i + 1 < num_tiles  # the last prefetch is masked off entirely
            if EVEN_K:
                ok_next = more
            else:
                ok_next = (offs_k + (i + 1) * BLOCK_K < K) & more
            w_ptrs += BLOCK_K
            w_next = tl.load(w_ptrs, mask=ok_next, other=0.0, eviction_policy="evict_first")
            x0 += BLOCK_K
            v0_next = tl.load(x0, mask=ok_next, other=0.0, eviction_policy="evict_last")
            if BLOCK_M > 1:
                x1 += BLOCK_K
                v1_next = tl.load(x1, mask=ok_next, other=0.0, eviction_policy="evict_last")
            if BLOCK_M > 2:
                x2 += BLOCK_K
                x3 += BLOCK_K
                v2_next = tl.load(x2, mask=ok_next, other=0.0, eviction_policy="evict_last")
                v3_next = tl.load(x3, mask=ok_next, other=0.0, eviction_policy="evict_last")
            wf = w.to(tl.float32)
            acc0 += wf * v0.to(tl.float32)
            w = w_next
            v0 = v0_next
            if BLOCK_M > 1:
                acc1 += wf * v1.to(tl.float32)
                v1 = v1_next
            if BLOCK_M > 2:
                acc2 += wf * v2.to(tl.float32)
                acc3 += wf * v3.to(tl.float32)
                v2 = v2_next
                v3 = v3_next
        # One cross-lane reduction per row, after the loop; rows become columns of the tile.
        acc = tl.where(cols == 0, tl.sum(acc0, axis=1)[:, None], 0.0)
        if BLOCK_M > 1:
            acc = tl.where(cols == 1, tl.sum(acc1, axis=1)[:, None], acc)
        if BLOCK_M > 2:
            acc = tl.where(cols == 2, tl.sum(acc2, axis=1)[:, None], acc)
            acc = tl.where(cols == 3, tl.sum(acc3, axis=1)[:, None], acc)
        return acc

    @triton.jit
    def _dot_mainloop(
        x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, pid_n, k_start, num_tiles,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
        EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, GATED: tl.constexpr,
    ):  # fmt: skip
        """Partial sums ``[BLOCK_N, BLOCK_M]`` (fp32) on tensor cores: ``W_tile @ x_tile^T``."""
        rows = _weight_rows(pid_n, N, BLOCK_N, GATED)
        offs_m = tl.minimum(tl.arange(0, BLOCK_M), M - 1)
        offs_k = k_start + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for i in range(num_tiles):
            k_ok = (offs_k + i * BLOCK_K < K)[None, :]
            w = _load_tile(w_ptrs, k_ok, EVEN_K, "evict_first")
            xt = _load_tile(x_ptrs, k_ok, EVEN_K, "evict_last")
            acc = tl.dot(w.to(xt.dtype), tl.trans(xt), acc, input_precision=DOT_PRECISION)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        return acc

    @triton.jit
    def _store_output(
        acc, out_ptr, bias_ptr, scale_ptr, pid_n, M, N, stride_om,
        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr,
        GATED: tl.constexpr, W_SCALED: tl.constexpr,
    ):  # fmt: skip
        offs_m = tl.arange(0, BLOCK_M)
        if W_SCALED:  # rows past N re-read the last scale; their outputs are not stored
            acc *= tl.load(scale_ptr + _weight_rows(pid_n, N, BLOCK_N, GATED))[:, None]
        if GATED:
            HALF: tl.constexpr = BLOCK_N // 2
            if HAS_BIAS:
                b = tl.load(bias_ptr + _weight_rows(pid_n, N, BLOCK_N, True))
                acc += b.to(tl.float32)[:, None]
            # Rounded as the product would store it, then gated in fp32 as
            # ``kernels.activation.silu_and_mul`` does.
            y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            gate, up = tl.split(tl.permute(tl.reshape(y, [2, HALF, BLOCK_M]), (1, 2, 0)))
            h = gate / (1.0 + tl.exp(-gate)) * up
            offs_h = pid_n * HALF + tl.arange(0, HALF)
            ptrs = out_ptr + offs_m[None, :] * stride_om + offs_h[:, None]
            mask = (offs_h[:, None] < N // 2) & (offs_m[None, :] < M)
            tl.store(ptrs, h.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            if HAS_BIAS:
                b = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
                acc += b.to(tl.float32)[:, None]
            ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
            mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
            tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _split_k_combine(
        acc, out_ptr, bias_ptr, scale_ptr, part_ptr, lock_ptr, pid_n, pid_k, splits, M, N,
        stride_om, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr,
        GATED: tl.constexpr, W_SCALED: tl.constexpr,
    ):  # fmt: skip
        """Publish this split's partial tile; the last split of the column block sums all
        of them in split order and writes the output (``split_k``)."""
        TILE: tl.constexpr = BLOCK_N * BLOCK_M
        cols = tl.arange(0, BLOCK_M)[None, :]
        idx = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + cols
        live = (idx >= 0) & (cols < M)  # padded rows of x are neither written nor read
        if publish_partial(acc, part_ptr, lock_ptr, pid_n, pid_k, splits, idx, live, TILE):
            total = sum_partials(acc, part_ptr, lock_ptr, pid_n, splits, idx, live, TILE)
            _store_output(total, out_ptr, bias_ptr, scale_ptr, pid_n, M, N, stride_om,
                          BLOCK_N, BLOCK_M, HAS_BIAS, GATED, W_SCALED)  # fmt: skip

    @triton.jit
    def _skinny_gemm_kernel(
        x_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, part_ptr, lock_ptr, M, N, K,
        stride_xm, stride_wn, stride_om, splits, k_per_split,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
        USE_DOT: tl.constexpr, USE_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
        ONE_TILE: tl.constexpr, GATED: tl.constexpr, W_SCALED: tl.constexpr,
    ):  # fmt: skip
        """``out[M, N] = x[M, K] @ w[N, K]^T (+ bias)``, times ``scale[N]`` per column where
        ``W_SCALED`` (FP8 weights); grid ``(cdiv(N, BLOCK_N) * splits,)``.
        ``GATED``: ``out[M, N/2]``, the SwiGLU gate of it; grid ``(cdiv(N/2, BLOCK_N/2) *
        splits,)``.

        The splits of one column block are adjacent program ids, so they run at the same
        time and their combine happens early rather than in a tail at the end.
        """
        pid = tl.program_id(0)
        pid_n = pid // splits
        pid_k = pid % splits
        k_start = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
        num_tiles = tl.cdiv(tl.minimum(k_per_split, K - k_start), BLOCK_K)
        if USE_PDL:
            # Let the next kernel's programs take free slots as ours retire; it waits for
            # our completion before it reads what we write.
            tl.extra.cuda.gdc_launch_dependents()
        if USE_DOT:
            if USE_PDL:
                tl.extra.cuda.gdc_wait()
            acc = _dot_mainloop(
                x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, pid_n, k_start, num_tiles,
                BLOCK_N, BLOCK_K, BLOCK_M, EVEN_K, DOT_PRECISION, GATED,
            )  # fmt: skip
        else:
            acc = _fma_mainloop(
                x_ptr, w_ptr, M, N, K, stride_xm, stride_wn, pid_n, k_start, num_tiles,
                BLOCK_N, BLOCK_K, BLOCK_M, EVEN_K, USE_PDL, ONE_TILE, GATED,
            )  # fmt: skip
        if USE_SPLIT:
            _split_k_combine(acc, out_ptr, bias_ptr, scale_ptr, part_ptr, lock_ptr, pid_n, pid_k,
                             splits, M, N, stride_om, BLOCK_N, BLOCK_M, HAS_BIAS, GATED,
                             W_SCALED)  # fmt: skip
        else:
            _store_output(acc, out_ptr, bias_ptr, scale_ptr, pid_n, M, N, stride_om,
                          BLOCK_N, BLOCK_M, HAS_BIAS, GATED, W_SCALED)  # fmt: skip

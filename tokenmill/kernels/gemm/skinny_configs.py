"""Launch configurations of the skinny GEMM (``skinny.py``): the tiles measured best on
an H200 for Llama-3.1-8B's batch-1 products, the reasoned default for other shapes, and the
split of K into slices.

Every decision depends on host integers only (M, N, K, the SM count), so a launch is fixed
before the kernel runs and CUDA graphs can capture it. ``skinny.py`` re-exports these
names; benchmarks that try other tiles patch ``TUNED_CONFIGS`` here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tokenmill.kernels.device import DEFAULT_NUM_SMS, num_sms  # noqa: F401 (re-exported)
from tokenmill.math_utils import cdiv

# Rows the CUDA-core main loop can take (one register accumulator per row; more would
# spill), and up to which the default configuration uses it: from 3 rows the accumulators
# and the re-read x (M / BLOCK_N of the weight bytes) cost more than padding M to 16 for
# the tensor cores.
FMA_MAX_M = 4
FMA_DEFAULT_MAX_M = 2
# Split-K heuristics: aim for this many programs per SM, give every split at least
# MIN_TILES_PER_SPLIT K-tiles, and let the fp32 partials (written and read back, mostly
# in L2) add at most PARTIAL_TRAFFIC_BUDGET of the weight bytes.
TARGET_PROGRAMS_PER_SM = 4
MIN_TILES_PER_SPLIT = 4
MAX_SPLIT_K = 16
PARTIAL_TRAFFIC_BUDGET = 0.1
# FP8 weights at one row take whole rows of K up to this many elements in one tile: on an H100
# the 28672 x 4096 gate/up product took 38.3 µs (0.92 of the weight-read floor) this way
# against 59.2 µs with 16 x 512 tiles (``fp8_gemm_bench.py --sweep``).
FP8_ONE_TILE_MAX_K = 4096
# The GPU TUNED_CONFIGS was measured on (a substring of torch.cuda.get_device_name()).
TUNED_GPU = "H200"


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch configuration of the skinny GEMM kernel.

    Attributes:
        block_n: outputs (rows of ``W``) per program; >= 16 when ``use_dot``.
        block_k: K elements per tile (per loop iteration); a power of two, >= 16.
        split_k: programs sharing one column block's K range (1: no split); the launch may
            use fewer so that no split is empty.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the tensor-core K loop (the CUDA-core loop
            always prefetches one tile ahead in registers).
        use_dot: tensor-core main loop (``tl.dot``); else CUDA cores, for M <= FMA_MAX_M.
    """

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    use_dot: bool


# Measured best configurations on an H200 (132 SMs), keyed by (M bucket, N, K) with the M
# bucket the next power of two of M: timed inside the batch-1 decode graph as dependent
# launches (``benchmarks/skinny_gemm_bench.py --pdl --sweep``,
# ``benchmarks/device/decode_ablation_bench.py --sweep-one-tile``; figures in
# benchmarks/RESULTS.md). Shapes not listed use ``default_config``, and under
# ``KernelConfig.skinny_gemm="auto"`` only the listed shapes leave cuBLAS.
TUNED_CONFIGS: dict[tuple[int, int, int], SkinnyConfig] = {
    # Llama-3.1-8B at batch 1, none split over K (no combine ends the product): the QKV,
    # output and gate/up projections and the LM head take whole weight rows in one tile,
    # which a program loads before it waits for the previous kernel; the down projection
    # 512-wide tiles.
    (1, 6144, 4096): SkinnyConfig(2, 4096, 1, 8, 1, False),
    (1, 4096, 4096): SkinnyConfig(4, 4096, 1, 4, 1, False),
    (1, 4096, 14336): SkinnyConfig(4, 512, 1, 8, 1, False),
    (1, 28672, 4096): SkinnyConfig(2, 4096, 1, 8, 1, False),
    (1, 128256, 4096): SkinnyConfig(4, 4096, 1, 4, 1, False),
}


def m_bucket(m: int) -> int:
    """The key under which ``TUNED_CONFIGS`` holds configurations for ``m`` rows."""
    return 1 << max(0, m - 1).bit_length()


@functools.lru_cache(maxsize=1024)
def default_config(m: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS,
                   weight_bytes: int = 2) -> SkinnyConfig:
    """The reasoned launch configuration for an ``[m, k] x [n, k]^T`` product with
    ``weight_bytes`` per weight (2 for bf16/fp16; 1 for FP8, whose tiles take twice the K
    elements so that each keeps the bytes and 16-byte loads described here).

    CUDA cores up to ``FMA_DEFAULT_MAX_M`` rows: 16 x 256 weight tiles (8 KB of bf16, one
    512-byte row segment per warp), 32 elements per thread with 4 warps at M = 1, 16 with
    8 warps at M = 2 (sm_90 compile: 94 and 80 registers, so 5 and 3 programs per SM, each
    with two tiles in flight: 80 and 48 KB per SM). Tensor cores above: 64 x 128 weight tiles
    (a ``wgmma`` M of 64 for 4 warps) and 4 stages of ~20 KB (80-96 KB of shared memory, 2
    programs per SM), so ~120 KB of loads are in flight per SM. The split count is the
    smallest power of two giving ``TARGET_PROGRAMS_PER_SM`` programs per SM, within the
    limits set at the top of this module.

    One FP8 row whose weight rows are at most ``FP8_ONE_TILE_MAX_K`` (a power of two): four
    whole weight rows per program in one tile (16 KB, 8 warps), loaded before the wait for
    the previous kernel, the layout the tuned bf16 table holds for these shapes.
    """
    if weight_bytes == 1 and m == 1 and 16 <= k <= FP8_ONE_TILE_MAX_K and not k & (k - 1):
        return SkinnyConfig(4, k, 1, 8, 1, False)
    if m <= FMA_DEFAULT_MAX_M:
        block_n, block_k, warps, stages, use_dot = 16, 256, (4 if m == 1 else 8), 1, False
    else:
        block_n, block_k, warps, stages, use_dot = 64, 128, 4, 4, True
    block_k = block_k * 2 // weight_bytes
    n_blocks = cdiv(n, block_n)
    max_split = min(
        MAX_SPLIT_K,
        max(1, cdiv(k, block_k) // MIN_TILES_PER_SPLIT),
        # round trip of s*M*N fp32 partials against w*N*K weight bytes: 8*s*M / (w*K)
        max(1, int(PARTIAL_TRAFFIC_BUDGET * weight_bytes * k / (8 * m))),
    )
    split = 1
    while split * 2 <= max_split and n_blocks * split < TARGET_PROGRAMS_PER_SM * num_sms:
        split *= 2
    return SkinnyConfig(block_n, block_k, split, warps, stages, use_dot)


def launch_config(m: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS) -> SkinnyConfig:
    """The tuned configuration for this shape on an H200 if there is one, else the default."""
    if num_sms == DEFAULT_NUM_SMS:
        tuned = TUNED_CONFIGS.get((m_bucket(m), n, k))
        if tuned is not None:
            return tuned
    return default_config(m, n, k, num_sms)


def has_tuned_config(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``TUNED_CONFIGS`` holds a configuration for ``x [M, K] @ weight[N, K]^T`` on
    x's device: an H200 (``TUNED_GPU`` in its name, ``DEFAULT_NUM_SMS`` multiprocessors), the
    GPU the table was measured on."""
    return (
        x.is_cuda
        and _is_tuned_gpu(x.device)
        and (m_bucket(x.shape[0]), weight.shape[0], weight.shape[1]) in TUNED_CONFIGS
    )


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _is_tuned_gpu(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return TUNED_GPU in _cuda_name(index) and num_sms(device) == DEFAULT_NUM_SMS


def split_plan(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """``(splits, k_per_split)``: K-slices of whole tiles, none of them empty.

    ``k_per_split`` is a multiple of ``block_k``; the last slice may be shorter.
    """
    tiles = cdiv(k, block_k)
    tiles_per_split = cdiv(tiles, max(1, min(split_k, tiles)))
    return cdiv(tiles, tiles_per_split), tiles_per_split * block_k


def block_m(m: int, use_dot: bool) -> int:
    """Rows of ``x`` per program, padded: a power of two, >= 16 for ``tl.dot``."""
    p = m_bucket(m)
    return max(16, p) if use_dot else p

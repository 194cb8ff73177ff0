"""Launch tables of the paged-attention kernels: tile shapes and key-split counts.

Every decision here depends on host integers only (batch shape, the longest context, the
SM count), so a step's launches are fixed before any kernel runs and CUDA graphs can
capture them. ``paged.py`` calls these through its own namespace, so benchmarks and tests
patch them there (``attention_bench.py --sweep-tiles``, ``--sweep-splits``). The
measurements behind the tables: benchmarks/RESULTS.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels.device import DEFAULT_NUM_SMS
from tokenmill.kernels.device import num_sms as device_num_sms  # noqa: F401 (re-exported)
from tokenmill.math_utils import cdiv

# Decode split heuristics: aim for this many resident programs per SM, never give a split
# fewer than MIN_SPLIT_TOKENS keys, and cap the reduction's width.
DECODE_PROGRAMS_PER_SM = 2
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
# Decode splits that merge themselves: counters for this many (decode, KV head) pairs
# (larger batches have enough pairs to run one split, or use the reduction launch); at most
# MERGE_SPLITS_PER_LOAD splits per merge load, and its [group, splits, head_dim] fp32 tile
# at most MERGE_TILE_ELEMS (32 registers a thread at 4 warps). Every decode variant carries
# the merge, so a larger tile would cost occupancy at every batch size (groups of 8 at
# head_dim 128 went from 160 to 222 registers with 8 splits per load).
MERGE_COUNTER_SLOTS = 1 << 16
MERGE_SPLITS_PER_LOAD = 8
MERGE_TILE_ELEMS = 4096
# Prompt-chunk KV splits: at most this many, and only while the chunks' query blocks leave
# SMs idle (see ``num_varlen_splits``).
VARLEN_MAX_SPLITS = 16
# Uniform grids: the prompt kernel's grid has room for this many requests after the leading
# decodes (each may end in a partial query block). A paced serving step has one or two.
UNIFORM_MAX_PREFILLS = 8
# Uniform grids up to this many tokens (a paced serving step: decodes + a short chunk) take
# the prompt kernel's short-chunk tiles (see ``varlen_tile_config``).
UNIFORM_SHORT_TOKENS = 384


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch options of one kernel.

    Attributes:
        block_m: query rows per program (query tokens x heads of one KV group); the varlen
            kernel packs ``block_m // group`` tokens. Unused by the decode kernel.
        block_n: keys per tile.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the key loop.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def varlen_tile_config(
    head_dim_padded: int, dtype: torch.dtype, uniform_tokens: int | None = None
) -> TileConfig:
    """Tiles of the prompt-chunk kernel for a power-of-two head size.

    128 x 64 tiles with 8 warps (two warpgroups of ``wgmma``) keep the Q tile, scores and
    accumulator in registers and three K/V stages (96 KiB at head_dim 128, bf16) in shared
    memory; head_dim 256 halves both tiles. fp32 runs its dot products on FMA units (exact,
    slow: a correctness path) and only 16 x 16 tiles fit its registers without spilling.
    Chosen from sm_90 compiles (no spills at head sizes 64..256, with and without window and
    soft cap) and ``benchmarks/attention_bench.py --sweep-tiles``.

    A whole-step graph of at most ``UNIFORM_SHORT_TOKENS`` tokens (``uniform_tokens``: the
    padded step; uniform grids have one key split) takes 64 x 128 tiles with 4 warps: twice
    the programs over a short chunk's query blocks, each with wider key tiles (faster for a
    short chunk after cached context; slower for a fresh long prompt, and for the
    non-uniform launches, which split a short chunk's keys instead).
    """
    if dtype == torch.float32:
        return TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    if head_dim_padded <= 128:
        if uniform_tokens is not None and uniform_tokens <= UNIFORM_SHORT_TOKENS:
            return TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=2)
        return TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    return TileConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)


# Decode tiles at head_dim 128 in 16 bits, each with the programs an SM holds at once. The
# kernel is register-bound (an SM has 64 Ki registers). sm_90 compiles (the H200's, and
# ptxas 12.8 from CPU, agree): 164 registers a thread at 4 warps, 240 at 2 and 255 at 1
# (32 bytes spilled), over 39 / 39 / 21 KiB of shared memory: 3, 4 and 8 programs per SM.
# With RoPE and the KV write in the kernel (``attend_decode_rotary``): 202 at 4 warps (2 per
# SM) and 255 at 2 (32 bytes spilled; 4 per SM); 1 warp spills 96 bytes, so it is left out.
DECODE_TILES_D128 = (
    (3, TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)),
    (4, TileConfig(block_m=16, block_n=64, num_warps=2, num_stages=3)),
    (8, TileConfig(block_m=16, block_n=32, num_warps=1, num_stages=4)),
)
DECODE_TILES_D128_ROPE = (
    (2, DECODE_TILES_D128[0][1]),
    (4, DECODE_TILES_D128[1][1]),
)
# With RoPE in the kernel, a first-wave grid whose contexts are spread over at least
# DECODE_MANY_SPLITS key splits (batch 1 with 8 KV heads: 33) takes 32-key tiles at 4
# warps (143 registers), where each split holds a few keys (batch-1 decode of
# Llama-3.1-8B: 51 us less per step at 160 tokens of context); grids of fewer splits keep
# 64-key tiles, where 32 keys lose.
DECODE_MANY_SPLITS = 32
DECODE_TILE_MANY_SPLITS_ROPE = TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=3)
# Past every tile's single wave, and in uniform grids (whole-step graphs, whose decode
# count is known only on the device): 2 warps, the fastest in waves of more programs.
DECODE_TILE_MANY_WAVES = DECODE_TILES_D128[1][1]


def decode_tile_config(
    head_dim_padded: int,
    dtype: torch.dtype,
    num_programs: int | None = None,
    num_sms: int = DEFAULT_NUM_SMS,
    uniform: bool = False,
    rope: bool = False,
    group_padded: int = 16,
    num_splits: int = 1,
) -> TileConfig:
    """Tiles of the decode kernel for a launch of ``num_programs`` programs.

    Decode attention streams each context once, so its time is the waves of resident
    programs it takes: one program more than the SMs hold costs a second wave of almost a
    whole program's time. So at head_dim 128 (16-bit) the first tile of
    ``DECODE_TILES_D128`` (``DECODE_TILES_D128_ROPE`` for the kernel that also rotates and
    writes the new K/V) whose single wave holds the grid is taken: fewer warps leave each
    program fewer loads in flight, so 4 warps are fastest while every tile fits. Past them
    all, and for uniform grids, ``DECODE_TILE_MANY_WAVES``. The rotating kernel's first
    wave takes ``DECODE_TILE_MANY_SPLITS_ROPE`` at ``DECODE_MANY_SPLITS`` splits or more.
    Other head sizes: 64 keys per tile (32 at head_dim 256), 4 warps; fp32 (FMA dot
    products) 16 keys per tile.

    Args:
        head_dim_padded: the head size rounded up to a power of two.
        dtype: the query's dtype.
        num_programs: the decode grid's programs (requests x splits x KV heads); None
            takes the 4-warp tile.
        num_sms: streaming multiprocessors.
        uniform: the grid covers every request row of a whole-step graph.
        rope: the launch rotates the query and key and writes the new K/V itself.
        group_padded: query heads per KV head, padded as the kernel's dot products take
            them (``GROUP_P``); the register counts above are at 16 (groups of up to 16),
            and larger groups keep the 4-warp tile.
        num_splits: key splits per (request, KV head) of the launch.
    """
    if dtype == torch.float32:
        return TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)
    by_waves = uniform or num_programs is not None
    if head_dim_padded == 128 and group_padded == 16 and by_waves:
        if not uniform:
            first_wave = DECODE_TILES_D128_ROPE[0][0] * num_sms
            if rope and num_splits >= DECODE_MANY_SPLITS and num_programs <= first_wave:
                return DECODE_TILE_MANY_SPLITS_ROPE
            for per_sm, tile in DECODE_TILES_D128_ROPE if rope else DECODE_TILES_D128:
                if num_programs <= per_sm * num_sms:
                    return tile
        return DECODE_TILE_MANY_WAVES
    block_n = 64 if head_dim_padded <= 128 else 32
    return TileConfig(block_m=16, block_n=block_n, num_warps=4, num_stages=3)


def num_decode_splits(
    num_reqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, max_splits: int = MAX_SPLITS
) -> int:
    """How many programs share one (request, KV head)'s context in the decode kernel.

    Enough to give every SM ``DECODE_PROGRAMS_PER_SM`` programs, but no split shorter than
    ``MIN_SPLIT_TOKENS`` keys and at most ``max_splits``. Depends only on host integers.
    """
    pairs = max(1, num_reqs * num_kv_heads)
    wanted = (DECODE_PROGRAMS_PER_SM * num_sms) // pairs
    useful = cdiv(max(1, max_seq_len), MIN_SPLIT_TOKENS)
    return max(1, min(wanted, useful, max_splits))


def merge_splits_per_load(group_padded: int, head_dim_padded: int) -> int:
    """``MERGE_S`` of the decode kernel for this group and head size (powers of two)."""
    return max(1, min(MERGE_SPLITS_PER_LOAD, MERGE_TILE_ELEMS // (group_padded * head_dim_padded)))


def num_prefix_splits(
    num_decodes: int, block_q: int, num_kv_heads: int, prefix_len: int, num_sms: int
) -> int:
    """How many programs share the shared prefix's keys in ``shared_prefix_kernel``: the
    (decode block, KV head) programs times the splits about fill the chip once, with no
    split shorter than ``MIN_SPLIT_TOKENS`` keys and at most ``VARLEN_MAX_SPLITS``."""
    busy = cdiv(num_decodes, block_q) * num_kv_heads
    useful = cdiv(max(1, prefix_len), MIN_SPLIT_TOKENS)
    return max(1, min(num_sms // max(1, busy), useful, VARLEN_MAX_SPLITS))


def num_varlen_splits(
    num_tokens: int,
    num_seqs: int,
    block_q: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
) -> int:
    """How many programs share each (query block, KV head)'s keys in the prompt kernel.

    A short chunk after a long context (a new turn of a conversation, a suffix after a
    cached prefix) has few query blocks, and each program walks the whole context alone:
    16 tokens after 2,000 cached ones make 8 programs for Llama-3.1-8B, on 132 SMs. Its
    keys are then split like flash-decoding's, so that the busy programs about fill the
    chip once (one prompt program per SM: its tiles take most of the shared memory), with
    no split shorter than ``MIN_SPLIT_TOKENS`` keys and at most ``VARLEN_MAX_SPLITS``.
    Long prompts keep one split. Depends only on host integers.

    Args:
        num_tokens: query tokens of the prompt requests.
        num_seqs: prompt requests.
        block_q: query tokens per program.
        num_kv_heads: KV heads (programs per query block).
        max_seq_len: the longest context of the prompt requests (tokens).
        num_sms: streaming multiprocessors.
    """
    busy = max(cdiv(num_tokens, block_q), num_seqs) * num_kv_heads
    useful = cdiv(max(1, max_seq_len), MIN_SPLIT_TOKENS)
    return max(1, min(num_sms // max(1, busy), useful, VARLEN_MAX_SPLITS))

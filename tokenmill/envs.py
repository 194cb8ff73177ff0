"""Every environment variable tokenmill reads, in one place (debug switches and paths)."""

from __future__ import annotations

import os


def _int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def cpu_threads() -> int:
    """TOKENMILL_CPU_THREADS: torch threads of a CPU worker; 0 = torch's default (all cores,
    or OMP_NUM_THREADS).

    Default: one less than the cores this process may run on (at least 1), which leaves a
    core to the server's front end (HTTP, tokenizing, detokenizing). NOTE: torch's OpenMP
    threads busy-wait at every barrier, so one more thread than there are free cores makes
    each step wait for a descheduled thread: with all cores on a 2-core machine and one other
    busy process, decode slowed ~3x (TPOT 288 vs 96 ms); see README.md for the figures. When
    OMP_NUM_THREADS is set it is honoured instead.
    """
    if os.environ.get("TOKENMILL_CPU_THREADS", "").strip():
        return _int("TOKENMILL_CPU_THREADS", 0)
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return 0
    return max(1, _num_usable_cores() - 1)


def _num_usable_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def compile_threads() -> int:
    """TOKENMILL_COMPILE_THREADS: threads that compile Triton kernels during start-up
    (``tokenmill.worker.parallel_compile``); 0 or 1 compiles each kernel at its first launch.

    Default: the usable cores, at most 16.
    """
    return _int("TOKENMILL_COMPILE_THREADS", min(16, _num_usable_cores()))


def cache_dir() -> str:
    """TOKENMILL_CACHE_DIR: where converted tokenizers are cached (~/.cache/tokenmill)."""
    return os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tokenmill"
    )


def api_key() -> str | None:
    """TOKENMILL_API_KEY: the server's API key when --api-key is not given."""
    return os.environ.get("TOKENMILL_API_KEY") or None


def max_request_body_bytes() -> int:
    """TOKENMILL_MAX_REQUEST_BODY_BYTES: the largest request body the server accepts, in
    bytes; larger ones get a 413. 0 turns the limit off.

    Default: 128 MiB, far above any one request's tokens (a 128k-token prompt as text or as
    token ids is about 1 MB) and below what a body read whole and parsed may cost in memory.
    """
    return _int("TOKENMILL_MAX_REQUEST_BODY_BYTES", 128 << 20)


def gguf_dequantize() -> bool:
    """TOKENMILL_GGUF_DEQUANTIZE=1: load GGUF weights dequantized to the model's dtype (the
    float reference path, for comparisons) instead of keeping them in their blocks."""
    return os.environ.get("TOKENMILL_GGUF_DEQUANTIZE", "") not in ("", "0")


def log_step_stats() -> bool:
    """TOKENMILL_LOG_STEP_STATS=1: every 5 s the engine logs step durations, sizes and any
    Triton kernels compiled; the server logs its event-loop lag and front-end stage times."""
    return os.environ.get("TOKENMILL_LOG_STEP_STATS", "") not in ("", "0")


# Spellings of on and off that the kernel switches below accept (lower-cased, stripped).
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def skinny_gemm() -> str:
    """TOKENMILL_SKINNY_GEMM: which linear layers of decode-sized batches (<= 32 rows) on
    CUDA run the split-K Triton kernel instead of cuBLAS, as ``"auto"``, ``"0"`` or ``"1"``.
    ``auto`` (default, also when empty): the shapes with a configuration measured faster
    than cuBLAS on this GPU model (``skinny_gemm_configs.TUNED_CONFIGS``: batch-1 decode of
    Llama-3.1-8B on an H200, see benchmarks/RESULTS.md); ``1`` (or true/yes/on): every
    eligible shape; ``0`` (or false/no/off): none.

    Raises:
        ValueError: any other value.
    """
    value = os.environ.get("TOKENMILL_SKINNY_GEMM", "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in _ON:
        return "1"
    if value in _OFF:
        return "0"
    raise ValueError(f"TOKENMILL_SKINNY_GEMM must be auto, 0 or 1, got {value!r}")


def pdl() -> bool:
    """TOKENMILL_PDL=0: launch the step's normalisation, activation, rotary/KV-write and
    decode-attention Triton kernels as ordinary launches instead of programmatic dependent
    launches on sm_90+ (``model/layers/pdl.py``; on by default, off to compare)."""
    return os.environ.get("TOKENMILL_PDL", "").strip().lower() not in _OFF


def fused_sampler() -> bool:
    """TOKENMILL_FUSED_SAMPLER=0: sample on CUDA through the torch route (shift, scale,
    noise, argmax as separate kernels over float32 copies) instead of the fused Gumbel-max
    kernel (``worker/gumbel_sampling.py``; on by default, off to compare)."""
    return os.environ.get("TOKENMILL_FUSED_SAMPLER", "1") not in ("", "0")


def sampled_copy_stream() -> bool:
    """TOKENMILL_SAMPLED_COPY_STREAM=0: copy each async step's sampled tokens to the host on
    the compute stream instead of a side stream (on by default: the next step's work then
    does not queue behind that copy; Llama-3.1-8B at batch 1 on an H200, 0.2% less time per
    token, RESULTS.md twenty-fifth set)."""
    return os.environ.get("TOKENMILL_SAMPLED_COPY_STREAM", "").strip().lower() not in _OFF


def sort_free_top_p() -> bool:
    """TOKENMILL_SORT_FREE_TOP_P=0: on CUDA, find each row's top-p cut-off by sorting the
    vocabulary instead of the radix select over the logits (``worker/top_p_select.py``; on
    by default, off to compare)."""
    return os.environ.get("TOKENMILL_SORT_FREE_TOP_P", "").strip().lower() not in _OFF


def short_decode_graphs() -> bool:
    """TOKENMILL_SHORT_DECODE_GRAPHS=1: also capture decode graphs for batches of at most
    ``cuda_graph.SHORT_DECODE_MAX_BATCH`` requests whose contexts all fit one key split
    (``cuda_graph.SHORT_DECODE_CONTEXT`` tokens), which launch no split reduction (off by
    default until measured on a GPU)."""
    return os.environ.get("TOKENMILL_SHORT_DECODE_GRAPHS", "").strip().lower() in _ON


def rope_in_decode_attention() -> bool:
    """TOKENMILL_ROPE_IN_DECODE_ATTENTION=0: in decode-only steps on CUDA, rotate the query
    and key and write the new K/V in a separate rotary/KV-write launch per layer instead of
    inside the decode attention kernel (``TritonAttentionImpl.attend_decode_rotary``; on by
    default: Llama-3.1-8B at batch 1 on an H200, 75 us less per step, RESULTS.md fifteenth
    set)."""
    return os.environ.get("TOKENMILL_ROPE_IN_DECODE_ATTENTION", "").strip().lower() not in _OFF


def gated_product() -> bool:
    """TOKENMILL_GATED_PRODUCT=0: where the gate/up product of a SiLU-gated MLP runs the
    skinny GEMM (decode-sized batches on CUDA), apply SiLU-and-mul in a separate launch
    instead of in the product's epilogue (``skinny_gemm.skinny_linear(gated=True)``, on by
    default: 38 us less per batch-1 decode step of Llama-3.1-8B on an H200)."""
    return os.environ.get("TOKENMILL_GATED_PRODUCT", "").strip().lower() not in _OFF


def decode_split_self_merge() -> bool:
    """TOKENMILL_DECODE_SPLIT_SELF_MERGE=0: merge the decode kernel's key splits in a
    separate reduction launch per layer instead of in the last split to finish (on by
    default; ``triton_decode.decode_attention_kernel``, ``MERGE_S``)."""
    return os.environ.get("TOKENMILL_DECODE_SPLIT_SELF_MERGE", "").strip().lower() not in _OFF


def decode_tiles_by_waves() -> bool:
    """TOKENMILL_DECODE_TILES_BY_WAVES=0: the decode attention kernel keeps its 4-warp tile
    at every batch size instead of the tile whose single wave of resident programs holds
    its grid (on by default; ``triton_launch.decode_tile_config``)."""
    return os.environ.get("TOKENMILL_DECODE_TILES_BY_WAVES", "").strip().lower() not in _OFF


def mixed_step_graphs() -> bool:
    """TOKENMILL_MIXED_STEP_GRAPHS=0: replay steps with prompt tokens through the piecewise
    graphs (attention eager between pieces) instead of whole-step graphs (default: on where
    the attention backend supports them; ``worker/mixed_graph.py``)."""
    return os.environ.get("TOKENMILL_MIXED_STEP_GRAPHS", "1") not in ("", "0")


def fused_rope_cache() -> bool:
    """TOKENMILL_FUSED_ROPE_CACHE=0: apply the rotary embedding and write the KV cache in two
    launches per layer instead of one (on by default; off to compare)."""
    return os.environ.get("TOKENMILL_FUSED_ROPE_CACHE", "1") not in ("", "0")

"""Every environment variable tokenmill reads, in one place (debug switches and paths)."""

from __future__ import annotations

import os


def _int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def cpu_threads() -> int:
    """TOKENMILL_CPU_THREADS: torch threads of a CPU worker (0 = torch's default)."""
    return _int("TOKENMILL_CPU_THREADS", 0)


def cache_dir() -> str:
    """TOKENMILL_CACHE_DIR: where converted tokenizers are cached (~/.cache/tokenmill)."""
    return os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tokenmill"
    )


def api_key() -> str | None:
    """TOKENMILL_API_KEY: the server's API key when --api-key is not given."""
    return os.environ.get("TOKENMILL_API_KEY") or None


def log_step_stats() -> bool:
    """TOKENMILL_LOG_STEP_STATS=1: the engine logs step durations and sizes every 5 s."""
    return os.environ.get("TOKENMILL_LOG_STEP_STATS", "") not in ("", "0")


def skinny_gemm() -> bool:
    """TOKENMILL_SKINNY_GEMM=0/1: the split-K Triton kernel for linear layers of decode-sized
    batches (<= 32 rows) on CUDA, instead of cuBLAS (default: off; on an H200 cuBLAS inside
    a CUDA graph is faster at Llama-3.1-8B's shapes, see benchmarks/RESULTS.md)."""
    return os.environ.get("TOKENMILL_SKINNY_GEMM", "0") not in ("", "0")

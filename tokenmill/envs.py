"""Every environment variable tokenmill reads, in one place: the server's API key and body
limit, paths, thread counts, a diagnostic log and Ray's cluster address; each is
documented in README.md.

Choices a user makes about the engine are configuration (``tokenmill.config``, CLI flags),
kernel choices included (``KernelConfig``); model and kernel code never reads the
environment (``tests/test_architecture.py``).
"""

from __future__ import annotations

import os


def _int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def cpu_threads() -> int:
    """TOKENMILL_CPU_THREADS: torch threads of a CPU worker; 0 = torch's default (all cores,
    or OMP_NUM_THREADS).

    Default: the cores this process may run on (its affinity mask). NOTE: torch's OpenMP
    threads busy-wait at every barrier, so where another busy process shares the cores, a
    thread per core makes each step wait for a descheduled thread (README.md "CPU threads"
    has the figures); set this to the free cores there. When OMP_NUM_THREADS is set it is
    honoured instead.
    """
    if os.environ.get("TOKENMILL_CPU_THREADS", "").strip():
        return _int("TOKENMILL_CPU_THREADS", 0)
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return 0
    return _num_usable_cores()


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


def allow_runtime_lora_updating() -> bool:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (vLLM's switch, as vLLM reads it: true or 1):
    the server serves POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


def log_step_stats() -> bool:
    """TOKENMILL_LOG_STEP_STATS=1: every 5 s the engine logs step durations, sizes and any
    Triton kernels compiled; the server logs its event-loop lag and front-end stage times."""
    return os.environ.get("TOKENMILL_LOG_STEP_STATS", "") not in ("", "0")


def ray_address() -> str | None:
    """RAY_ADDRESS: the Ray cluster the Ray executor joins (``host:port``, ``ray://host:port``
    or ``auto``), as Ray and vLLM read it; unset, the executor starts a local cluster."""
    return os.environ.get("RAY_ADDRESS") or None

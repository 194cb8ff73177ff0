"""Host memory for the KV cache: zero-filled tensors whose pages the kernel supplies on
first touch, and how much memory a CPU KV cache may take."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap

import torch

from tokenmill.config import ConfigError

GiB = 1 << 30


def lazily_zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros backed by an anonymous memory map.

    ``torch.zeros`` writes every byte up front: a 4 GiB KV cache took 10-17 s of start-up on
    a 2-core machine, almost all of it page faults. An anonymous map reads as zeros by
    definition (POSIX ``mmap`` with ``MAP_ANONYMOUS``), and each page is only faulted in when
    first written, so the cost moves to the blocks actually used. The tensor keeps the map
    alive; it is released with the tensor.

    Args:
        shape: the tensor's shape.
        dtype: its element type.

    Returns:
        A zero tensor of ``shape`` and ``dtype`` on the CPU, page-aligned.
    """
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of ``shape`` and ``dtype`` on ``device``: lazily zeroed on the CPU
    (``lazily_zeroed_cpu_tensor``), ``torch.zeros`` elsewhere."""
    if device.type == "cpu":
        return lazily_zeroed_cpu_tensor(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def available_host_memory() -> int | None:
    """Bytes of memory available to new allocations: Linux's ``MemAvailable``, or less
    where this process's cgroup (v2: ``memory.max`` - ``memory.current``, a container's
    limit) leaves less; None where the system says neither."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        if limit != "max":
            left = max(0, int(limit) - current)
            available = left if available is None else min(available, left)
    except (OSError, ValueError):
        pass
    return available


def check_host_memory(kv_bytes: int) -> None:
    """Refuse a CPU KV cache larger than the memory available now: its pages are only
    taken as blocks fill (``lazily_zeroed_cpu_tensor``), so an oversized cache would start
    and then be killed for memory under load."""
    available = available_host_memory()
    if available is not None and kv_bytes > available:
        raise ConfigError(
            f"the KV cache would take {kv_bytes / GiB:.2f} GiB, but only "
            f"{available / GiB:.2f} GiB of memory is available; lower --kv-cache-memory"
        )


def release_free_host_memory() -> None:
    """Return the C heap's free memory to the operating system (glibc's ``malloc_trim``),
    so that freed tensors leave the process's resident memory; a no-op elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass

"""Zero-filled host tensors whose pages the kernel supplies on first touch."""

from __future__ import annotations

import math
import mmap

import torch


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

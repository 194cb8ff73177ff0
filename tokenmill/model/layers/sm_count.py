"""Streaming multiprocessors of a device: the launch heuristics of the Triton kernels (skinny
GEMM tiles and splits, attention key splits) size their grids by it."""

from __future__ import annotations

import functools

import torch

# SMs of an H200 (and H100 SXM); used when the tensors are not on CUDA (interpreter), and
# the count the skinny GEMM's tuned configurations were measured at.
DEFAULT_NUM_SMS = 132


@functools.cache
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """The device's SM count (``DEFAULT_NUM_SMS`` off CUDA)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())

"""Device facts the kernels' launch heuristics need: the SM count, whether Triton runs a
tensor's kernels, and zeroed counters for reductions inside one launch."""

from __future__ import annotations

import functools

import torch

try:
    import triton

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False

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


def use_triton(x: torch.Tensor) -> bool:
    """Whether a layer runs its Triton kernel on ``x``: a CUDA tensor, with Triton installed
    (elsewhere layers run their torch code, which is also the kernels' reference)."""
    return HAS_TRITON and x.is_cuda


def triton_can_run(x: torch.Tensor) -> bool:
    """Whether a Triton kernel can take ``x`` at all: a CUDA tensor, or any tensor under
    Triton's interpreter (``TRITON_INTERPRET=1``, as Triton reads it), Triton installed."""
    return HAS_TRITON and (x.is_cuda or bool(triton.knobs.runtime.interpret))


class DeviceCounters(dict[torch.device, torch.Tensor]):
    """Zeroed int32 counters per device for "last block" reductions inside one launch.

    A kernel whose programs each publish a partial result and then count themselves on a
    counter lets the program that arrives last combine the partials and reset the counter
    to zero (CUDA's threadFenceReduction sample; CUTLASS's serial split-K): the skinny
    GEMM's split-K combine and the decode attention kernel's split merge work this way.
    The counters must be zero before every launch, including CUDA-graph replays, so each
    launch leaves them at zero and they are created once, outside graph capture: a
    zero-fill recorded into one graph would not run before another graph's replay.
    Launches that share a device's counters must not run concurrently (one stream at a
    time).
    """

    def get_or_create(self, device: torch.device, slots: int) -> torch.Tensor | None:
        """The device's ``[slots]`` counters, created zeroed by the first call outside graph
        capture; None while a graph is being captured before they exist (the caller then
        takes a path without them)."""
        counters = self.get(device)
        if counters is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            counters = self[device] = torch.zeros(slots, dtype=torch.int32, device=device)
            if device.type == "cuda":  # once: later launches may come from other streams
                torch.cuda.current_stream(device).synchronize()
        return counters

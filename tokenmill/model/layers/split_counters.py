"""Arrival counters for kernels whose last program combines the others' partial results.

A split-K product (``skinny_gemm.py``) and a split decode attention
(``attention/triton_kernels.py``) write fp32 partials, then each program increments the
counter of its output block; the program that arrives last merges the partials and resets
the counter to zero (the "last block" pattern of CUDA's threadFenceReduction sample). One
zero-initialised int32 buffer per device serves every such kernel: each launch leaves it at
zero, and launches on one stream never overlap (a dependent launch waits for its
predecessor before it touches memory), so kernels that run one after another can share it.
"""

from __future__ import annotations

import torch

# Counters per device: one per output block of a launch.
SLOTS = 1 << 14

COUNTERS: dict[torch.device, torch.Tensor] = {}


def device_counters(device: torch.device) -> torch.Tensor | None:
    """The device's ``[SLOTS]`` int32 counters, created by its first call outside graph
    capture; None (run without splits) when a graph is being captured before that: a
    zero-fill recorded into one graph would not run before another graph's replay."""
    counters = COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = COUNTERS[device] = torch.zeros(SLOTS, dtype=torch.int32, device=device)
        if device.type == "cuda":  # once: later launches may come from other streams
            torch.cuda.current_stream(device).synchronize()
    return counters

"""Zeroed int32 counters per device for "last block" reductions inside one launch.

A kernel whose programs each publish a partial result and then count themselves on a
counter lets the program that arrives last combine the partials and reset the counter to
zero (CUDA's threadFenceReduction sample; CUTLASS's serial split-K): the skinny GEMM's
split-K combine and the decode attention kernel's split merge work this way. The counters
must be zero before every launch, including CUDA-graph replays, so each launch leaves them
at zero and they are created once, outside graph capture: a zero-fill recorded into one
graph would not run before another graph's replay. Launches that share a device's counters
must not run concurrently (one stream at a time).
"""

from __future__ import annotations

import torch


class DeviceCounters(dict[torch.device, torch.Tensor]):
    """int32 counters per device, created zeroed by the first call outside graph capture."""

    def get_or_create(self, device: torch.device, slots: int) -> torch.Tensor | None:
        """The device's ``[slots]`` counters; None while a graph is being captured before
        they exist (the caller then takes a path without them)."""
        counters = self.get(device)
        if counters is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            counters = self[device] = torch.zeros(slots, dtype=torch.int32, device=device)
            if device.type == "cuda":  # once: later launches may come from other streams
                torch.cuda.current_stream(device).synchronize()
        return counters

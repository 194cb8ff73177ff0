"""Programmatic dependent launches (PDL) for the Triton kernels of a step.

A kernel launched this way may be scheduled while the previous kernel of its stream is
still running; it waits for that kernel's completion and memory flush (PTX
``griddepcontrol.wait``) before it touches anything, and lets the next launch be scheduled
early (``griddepcontrol.launch_dependents``). In a chain of small kernels, as a batch-1
decode step is (about ten per layer, 1-5 us each), this hides each launch's latency behind
the previous kernel. CUDA Programming Guide, "Programmatic Dependent Launch and
Synchronization"; sm_90 and up.

Because every such kernel waits before its first store, and before any load of what an
earlier kernel of the step writes, the chain keeps stream order: a kernel that completed
implies its predecessor completed. Only the decode attention kernel loads anything before
its wait: the batch layout, the block table and earlier tokens' KV, which the host and
earlier steps wrote (``allow_next_grid`` / ``wait_for_prior_results``; a step in which a
request reads KV that the same step writes turns that off). Kernels launched without PDL
(cuBLAS, torch) simply start after their predecessor, as always.

The normalisation, activation, rotary/KV-write and decode-attention kernels launch this
way wherever the device supports it, as the skinny GEMM does (``gemm/skinny.py``).
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be dependent launches: an NVIDIA GPU of compute
    capability 9.0 or more with Triton (never under Triton's interpreter: CPU tensors; never
    on ROCm, whose devices are also ``cuda`` to torch and report gfx9 as capability 9)."""
    if not (HAS_TRITON and device.type == "cuda") or torch.version.hip is not None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability_major(index) >= 9


def launch_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a Triton launch on ``device``: the kernel's ``USE_PDL``
    constexpr and, where ``supported``, Triton's ``launch_pdl`` launch option."""
    if supported(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


if HAS_TRITON:

    @triton.jit
    def wait_for_prior_grid(USE_PDL: tl.constexpr):
        """The first statement of a kernel that may be a dependent launch: let the next
        launch be scheduled, then wait for the previous kernel's results."""
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def allow_next_grid(USE_PDL: tl.constexpr):
        """Let the next launch be scheduled now. A kernel that reads, before
        ``wait_for_prior_results``, what no kernel of the step writes (the block table, the
        sequence lengths, earlier tokens' cache rows: all written before the step's first
        kernel) starts with this instead of ``wait_for_prior_grid``."""
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def wait_for_prior_results(USE_PDL: tl.constexpr):
        """Wait for the previous kernel's completion and memory flush; every load of what
        an earlier kernel of the step wrote, and every store, comes after this, and so does
        every program's exit: a grid whose programs all left without waiting could complete
        before its predecessor, and the next kernel's wait would not cover that one."""
        if USE_PDL:
            tl.extra.cuda.gdc_wait()

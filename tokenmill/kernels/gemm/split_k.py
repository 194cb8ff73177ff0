"""Split-K combined inside one launch (the skinny GEMM's; ``kernels.gemm.skinny``).

A product whose output tiles are too few to fill the GPU splits its reduction dimension K
over several programs per tile. Each program writes its float32 partial tile to a
workspace and counts itself on the tile's counter; the program that arrives last sums the
partials in split order (deterministic, unlike float atomics), writes the output in its
dtype and resets the counter (CUDA's threadFenceReduction "last block" pattern; CUTLASS's
serial split-K). Against float32 atomics into a zeroed buffer this saves two launches per
product (the zero fill and the cast back to the activations' dtype) and gives the same
result at every batch composition; the last program's serial sum costs one L2 round trip
per split.

Use in a kernel::

    if publish_partial(acc, part_ptr, lock_ptr, tile, pid_k, splits, idx, live, TILE):
        total = sum_partials(acc, part_ptr, lock_ptr, tile, splits, idx, live, TILE)
        ...store total...

``idx`` is each accumulator element's offset inside its tile (``acc``'s shape, values in
``[0, TILE)``), ``live`` which elements exist (rows past M are neither written nor read).
The host side: ``counters(device)`` (None while a graph is captured before they exist: the
caller then launches without split-K) and a ``[tiles * splits * TILE]`` float32 workspace
per launch (``torch.empty``; under graph capture it comes from the graph's pool).
Launches that share the counters must not run concurrently (one stream at a time).
"""

from __future__ import annotations

import torch

from tokenmill.kernels.device import HAS_TRITON, DeviceCounters

# Counters per device (int32): the output tiles of one split launch must fit.
COUNTER_SLOTS = 1 << 14

_COUNTERS = DeviceCounters()


def counters(device: torch.device) -> torch.Tensor | None:
    """The device's ``[COUNTER_SLOTS]`` zeroed counters (see ``DeviceCounters``)."""
    return _COUNTERS.get_or_create(device, COUNTER_SLOTS)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def publish_partial(acc, part_ptr, lock_ptr, tile, pid_k, splits, idx, live,
                        TILE: tl.constexpr):  # fmt: skip
        """Store this split's partial ``acc`` of output tile ``tile``; True in the program
        that arrives last (it then owns the combine)."""
        base = part_ptr + tile.to(tl.int64) * splits * TILE + idx
        # .cg: partials go to L2, the one level every SM sees coherently.
        tl.store(base + pid_k * TILE, acc, mask=live, cache_modifier=".cg")
        # Every thread's partial store precedes the counter update (bar.sync), which is a
        # release at GPU scope; the last program's acquire orders its loads after it.
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        return arrived == splits - 1

    @triton.jit
    def sum_partials(acc, part_ptr, lock_ptr, tile, splits, idx, live, TILE: tl.constexpr):
        """The partials of ``tile`` summed in split order (float32, ``acc``'s shape); leaves
        the tile's counter at zero for the next launch."""
        base = part_ptr + tile.to(tl.int64) * splits * TILE + idx
        total = tl.zeros_like(acc)
        for s in range(0, splits):
            total += tl.load(base + s * TILE, mask=live, other=0.0, cache_modifier=".cg")
        # Kernel boundaries order this reset before the next launch's counting.
        tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed", scope="gpu")
        return total

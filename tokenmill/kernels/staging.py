"""The scatter of a step's staged inputs: one launch copies every array of the one
host-to-device copy (``worker/step_staging.py``) into its persistent device buffer.

The staged buffer is int32 words: a header of descriptors of ``DESC_WORDS`` words,
``(kind, src, dst, rows, width, dst_stride)`` in 4-byte words (``COPY``: copy ``rows x
width`` words to ``dst + r * dst_stride + c``; ``TOKENS``: ``width`` int64 token ids, an
id ``-(i + 1)`` replaced by entry ``i`` of the previous step's sampled tokens, offsets
still in words), then the arrays.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.device import HAS_TRITON
from tokenmill.math_utils import cdiv

if HAS_TRITON:
    import triton
    import triton.language as tl

DESC_WORDS = 6
COPY, TOKENS = 0, 1
UNPACK_BLOCK = 1024  # words (or token ids) per program

Segment = tuple[int, int, int, int, int, int]


def unpack(
    staged: torch.Tensor, arena: torch.Tensor, sampled: torch.Tensor, segments: list[Segment]
) -> None:
    """Scatter the staged arrays into the arena in one launch.

    Args:
        staged: int32 words on the device, the header's descriptors first.
        arena: int32 words of the persistent buffers.
        sampled: ``[k]`` int64, the previous step's sampled tokens (``TOKENS`` entries
            ``-(i + 1)`` read entry ``i``).
        segments: the header's descriptors, as the host wrote them (only their count and
            sizes are read here, for the grid).
    """
    longest = max(rows * width for _, _, _, rows, width, _ in segments)
    _unpack_kernel[(len(segments), cdiv(longest, UNPACK_BLOCK))](
        staged, arena, sampled, BLOCK=UNPACK_BLOCK
    )


def unpack_reference(
    staged: torch.Tensor,
    arena: torch.Tensor,
    sampled: torch.Tensor,
    segments: list[tuple[int, int, int, int, int, int]],
) -> None:
    """What the unpack kernel does, in torch ops that never wait for the device: ``staged``
    and ``arena`` are int32 word tensors, ``sampled`` int64, ``segments`` the descriptors
    (as the header holds them)."""
    last = sampled.shape[0] - 1
    for kind, src, dst, rows, width, stride in segments:
        if kind == TOKENS:
            ids = staged[src : src + 2 * width].view(torch.int64)
            fed = sampled[(-ids - 1).clamp(0, last)]
            arena[dst : dst + 2 * width].view(torch.int64).copy_(torch.where(ids < 0, fed, ids))
            continue
        values = staged[src : src + rows * width].view(rows, width)
        target = arena.as_strided((rows, width), (stride, 1), arena.storage_offset() + dst)
        target.copy_(values)


if HAS_TRITON:

    @triton.jit
    def _unpack_kernel(staged_ptr, arena_ptr, sampled_ptr, BLOCK: tl.constexpr):
        """Program ``(s, c)`` writes chunk ``c`` of segment ``s`` (see the module
        docstring); chunks past the segment's end do nothing."""
        seg = tl.program_id(0)
        desc = staged_ptr + seg * 6  # DESC_WORDS
        kind = tl.load(desc)
        src = tl.load(desc + 1).to(tl.int64)
        dst = tl.load(desc + 2).to(tl.int64)
        rows = tl.load(desc + 3)
        width = tl.load(desc + 4)
        stride = tl.load(desc + 5).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if kind == 1:
            mask = offs < width
            src64 = (staged_ptr + src).to(tl.pointer_type(tl.int64))
            dst64 = (arena_ptr + dst).to(tl.pointer_type(tl.int64))
            ids = tl.load(src64 + offs, mask=mask, other=0)
            fed = ids < 0
            prev = tl.load(sampled_ptr + (-ids - 1), mask=mask & fed, other=0)
            tl.store(dst64 + offs, tl.where(fed, prev, ids), mask=mask)
        else:
            mask = offs < rows * width
            values = tl.load(staged_ptr + src + offs, mask=mask)
            row = offs // width
            tl.store(arena_ptr + dst + row * stride + (offs - row * width), values, mask=mask)

"""One host-to-device copy per step: a step's inputs packed into one pinned buffer.

A step's inputs are a dozen small arrays: token ids, positions, slot mapping, query starts,
context lengths, block-table rows, the rows that sample, the sampler's per-row parameters.
Copied one by one, each is its own copy on the stream, and consecutive small copies start
microseconds apart, a visible share of a batch-1 decode step
(``benchmarks/device/step_timeline.py``).

Here the host packs the arrays back to back into one pinned buffer (``StepStaging.put``),
which is copied with one call (``flush``). One kernel then scatters the arrays that CUDA
graphs read at fixed addresses into their persistent buffers in the device arena
(``put_into``), replacing each token id staged as ``-(i + 1)`` by entry ``i`` of the
previous step's sampled tokens, which only the device has yet under async scheduling.
Arrays read only by eager kernels (the sampler's parameters, the rows that sample) are
used where the copy put them: ``put`` returns their device view.

Layout of the staged buffer: a header of ``MAX_SEGMENTS`` descriptors of six int32 words,
``(kind, src, dst, rows, width, dst_stride)`` in 4-byte words (``kind`` 0: copy
``rows x width`` words to ``dst + r * dst_stride + c``; 1: ``width`` int64 token ids
resolved as above, offsets still in words), then the arrays, each 16-byte aligned.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.kernels.device import HAS_TRITON
from tokenmill.kernels.staging import COPY, DESC_WORDS, TOKENS, unpack, unpack_reference
from tokenmill.math_utils import cdiv

MAX_SEGMENTS = 16
HEADER_BYTES = MAX_SEGMENTS * DESC_WORDS * 4
ALIGN = 16  # bytes: every array starts aligned for any element type


class DeviceArena:
    """Persistent device buffers carved out of one int32 tensor, so that one kernel can
    address them all by word offset.

    Args:
        specs: ``(shape, dtype)`` per buffer; dtypes of 4 or 8 bytes.
        device: where the arena lives.
    """

    def __init__(self, specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device):
        offsets, words = [], 0
        for shape, dtype in specs:
            offsets.append(words)
            n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size() // 4
            words += cdiv(n, ALIGN // 4) * (ALIGN // 4)
        self.words = torch.zeros(max(words, 1), dtype=torch.int32, device=device)
        self.buffers = [
            self.words[off : off + int(np.prod(shape)) * _word_ratio(dtype)].view(dtype).view(shape)
            for off, (shape, dtype) in zip(offsets, specs, strict=True)
        ]

    def word_offset(self, view: torch.Tensor) -> int:
        """``view``'s first element, in int32 words from the arena's start.

        Raises:
            ValueError: ``view`` is not a view of this arena.
        """
        if view.untyped_storage().data_ptr() != self.words.untyped_storage().data_ptr():
            raise ValueError("not a view of the device arena")
        return view.storage_offset() * view.element_size() // 4


def _word_ratio(dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    if size not in (4, 8):
        raise ValueError(f"arena buffers hold 4- or 8-byte elements, not {dtype}")
    return size // 4


class StepStaging:
    """Packs one step's host arrays for one copy to the device (see the module docstring).

    Two pinned host buffers alternate between steps: under async scheduling the host packs
    step n+1 while step n's copy may not have run yet; before it packs into a buffer it waits
    for that buffer's last copy (two steps back) to end, which steps that sample nothing
    (prompt chunks) would not otherwise guarantee. The device buffers alternate too: on
    CUDA the copy runs on a side stream, ahead of the compute stream, which waits for it
    only before the scatter; a copy into a device buffer waits for the compute stream to
    pass the step that last read it (two steps back). Off CUDA everything is in order.

    Args:
        capacity: bytes of arrays a step may stage (the header comes on top).
        arena: the persistent buffers that ``put_into`` targets.
        device: the device.
        use_kernel: scatter with the Triton kernel (default: on CUDA when Triton is
            installed) rather than ``unpack_reference``'s torch copies.
    """

    def __init__(
        self,
        capacity: int,
        arena: DeviceArena,
        device: torch.device,
        use_kernel: bool | None = None,
    ) -> None:
        self.arena = arena
        self.device = device
        size = HEADER_BYTES + capacity + ALIGN * 64
        cuda = device.type == "cuda"
        self._hosts = [torch.zeros(size, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self._host_nps = [h.numpy() for h in self._hosts]
        self._staged = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(2)]
        self.staged = self._staged[0]
        self._copy_stream = torch.cuda.Stream(device=device) if cuda else None
        # Per device buffer: the compute stream's event after the last step that read it;
        # per pinned buffer: the end of its last copy.
        self._read: list[torch.cuda.Event | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        if use_kernel is None:
            use_kernel = cuda and HAS_TRITON
        self._use_kernel = use_kernel
        self._parity = 0
        self._cursor = HEADER_BYTES
        self._segments: list[tuple[int, int, int, int, int, int]] = []

    def begin(self) -> None:
        """Start packing a new step (into the other pinned and device buffers); waits for
        the last copy out of that pinned buffer, normally long done."""
        self._parity ^= 1
        copied = self._copied[self._parity]
        if copied is not None:
            copied.synchronize()
        self.staged = self._staged[self._parity]
        self._cursor = HEADER_BYTES
        self._segments = []

    def _append(self, values: np.ndarray) -> int:
        """Copy ``values`` into the pinned buffer; returns its byte offset."""
        values = np.ascontiguousarray(values)
        off, end = self._cursor, self._cursor + values.nbytes
        host = self._host_nps[self._parity]
        if end > len(host):
            raise RuntimeError(f"step inputs of {end} bytes overflow the {len(host)}-byte staging")
        host[off:end] = values.reshape(-1).view(np.uint8)
        self._cursor = cdiv(end, ALIGN) * ALIGN
        return off

    def put(self, values: np.ndarray) -> torch.Tensor:
        """Stage ``values``; returns the device tensor (same dtype and shape) they will be
        in once ``flush`` has been called. Read it only from work queued on the compute
        stream before the next step's ``flush``: the copy two steps later overwrites it once
        that work is done."""
        off = self._append(values)
        dtype = _torch_dtype(values.dtype)
        view = self.staged[off : off + values.nbytes]
        return view.view(dtype).view(values.shape)

    def put_into(self, values: np.ndarray, dst: torch.Tensor) -> None:
        """Stage ``values`` to be written into ``dst`` (a view of the arena: 1-D, or 2-D
        with contiguous rows) by ``flush``.

        Raises:
            ValueError: shapes or dtypes differ, or ``dst``'s rows are not contiguous.
        """
        if tuple(values.shape) != tuple(dst.shape) or _torch_dtype(values.dtype) != dst.dtype:
            raise ValueError(
                f"staging {values.dtype}{tuple(values.shape)} into {dst.dtype}{tuple(dst.shape)}"
            )
        if values.size == 0:
            return
        ratio = _word_ratio(dst.dtype)
        rows, cols = (1, values.shape[0]) if values.ndim == 1 else values.shape
        if dst.stride(-1) != 1:
            raise ValueError("destination rows must be contiguous")
        stride = (dst.stride(0) if values.ndim == 2 else cols) * ratio
        src = self._append(values) // 4
        self._add_segment(COPY, src, self.arena.word_offset(dst), rows, cols * ratio, stride)

    def put_tokens(self, token_ids: np.ndarray, dst: torch.Tensor) -> None:
        """Stage int64 ``token_ids`` into ``dst`` (a 1-D int64 view of the arena); an entry
        ``-(i + 1)`` becomes ``sampled[i]`` of ``flush``'s ``sampled`` tokens."""
        if token_ids.dtype != np.int64 or dst.dtype != torch.int64 or dst.dim() != 1:
            raise ValueError("token ids are staged as int64 into a 1-D int64 buffer")
        if token_ids.size == 0:
            return
        src = self._append(token_ids) // 4
        n = token_ids.shape[0]
        self._add_segment(TOKENS, src, self.arena.word_offset(dst), 1, n, n * 2)

    def _add_segment(self, kind: int, src: int, dst: int, rows: int, width: int, stride: int):
        if len(self._segments) == MAX_SEGMENTS:
            raise RuntimeError(f"more than {MAX_SEGMENTS} arrays scattered in one step")
        self._segments.append((kind, src, dst, rows, width, stride))

    def flush(self, sampled: torch.Tensor | None = None) -> None:
        """Copy the staged bytes to the device and scatter the ``put_into`` arrays.

        Args:
            sampled: ``[k]`` int64 device tensor, the previous step's sampled tokens, which
                ``put_tokens`` entries ``-(i + 1)`` refer to; None when there are none.
        """
        host = self._host_nps[self._parity]
        n = len(self._segments)
        if n:
            header = host[:HEADER_BYTES].view(np.int32)
            header[: n * DESC_WORDS] = np.asarray(self._segments, dtype=np.int32).reshape(-1)
        used = self._cursor
        self._copy(used)
        if not n:
            return
        if sampled is None:
            sampled = self.arena.words.view(torch.int64)[:1]  # never read: no entry is < 0
        if self._use_kernel:
            unpack(self.staged.view(torch.int32), self.arena.words, sampled, self._segments)
        else:
            unpack_reference(
                self.staged.view(torch.int32), self.arena.words, sampled, self._segments
            )

    def _copy(self, used: int) -> None:
        """Copy the first ``used`` staged bytes to this step's device buffer; on CUDA on the
        side stream, with the compute stream made to wait for it."""
        host, dev = self._hosts[self._parity][:used], self.staged[:used]
        stream = self._copy_stream
        if stream is None:
            dev.copy_(host, non_blocking=True)
            return
        compute = torch.cuda.current_stream(self.device)
        # Everything that reads the other device buffer (the previous step) is queued now.
        read = torch.cuda.Event()
        read.record(compute)
        self._read[self._parity ^ 1] = read
        last_read = self._read[self._parity]
        with torch.cuda.stream(stream):
            if last_read is not None:
                stream.wait_event(last_read)
            dev.copy_(host, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        self._copied[self._parity] = copied
        compute.wait_event(copied)


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype

"""CUDA graphs for decode-only steps, and what every graph set shares: capture per padded
size over the model runner's persistent buffers (``GraphHost``).

A decode step of a large model launches hundreds of small kernels; at small batch their
launch overhead rivals the GPU work. The model's forward pass (to the final norm) is
captured once per padded batch size over the runner's persistent buffers and replayed: a
batch of ``B`` requests runs the graph of the smallest captured size ``>= B``, with the
extra rows filled by inert padding requests (slot -1: nothing written; context length 0:
nothing read).
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from tokenmill.model.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)


class DeviceBuffer(Protocol):
    """A persistent device tensor of the runner and the host array a step fills."""

    device: torch.Tensor
    np: np.ndarray


class GraphHost(Protocol):
    """What graphs read of the model runner that replays them: the model, the persistent
    input buffers they are captured over, the batch limits, and the runner's padding and
    metadata over those buffers (``worker/model_runner.py`` documents each)."""

    model: nn.Module | None
    input_ids: DeviceBuffer
    positions: DeviceBuffer
    slot_mapping: DeviceBuffer
    query_start_loc: DeviceBuffer
    seq_lens: DeviceBuffer
    prefill_range: DeviceBuffer
    max_num_reqs: int
    max_num_tokens: int
    max_model_len: int

    def pad_token_inputs(self, num_tokens: int, padded: int) -> None: ...

    def pad_decode_batch(self, num_reqs: int, padded: int) -> AttentionMetadata: ...

    def buffer_metadata(self, num_tokens: int, num_reqs: int, **fields) -> AttentionMetadata: ...

    def single_request_metadata(self, num_tokens: int, seq_len: int) -> AttentionMetadata: ...


@contextmanager
def garbage_collection_paused() -> Iterator[None]:
    """Collect garbage now, then keep Python's collector off until the block ends.

    In torch's default ("global") capture mode, some CUDA calls made from any thread while
    a stream is being captured invalidate the capture, and a collection may make such
    calls when it frees an earlier engine's objects (pinned host memory, CUDA events): the
    capture then fails with ``cudaErrorStreamCaptureInvalidated`` ("operation failed due
    to a previous error during capture"). Seen once on an H200 in ``tests/gpu``, where
    engines are created and dropped in one process, and not reproduced in three runs of
    the same test; a collection is the likely cause, and this rules it out.
    """
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def default_capture_sizes(max_num_seqs: int, max_size: int = 512) -> list[int]:
    """Padded batch sizes to capture: dense where padding would waste most, capped."""
    sizes = [1, 2, 4, 8] + list(range(16, 256, 16)) + list(range(256, max_size + 1, 32))
    return [s for s in sizes if s <= max_num_seqs] or [1]


def next_size(sizes: list[int], n: int) -> int | None:
    """The smallest of the ascending ``sizes`` that is at least ``n``; None past the last."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class PaddedGraphs:
    """Graphs captured per padded size: a batch of ``n`` replays the smallest size ``>= n``.

    Args:
        runner: the model runner whose buffers the graphs read and write.
        sizes: the sizes to capture.
        pool: a CUDA graph memory pool to share with other graphs that are never replayed
            concurrently with these; a new one at capture when None.
    """

    def __init__(self, runner: GraphHost, sizes: list[int], pool: tuple[int, int] | None) -> None:
        self.runner = runner
        self.sizes = sorted(sizes)
        self.pool = pool
        self.graphs: dict[int, Any] = {}  # size -> what its capture produced
        # Each whole-pass graph's capture metadata, kept as long as the graph (by
        # ``capture_pass``): the attention backend keeps what it allocates for a step on the
        # metadata (the key-split workspaces, allocated by the warm-up passes outside the
        # graph's pool), and the graph replays into those addresses. Freed, the memory goes
        # back to the caching allocator, and a replay then writes into whatever reuses it,
        # or faults once it is released.
        self.metadata: dict[int, Any] = {}

    def can_run(self, n: int) -> bool:
        return bool(self.graphs) and n <= self.sizes[-1]

    def padded_size(self, n: int) -> int:
        """The captured size a batch of ``n`` runs at.

        Raises:
            ValueError: ``n`` is past the largest size.
        """
        size = next_size(self.sizes, n)
        if size is None:
            raise ValueError(f"{n} is past the largest captured size {self.sizes[-1]}")
        return size

    def compile_pass(self) -> None:
        """Run the warm-up forward pass of every size once, as ``capture`` does before it
        captures; under ``parallel_compile.compile_only`` that only compiles its kernels."""
        raise NotImplementedError

    def _shared_pool(self) -> tuple[int, int]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def capture_pass(
        self, size: int, metadata: Any, stream: torch.cuda.Stream
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the model's forward pass over the first ``size`` rows of the runner's
        input buffers with ``metadata``, into the shared pool, after two warm-up passes on
        ``stream`` (Triton compiles, lazy allocations); returns the graph and its output
        (hidden states ``[size, H]`` in the pool) and keeps ``metadata`` for the graph's
        lifetime (``self.metadata[size]``)."""
        model = self.runner.model
        assert model is not None
        ids = self.runner.input_ids.device[:size]
        pos = self.runner.positions.device[:size]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                model(ids, pos, metadata)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._shared_pool()):
            output = model(ids, pos, metadata)
        self.metadata[size] = metadata
        return graph, output


class WholePassGraphs(PaddedGraphs):
    """One graph of the model's whole forward pass per padded size, over the runner's
    persistent buffers, all in one memory pool.

    Subclasses give the inert metadata a size is captured with (``capture_metadata``: every
    row padding) and pad a real batch the same way before ``replay``.
    """

    # The log line's description of what was captured: ``{lo}`` and ``{hi}`` are the sizes.
    what = "CUDA graphs (sizes {lo}..{hi})"

    def __init__(self, runner: GraphHost, sizes: list[int], pool: tuple[int, int] | None) -> None:
        super().__init__(runner, sizes, pool)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0

    def capture_metadata(self, size: int) -> Any:
        """The metadata of a batch of ``size`` padding rows (the runner's buffers filled
        to match), which the graph of ``size`` is captured with."""
        raise NotImplementedError

    @torch.inference_mode()
    def compile_pass(self) -> None:
        model = self.runner.model
        assert model is not None
        for size in reversed(self.sizes):
            metadata = self.capture_metadata(size)
            model(self.runner.input_ids.device[:size], self.runner.positions.device[:size],
                  metadata)  # fmt: skip

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first, sharing one memory pool."""
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):
            metadata = self.capture_metadata(size)
            self.graphs[size], self.outputs[size] = self.capture_pass(size, metadata, stream)
        torch.cuda.synchronize()
        what = self.what.format(lo=self.sizes[0], hi=self.sizes[-1])
        logger.info("Captured %d %s in %.1f s", len(self.graphs), what, time.perf_counter() - start)

    def replay(self, size: int) -> torch.Tensor:
        """Replay the graph of ``size`` over the buffers as they are (padded by the caller);
        returns its output, hidden states ``[size, H]`` (a static buffer)."""
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size]


class CUDAGraphRunner(WholePassGraphs):
    """Captures and replays the decode forward pass of ``runner.model``.

    Args:
        runner: the model runner whose buffers the graphs read and write.
        capture_sizes: batch sizes to capture (default: ``default_capture_sizes``).
        pool: as for ``PaddedGraphs``.
    """

    what = "CUDA graphs (decode batch sizes {lo}..{hi})"

    def __init__(
        self,
        runner: GraphHost,
        capture_sizes: list[int] | None = None,
        pool: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(runner, capture_sizes or default_capture_sizes(runner.max_num_reqs), pool)

    def capture_metadata(self, size: int) -> Any:
        return self.runner.pad_decode_batch(0, size)

    def run(self, num_reqs: int) -> torch.Tensor:
        """Replay for a decode batch of ``num_reqs`` whose inputs are already in the
        runner's buffers; returns hidden states ``[padded, H]`` (rows past ``num_reqs`` are
        padding)."""
        size = self.padded_size(num_reqs)
        self.runner.pad_decode_batch(num_reqs, size)
        return self.replay(size)

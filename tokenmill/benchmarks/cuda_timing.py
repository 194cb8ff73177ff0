"""GPU time of a piece of work replayed from a CUDA graph, for the kernel benchmarks.

A graph replay launches its kernels back to back, so the time is the kernels' own (no host
launch gaps), as in a decode step that runs from a captured graph.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable


def graph_replay_ms(capture: Callable[[], object], replays: int = 10) -> float:
    """Median milliseconds of one replay of a CUDA graph holding ``capture()``.

    ``capture`` runs once eagerly first, on a side stream (Triton compiles, the caching
    allocator reserves its memory), then once under capture. Callers that capture several
    calls divide by their count.

    Raises:
        RuntimeError: CUDA is not available (from torch).
    """
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        capture()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        capture()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)

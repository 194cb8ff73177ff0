"""The CUDA graph sets a model runner captures at start-up, in capture order.

- piecewise graphs for steps with prompt tokens (``piecewise_graph.py``);
- whole-step graphs for mixed batches where the attention backend has uniform grids
  (``mixed_graph.py``);
- whole-pass decode graphs per padded batch size (``cuda_graph.py``).

All share one memory pool: no two of them replay at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.worker.cuda_graph import (
    CUDAGraphRunner,
    PaddedGraphs,
    garbage_collection_paused,
)
from tokenmill.worker.piecewise_graph import PiecewiseCUDAGraphRunner

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner


def plan_graphs(runner: ModelRunner) -> list[PaddedGraphs]:
    """Create the runner's graph sets, uncaptured, and set them on it (``piecewise_graphs``,
    ``mixed_graphs``, ``cuda_graphs``); an uncaptured set runs
    nothing (``can_run`` is False). Returns them in capture order."""
    pool = torch.cuda.graph_pool_handle()
    runner.piecewise_graphs = PiecewiseCUDAGraphRunner(runner, pool=pool)
    graphs: list[PaddedGraphs] = [runner.piecewise_graphs]
    if runner.attn_backend.supports_uniform_grids:
        from tokenmill.worker.mixed_graph import MixedCUDAGraphRunner

        runner.mixed_graphs = MixedCUDAGraphRunner(runner, pool=pool)
        graphs.append(runner.mixed_graphs)
    runner.cuda_graphs = CUDAGraphRunner(runner, pool=pool)
    graphs.append(runner.cuda_graphs)
    return graphs


def capture_graphs(graphs: list[PaddedGraphs]) -> None:
    """Capture each set in order, with Python's garbage collector paused."""
    with garbage_collection_paused():
        for g in graphs:
            g.capture()

"""Piecewise CUDA graphs: which padded sizes exist and which steps they serve (the capture
and replay themselves run in tests/gpu/test_engine_gpu.py), and the garbage collector
paused around captures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenmill.worker.piecewise_graph import (
    MAX_PIECEWISE_TOKENS,
    PiecewiseCUDAGraphRunner,
    default_piecewise_sizes,
)


def test_default_sizes_cover_every_token_count_up_to_the_cap():
    sizes = default_piecewise_sizes(8192)
    assert sizes[0] == 8 and sizes[-1] == MAX_PIECEWISE_TOKENS
    assert sizes == sorted(set(sizes))
    # Padding past 256 tokens wastes at most 16 tokens up to 512, 32 beyond.
    gaps = [(a, b - a) for a, b in zip(sizes, sizes[1:], strict=False) if a >= 256]
    assert all(gap <= (16 if a < 512 else 32) for a, gap in gaps)


def test_sizes_end_at_a_small_token_budget():
    assert default_piecewise_sizes(100) == [8, 16, 32, 64, 96, 100]
    assert default_piecewise_sizes(4) == [4]


def test_steps_pad_to_the_next_size_and_larger_ones_run_eagerly():
    runner = SimpleNamespace(max_num_tokens=600)
    pieces = PiecewiseCUDAGraphRunner(runner)  # type: ignore[arg-type]
    assert not pieces.can_run(1)  # nothing captured yet
    pieces.graphs = {s: [] for s in pieces.sizes}
    assert pieces.sizes[-1] == 600
    assert [pieces.padded_size(n) for n in (1, 9, 33, 300, 513, 600)] == [8, 16, 64, 304, 544, 600]
    assert pieces.can_run(600) and not pieces.can_run(601)


def test_garbage_collection_paused_during_capture_and_restored():
    import gc

    from tokenmill.worker.cuda_graph import garbage_collection_paused

    assert gc.isenabled()
    with garbage_collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with garbage_collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), garbage_collection_paused():
        raise RuntimeError("a failed capture")
    assert gc.isenabled()

"""The serving simulator runs the real scheduler to the end of a small closed loop."""

from __future__ import annotations

from benchmarks.serving_sim import SimConfig, simulate


def test_small_closed_loop_finishes_with_sane_figures():
    for pacing in (0, 256):
        result = simulate(SimConfig(load="prefix", concurrency=8, num_prompts=40, pacing=pacing))
        # At least one prompt-free decode step per output token, none of them free.
        assert 5.0 < result["tpot_p50_ms"] < 50.0
        assert 0.0 < result["ttft_p50_ms"] < 1000.0
        assert result["req_per_s"] > 0.0

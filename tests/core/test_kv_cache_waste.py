"""Block-wise allocation wastes only each request's last partial block (benchmark check)."""

from __future__ import annotations

from benchmarks.kv_cache_waste import run


def test_waste_is_only_the_last_partial_block():
    result = run(num_requests=64, block_size=16, seed=0, num_blocks=1500)
    assert result["blocks_beyond_last_partial"] == 0
    assert result["max_waste"] < 0.04

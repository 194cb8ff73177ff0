"""Fixtures of the model tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def small_tiles(monkeypatch):
    """16 x 16 tiles for the Triton attention kernels: many query blocks and key tiles per
    request on small shapes (interpreter tests; see ``triton_attention_cases.py``)."""
    # Imported here, not at collection: the cases module switches the interpreter on.
    from tests.model.triton_attention_cases import TileConfig, use_tiles

    use_tiles(monkeypatch, TileConfig(16, 16, 4, 1), TileConfig(16, 16, 4, 1))

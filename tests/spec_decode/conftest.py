"""Fixtures of the speculative decoding tests."""

from __future__ import annotations

from tests.entrypoints.conftest import tiny_model_dir  # noqa: F401 (a fixture)

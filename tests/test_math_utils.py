"""The host integer helpers agree with Triton's own."""

from __future__ import annotations

import pytest

from tokenmill.math_utils import cdiv, next_power_of_2

triton = pytest.importorskip("triton")


def test_cdiv_matches_triton():
    for a in range(0, 600, 7):
        for b in (1, 2, 16, 64, 256, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b)


def test_next_power_of_2_matches_triton():
    for n in range(1, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n)
    assert next_power_of_2(0) == 1

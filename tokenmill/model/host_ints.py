"""Integer helpers for sizing kernel launches on the host.

``triton.cdiv`` and ``triton.next_power_of_2`` are Triton "constexpr functions": each call
unwraps its arguments through Triton's machinery, ~2.6 us in Triton 3.6 against ~0.03 us
for the plain expression. Attention computes several per layer and step while the GPU waits
for the launches, so host code uses these instead (kernels keep ``tl.cdiv``).
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1

"""How close float32 logits must be to transformers' on the CPU."""

from __future__ import annotations

import torch

# float32 keeps ~7 significant digits; two implementations sum each product in a different
# order (the CPU's SIMD width sets the BLAS blocking), so the absolute error grows with the
# logits' magnitude. SmolLM2's logits reach ~36: 5e-5 apart on one x86 CPU, 1.6e-4 on another.
RELATIVE_TO_LARGEST = 1e-5
MIN_ATOL = 1e-4


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Assert ``actual`` and ``expected`` ([num_tokens, vocab], float32) are equal to within
    ``max(1e-4, 1e-5 * max|expected|)`` absolute difference, element by element."""
    atol = max(MIN_ATOL, RELATIVE_TO_LARGEST * expected.abs().max().item())
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)

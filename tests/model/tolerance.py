"""How close float32 logits must be to transformers' on the CPU."""

from __future__ import annotations

import torch

# float32 keeps ~7 significant digits; two implementations sum each product in a different
# order (the CPU's SIMD width sets the BLAS blocking), so the absolute error grows with the
# logits' magnitude. SmolLM2's logits reach ~36: 5e-5 apart on one x86 CPU, 1.6e-4 on another.
RELATIVE_TO_LARGEST = 1e-5
MIN_ATOL = 1e-4


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Assert ``actual`` and ``expected`` ([num_tokens, vocab], float32) agree: the same
    infinities in the same places, and each finite entry within
    ``max(1e-4, 1e-5 * its row's largest finite |expected|)``."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    finite = expected.isfinite()
    assert torch.equal(finite, actual.isfinite()), "infinities differ"
    assert torch.equal(actual[~finite], expected[~finite]), "infinities differ in sign"
    scale = expected.abs().where(finite, 0.0).amax(dim=-1, keepdim=True)
    atol = (RELATIVE_TO_LARGEST * scale).clamp_min(MIN_ATOL)
    diff = (actual - expected).abs().where(finite, 0.0)
    worst = int((diff - atol).argmax())
    row, col = divmod(worst, expected.shape[-1])
    assert bool((diff <= atol).all()), (
        f"logits differ by {diff[row, col].item():.3g} at ({row}, {col}), "
        f"above the {atol[row, 0].item():.3g} allowed in that row"
    )

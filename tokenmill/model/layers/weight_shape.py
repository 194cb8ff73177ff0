"""Shape checks of checkpoint tensors against the parameters they fill."""

from __future__ import annotations

import torch


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape its parameter expects."""


def check_shape(param_name: str, expected: torch.Size, got: torch.Size) -> None:
    if tuple(expected) != tuple(got):
        raise WeightShapeError(
            f"tensor {param_name!r} has shape {tuple(got)}, expected {tuple(expected)}"
        )

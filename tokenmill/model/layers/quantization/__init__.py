"""Quantized weights: the ``QuantizationConfig`` / ``LinearMethod`` seam and its methods."""

from tokenmill.model.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    ShardSlice,
    copy_shard,
    set_layout,
)
from tokenmill.model.layers.quantization.context import active_config, quantization_context

__all__ = [
    "LinearMethod",
    "QuantizationConfig",
    "QuantizationError",
    "ShardSlice",
    "active_config",
    "copy_shard",
    "quantization_context",
    "set_layout",
]

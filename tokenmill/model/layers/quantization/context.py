"""The quantization a model is being built with: layers built inside
``quantization_context(config)`` defer their weights until ``create_quantized_weights``
knows each layer's name (a checkpoint may leave some layers unquantized by name)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tokenmill.model.layers.quantization.base import QuantizationConfig

_ACTIVE: list[QuantizationConfig] = []


@contextmanager
def quantization_context(config: QuantizationConfig | None) -> Iterator[None]:
    """Build layers under ``config`` (None: unquantized, weights created at once)."""
    if config is None:
        yield
        return
    _ACTIVE.append(config)
    try:
        yield
    finally:
        _ACTIVE.pop()


def active_config() -> QuantizationConfig | None:
    """The config of the model being built, None outside ``quantization_context``."""
    return _ACTIVE[-1] if _ACTIVE else None

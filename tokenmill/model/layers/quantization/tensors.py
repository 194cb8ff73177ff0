"""Checkpoint tensors that arrive still quantized (GGUF blocks), before a layer keeps them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels.quant.gguf_blocks import dequantize, type_name


@dataclass
class GGUFTensor:
    """A GGUF tensor kept in its blocks.

    Attributes:
        data: ``[..., N, row_bytes]`` uint8: rows of blocks (a leading expert dimension for
            stacked MoE tensors).
        qtype: the GGML type id.
        shape: the logical shape ``[..., N, K]``.
    """

    data: torch.Tensor
    qtype: int
    shape: tuple[int, ...]

    def dequantize(self) -> torch.Tensor:
        """float32 of ``shape`` (bit-exact with the ``gguf`` package)."""
        rows = self.data.reshape(-1, self.data.shape[-1])
        return dequantize(rows, self.qtype).reshape(self.shape)

    def rows(self, start: int, size: int) -> GGUFTensor:
        """Rows ``start:start+size`` of the last-but-one (output) dimension."""
        data = self.data.narrow(-2, start, size)
        return GGUFTensor(data, self.qtype, (*self.shape[:-2], size, self.shape[-1]))

    def __getitem__(self, index: int) -> GGUFTensor:
        """One expert of a stacked ``[E, N, row_bytes]`` tensor."""
        return GGUFTensor(self.data[index], self.qtype, tuple(self.shape[1:]))

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)


def as_float(loaded: torch.Tensor | GGUFTensor) -> torch.Tensor:
    """A float tensor for a parameter that does not keep quantized blocks."""
    return loaded.dequantize() if isinstance(loaded, GGUFTensor) else loaded

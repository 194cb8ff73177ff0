"""Unquantized weights: one ``[N, K]`` tensor in the activations' dtype, ``dense`` products."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.layers.dense import dense, gated_dense
from tokenmill.model.layers.quantization.base import LinearMethod, set_layout


class UnquantizedLinearMethod(LinearMethod):
    """``weight [N, K]``; the product is ``dense`` (cuBLAS / the skinny GEMM / CPU BLAS) and
    the gate/up pair's ``gated_dense``, both with the layer's ``KernelConfig.skinny_gemm``."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype
    ) -> None:
        weight = torch.empty(sum(output_sizes), input_size, dtype=dtype)
        layer.weight = set_layout(nn.Parameter(weight, requires_grad=False))

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return dense(x, layer.weight, bias, layer.skinny_gemm)

    def apply_gated(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        return gated_dense(x, layer.weight, bias, layer.skinny_gemm)

    @property
    def is_unquantized(self) -> bool:
        return True

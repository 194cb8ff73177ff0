"""Activation functions of the MLP blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.activation import silu_and_mul
from tokenmill.kernels.device import use_triton


class SiluAndMul(nn.Module):
    """SwiGLU gate (Shazeer 2020): ``silu(x[..., :d]) * x[..., d:]``.

    Shapes: ``[T, 2d] -> [T, d]``, any float dtype.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            return silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    """GeGLU gate (Shazeer 2020): ``gelu(x[..., :d]) * x[..., d:]``.

    Args:
        approximate: "none" (erf) or "tanh" (Gemma's gelu_pytorch_tanh).
    """

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


def get_act_and_mul(hidden_act: str) -> nn.Module:
    """The gated activation for a config's ``hidden_act`` (or ``hidden_activation``).

    Raises:
        ValueError: the activation is not supported.
    """
    if hidden_act in ("silu", "swish"):
        return SiluAndMul()
    if hidden_act in ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new"):
        return GeluAndMul("tanh")
    if hidden_act == "gelu":
        return GeluAndMul("none")
    raise ValueError(f"unsupported hidden_act {hidden_act!r}")

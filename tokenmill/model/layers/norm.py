"""RMSNorm (Zhang & Sennrich 2019), optionally fused with the residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.cpu.native import native_ops
from tokenmill.kernels.device import use_triton
from tokenmill.kernels.norm import rms_norm

_NO_RESIDUAL = torch.empty(0)


def no_residual() -> torch.Tensor:
    """The empty tensor ``add_rms_norm`` takes for "no residual to add"."""
    return _NO_RESIDUAL


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32.

    ``forward(x, residual)`` with a residual first adds it (``x = x + residual``) and returns
    ``(normed, new_residual)``, the pre-norm transformer pattern, so the add and the norm
    can be one fused kernel (Triton on the GPU, the native CPU kernels on float32 rows).

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square.
        offset: 1.0 for Gemma, whose weights are stored as ``weight - 1``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.offset = offset
        self.hidden_size = hidden_size

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 == self.weight.dtype and not self.offset:
            # torch's fused kernel: the same values in one pass
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float() + self.offset if self.offset else self.weight.float()
        return (x * w).to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_triton(x):
            return rms_norm(x, self.weight, self.eps, residual, self.offset)
        ops = native_ops() if x.device.type == "cpu" else None
        if (ops is not None and x.dtype == torch.float32 == self.weight.dtype and x.dim() == 2
                and x.is_contiguous()
                and (residual is None or (residual.is_contiguous() and residual.dtype == x.dtype))):
            y, s = ops.add_rms_norm(x, _NO_RESIDUAL if residual is None else residual,
                                    self.weight, self.eps, self.offset)
            return y if residual is None else (y, s)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

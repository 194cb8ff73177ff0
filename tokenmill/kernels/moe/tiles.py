"""What the grouped MoE GEMMs (``fused_moe.py``, ``mxfp4_experts.py``) share: the gated
activation of the experts (``GatedActivation``, and ``gated_tile``, its form in registers)
and the launch order of their output tiles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from tokenmill.kernels.device import HAS_TRITON


@dataclass(frozen=True)
class GatedActivation:
    """How an expert combines its gate and up projections.

    Attributes:
        kind: ``"silu"``: ``silu(gate) * up`` (SwiGLU, Shazeer 2020); ``"swigluoai"``:
            gpt-oss' clamped form, ``(up + 1) * g * sigmoid(alpha * g)`` with
            ``g = min(gate, limit)`` and ``up`` clamped to ``[-limit, limit]`` (OpenAI's
            gpt-oss reference; vLLM's name for it).
        alpha: the sigmoid's gain (swigluoai).
        limit: the clamp (swigluoai).
    """

    kind: Literal["silu", "swigluoai"] = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The torch form: ``gate``, ``up`` ``[..., I]`` -> ``[..., I]``."""
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


SILU = GatedActivation()


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_tile_ids(pid, max_padded, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         GROUP_M: tl.constexpr):  # fmt: skip
        """``(pid_m, pid_n)`` of program ``pid``: ``GROUP_M`` consecutive row tiles share
        each weight column tile, so the column tile is read from L2 while a group runs."""
        num_pid_m = tl.cdiv(max_padded, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_pid_n
        first_m = (pid // per_group) * GROUP_M
        group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_size
        pid_n = (pid % per_group) // group_size
        return pid_m, pid_n

    @triton.jit
    def gated_tile(gate, up, alpha, limit, SWIGLUOAI: tl.constexpr):
        """``GatedActivation`` in registers (float32 tiles): SiLU(gate) * up, or with
        ``SWIGLUOAI`` gpt-oss' clamped form."""
        if SWIGLUOAI:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            return (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
        return gate / (1.0 + tl.exp(-gate)) * up

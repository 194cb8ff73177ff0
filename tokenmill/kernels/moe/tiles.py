"""Triton helpers shared by the grouped MoE GEMMs (``fused_moe.py``, ``mxfp4_experts.py``):
the launch order of their output tiles and the gated activation applied in registers."""

from __future__ import annotations

from tokenmill.kernels.device import HAS_TRITON

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

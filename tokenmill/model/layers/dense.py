"""The unquantized product ``y = x W^T (+ b)``: ``F.linear``, or the skinny GEMM of
``tokenmill.kernels.gemm.skinny`` for decode-sized batches where ``KernelConfig.skinny_gemm``
sends a product to it; ``gated_dense`` adds SiLU-and-mul of a gate/up pair in the same launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.config import SkinnyGemm
from tokenmill.kernels.gemm import skinny as skinny_gemm


def dense(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    skinny: SkinnyGemm = "auto",
) -> torch.Tensor:
    """``y = x W^T (+ b)``: ``F.linear``, or for decode-sized batches on CUDA the split-K
    kernel of ``kernels.gemm.skinny`` where ``skinny`` (``KernelConfig.skinny_gemm``)
    sends this product to it.

    Shapes: ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` -> ``[..., N]``.
    """
    if _runs_skinny(x, weight, skinny):
        return skinny_gemm.skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _runs_skinny(x: torch.Tensor, weight: torch.Tensor, skinny: SkinnyGemm) -> bool:
    return (
        skinny != "off"
        and x.dim() == 2
        and x.shape[0] <= skinny_gemm.MAX_M
        and skinny_gemm.use_skinny_gemm(x, weight)
        and (skinny == "all" or skinny_gemm.has_tuned_config(x, weight))
    )


def gated_dense(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    skinny: SkinnyGemm = "auto",
) -> torch.Tensor | None:
    """``silu(y[:, :N/2]) * y[:, N/2:]`` of ``y = x W^T (+ b)`` in one skinny-GEMM launch,
    where ``dense`` would run this product through the skinny GEMM and its tiles have an
    even ``block_n``; None elsewhere (the caller runs the product and the gate apart).

    Shapes: ``x [M, K]``, ``weight [N, K]`` (gate rows over up rows), ``bias [N]`` ->
    ``[M, N/2]``.
    """
    if weight.shape[0] % 2 or not _runs_skinny(x, weight, skinny):
        return None
    (m, k), n = x.shape, weight.shape[0]
    config = skinny_gemm.launch_config(m, n, k, skinny_gemm.num_sms(x.device))
    if config.block_n % 2:
        return None
    return skinny_gemm.skinny_linear(x, weight, bias, config=config, gated=True)

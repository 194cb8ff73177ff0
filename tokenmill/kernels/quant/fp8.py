"""FP8 (float8_e4m3fn) quantization in torch ops, on any device: weights per output channel
or per 128x128 block, activations per token, per tensor, per token group, or with a static
scale; and the exact dequantization of each.

The scale of a set of values is ``amax / 448`` (448 = the largest finite e4m3fn value), the
values are ``clamp(v / scale, -448, 448)`` rounded to nearest by the cast, and ``q * scale``
gives them back (Micikevicius et al. 2022, "FP8 Formats for Deep Learning",
arXiv:2209.05433; the same rule as compressed-tensors' and vLLM's FP8 schemes).
"""

from __future__ import annotations

import torch

from tokenmill.math_utils import cdiv

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Scales never go below this: an all-zero row must not divide by zero.
MIN_SCALE = 1e-12


def _cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> ``(q [N, K] float8_e4m3fn, scale [N] float32)``."""
    scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp_min(MIN_SCALE)
    return _cast(w, scale[:, None]), scale


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` -> ``(q float8_e4m3fn of w's shape, scale [] float32)``."""
    scale = (w.float().abs().amax() / FP8_MAX).clamp_min(MIN_SCALE)
    return _cast(w, scale), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> ``(q [N, K] float8_e4m3fn, scale [ceil(N/bn), ceil(K/bk)] float32)``
    with one scale per ``block = (bn, bk)`` tile (DeepSeek-V3's weight blocks)."""
    scale = block_amax(w, block) / FP8_MAX
    scale = scale.clamp_min(MIN_SCALE)
    return _cast(w, expand_blocks(scale, block, w.shape)), scale


def block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Largest ``|w|`` of each ``block`` tile: ``[ceil(N/bn), ceil(K/bk)]`` float32."""
    bn, bk = block
    n, k = w.shape
    padded = torch.zeros(cdiv(n, bn) * bn, cdiv(k, bk) * bk, device=w.device)
    padded[:n, :k] = w.float().abs()
    return padded.view(cdiv(n, bn), bn, cdiv(k, bk), bk).amax(dim=(1, 3))


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size | tuple
                  ) -> torch.Tensor:
    """Block scales ``[ceil(N/bn), ceil(K/bk)]`` -> one per element, ``[N, K]``."""
    bn, bk = block
    n, k = shape
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None
               ) -> torch.Tensor:
    """Exact float32 of ``q [N, K]`` times its scale: ``[N]`` per channel (or ``[N, 1]``),
    ``[]`` per tensor, or ``[ceil(N/bn), ceil(K/bk)]`` with ``block``."""
    if block is not None:
        return q.float() * expand_blocks(scale.float(), block, q.shape)
    scale = scale.float()
    if scale.dim() == 1:
        scale = scale[:, None]
    return q.float() * scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token: ``x [M, K]`` -> ``(q [M, K] float8_e4m3fn, scale [M, 1] float32)``."""
    scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return _cast(x, scale), scale


def quantize_dynamic_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-tensor: one scale for all of ``x [M, K]``, returned as ``[M, 1]``."""
    scale = (x.float().abs().amax() / FP8_MAX).clamp_min(MIN_SCALE)
    return _cast(x, scale), scale.expand(x.shape[0], 1)


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's static input scale ``[]`` (float32): ``(q, scale as [M, 1])``."""
    return _cast(x, scale), scale.reshape(1, 1).expand(x.shape[0], 1)


def quantize_token_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per token and ``group`` input channels (block-wise W8A8's activations):
    ``x [M, K]`` -> ``(q [M, K], scale [M, ceil(K/group)] float32)``."""
    m, k = x.shape
    g = cdiv(k, group)
    padded = torch.zeros(m, g * group, device=x.device)
    padded[:, :k] = x.float()
    scale = (padded.abs().view(m, g, group).amax(-1) / FP8_MAX).clamp_min(MIN_SCALE)
    full = scale.repeat_interleave(group, 1)[:, :k]
    return _cast(x, full), scale

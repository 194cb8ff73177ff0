"""The int4 packings of AWQ, GPTQ and compressed-tensors checkpoints, and tokenmill's own.

Every format stores eight 4-bit values per int32 word:

- GPTQ (AutoGPTQ/GPTQModel): ``qweight [K/8, N]`` packs along ``K``, value ``j`` of a word
  in bits ``4j..4j+3``; ``qzeros [K/G, N/8]`` packs along ``N`` the same way (the original
  "v1" format stores ``zero - 1``, "gptq_v2" the zero itself).
- AWQ (AutoAWQ, GEMM version): ``qweight [K, N/8]`` and ``qzeros [K/G, N/8]`` pack along
  ``N`` in the interleaved order ``[0, 2, 4, 6, 1, 3, 5, 7]`` (bits ``4i`` hold column
  ``ORDER[i]`` of the word's eight).
- compressed-tensors ``pack-quantized``: ``weight_packed [N, K/8]`` packs along ``K``,
  LSB first, the signed value plus 8; asymmetric zero points ``[N/8, K/G]`` along ``N``.

``unpack_*`` return unsigned values ``[rows, cols]`` in the logical order. ``pack_k`` is the
GPU kernels' layout (GPTQ's ``qweight`` orientation, ``[K/8, N]``).
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, 4, device=device, dtype=torch.int32)


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """``[R, C/8]`` int32 packed along columns -> ``[R, C]`` uint8 (0..15).

    Args:
        order: column of each nibble within a word (AWQ_ORDER); None: nibble ``j`` is
            column ``j``.
    """
    r, c8 = packed.shape
    vals = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 15  # [R, C/8, 8] by nibble
    if order is not None:
        inverse = [order.index(j) for j in range(8)]
        vals = vals[..., inverse]
    return vals.reshape(r, c8 * 8).to(torch.uint8)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """``[R/8, C]`` int32 packed along rows -> ``[R, C]`` uint8."""
    r8, c = packed.shape
    vals = (packed.unsqueeze(1) >> _shifts(packed.device).view(1, 8, 1)) & 15
    return vals.reshape(r8 * 8, c).to(torch.uint8)


def pack_cols(values: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of ``unpack_cols``: ``[R, C]`` ints 0..15 -> ``[R, C/8]`` int32."""
    r, c = values.shape
    vals = values.to(torch.int32).reshape(r, c // 8, 8)
    if order is not None:
        vals = vals[..., list(order)]
    return (vals << _shifts(values.device)).sum(-1, dtype=torch.int32)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """Inverse of ``unpack_rows``: ``[R, C]`` ints 0..15 -> ``[R/8, C]`` int32."""
    r, c = values.shape
    vals = values.to(torch.int32).reshape(r // 8, 8, c)
    return (vals << _shifts(values.device).view(1, 8, 1)).sum(1, dtype=torch.int32)


def pack_k(q_nk: torch.Tensor) -> torch.Tensor:
    """The GPU kernels' layout: ``q [N, K]`` (0..15) -> ``[K/8, N]`` int32 packed along K."""
    return pack_rows(q_nk.t())

"""Weights in blocks of 32 integers for the native CPU product (``csrc/block_gemm.cpp``).

``W[n, k] = scale[n, b] * q[n, k] + offset[n, b]`` with ``b = k // 32``; ``q`` is held as
nibbles when it fits 0..15, else as int8 (-128..127). Inside the product each activation is
held as two int8 digits per block of 32 (llama.cpp's Q8 digit and one for its rounding
error), exact to about 2^-16 of the block's largest activation, so a product matches the
float32 one to about float32 rounding of the sums; each row's result is independent of the
other rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.kernels.cpu.native import native_ops

BLOCK = 32
TILE = 16  # output columns per vector of the kernel


def available() -> bool:
    """Whether the native product runs here (built, with AVX-512 VNNI)."""
    ops = native_ops()
    return ops is not None and bool(ops.block_gemm_available())


def supports(group: int, n: int, k: int) -> bool:
    """Whether weights of this shape and group size (``K`` per scale) can be packed."""
    return group % BLOCK == 0 and k % group == 0 and n % TILE == 0


@dataclass
class BlockWeights:
    """One weight packed for ``block_gemm`` (shapes for ``N`` outputs, ``K`` inputs).

    Attributes:
        packed: uint8, ``N * K / 2`` bytes (nibbles) or ``N * K`` (int8), tile-major.
        corr: ``[N / 16, K / 32, 16]`` int32, ``-128 * sum(q)`` of each block (int8
            weights; empty for nibbles).
        scales, offsets: ``[N / 16, K / 32, 16]``, float16 where every value is one
            exactly (GGUF's block scales), else float32; ``offsets`` empty for symmetric
            blocks (no offset term).
        nibbles: whether ``packed`` holds four-bit values.
    """

    packed: torch.Tensor
    corr: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    nibbles: bool

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, N]`` float32."""
        x = x.float().contiguous()
        return native_ops().block_gemm(
            x, self.packed, self.corr, self.scales, self.offsets, self.nibbles
        )

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (``[T]`` int) of ``W``, dequantized: ``[T, K]`` float32 (an
        embedding lookup through the tied LM head's packing)."""
        tiles, nb = self.scales.shape[:2]
        ids = ids.reshape(-1).long()
        t, lane = ids // TILE, ids % TILE
        if self.nibbles:  # bytes (tile, block, group of 8 K, lane, 4 K): lo | hi << 4
            v = self.packed.view(tiles, nb, 4, TILE, 4)[t, :, :, lane, :]
            q = torch.stack([v & 15, v >> 4], dim=-2)
        else:  # int8 (tile, block, group of 4 K, lane, 4 K)
            q = self.packed.view(torch.int8).view(tiles, nb, 8, TILE, 4)[t, :, :, lane, :]
        q = q.reshape(len(ids), nb, BLOCK).float()
        scale = self.scales[t, :, lane].float()  # [T, nb]
        w = q * scale[..., None]
        if self.offsets.numel():
            w = w + self.offsets[t, :, lane].float()[..., None]
        return w.view(len(ids), nb * BLOCK)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.corr, self.scales, self.offsets]


def pack_blocks(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                group: int) -> BlockWeights | None:
    """Pack ``W = scale * q + offset`` (``q`` integer ``[N, K]``, ``scale``/``offset``
    float ``[N, K / group]``); None when ``q`` does not fit int8 or the shape is not
    supported (``supports``)."""
    n, k = q.shape
    if not supports(group, n, k):
        return None
    q = q.to(torch.int16)
    lo, hi = int(q.min()), int(q.max())
    if lo < -128 or hi > 127:
        return None
    scale = scale.float().repeat_interleave(group // BLOCK, dim=1)
    offset = (torch.zeros_like(scale) if offset is None
              else offset.float().repeat_interleave(group // BLOCK, dim=1))
    nibbles = lo >= 0 and hi <= 15
    if not nibbles and lo >= -8 and hi <= 7:  # signed four bits: shift into 0..15
        q, offset, nibbles = q + 8, offset - 8 * scale, True
    nb, tiles = k // BLOCK, n // TILE
    if nibbles:
        # (tile, lane, block, group of 8 K, half, 4 K) -> bytes lo | hi << 4, lane-major
        v = q.to(torch.uint8).view(tiles, TILE, nb, 4, 2, 4)
        packed = (v[..., 0, :] | (v[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)
    else:
        packed = q.to(torch.int8).view(torch.uint8).view(tiles, TILE, nb, 8, 4)
        packed = packed.permute(0, 2, 3, 1, 4)

    def by_tile(t: torch.Tensor) -> torch.Tensor:  # [N, nb] -> [N / 16, nb, 16]
        return t.view(tiles, TILE, nb).transpose(1, 2).contiguous()

    corr = torch.zeros(0, dtype=torch.int32)
    if not nibbles:
        corr = by_tile((-128 * q.to(torch.int32).view(n, nb, BLOCK).sum(-1)).to(torch.int32))
    # float16 halves the scale bytes each product streams, where it changes no value
    exact_half = all(torch.equal(t.half().float(), t) for t in (scale, offset))
    dtype = torch.float16 if exact_half else torch.float32
    offsets = by_tile(offset).to(dtype) if offset.any() else torch.zeros(0, dtype=dtype)
    return BlockWeights(packed.contiguous().view(-1), corr, by_tile(scale).to(dtype), offsets,
                        nibbles)

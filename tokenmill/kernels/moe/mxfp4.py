"""MXFP4 weights: OCP Microscaling FP4 (OCP Microscaling Formats (MX) Specification v1.0,
2023), the format of gpt-oss' expert weights.

Each block of 32 consecutive values along a row (the input dimension) shares one scale:
an E8M0 byte ``s`` meaning ``2^(s - 127)``. Each value is an FP4 E2M1 code (1 sign bit, 2
exponent bits with bias 1, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives),
two to a byte, the even-indexed value in the low nibble. A weight ``[rows, K]`` is stored
as ``blocks`` uint8 ``[rows, K / 2]`` and ``scales`` uint8 ``[rows, K / 32]``; gpt-oss
checkpoints hold the blocks as ``[..., K / 32, 16]``, the same bytes in the same order.

``dequantize_mxfp4`` is the torch path (the CPU's, and the reference); ``decode_mxfp4``
takes a Triton kernel on CUDA (one pass over the bytes) and the torch path elsewhere;
``mxfp4_tile`` and ``mxfp4_rows`` decode a tile inside a Triton kernel.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.device import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

# Values per shared scale, and the E8M0 exponent bias.
MXFP4_BLOCK = 32
E8M0_BIAS = 127
# The 16 FP4 E2M1 codes, in code order.
FP4_E2M1_VALUES = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip


def check_mxfp4_shapes(blocks: torch.Tensor, scales: torch.Tensor) -> int:
    """The row length ``K`` of MXFP4 ``blocks [..., K / 2]`` and ``scales [..., K / 32]``.

    Raises:
        ValueError: not uint8, or the shapes disagree.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, "
                         f"{scales.dtype}")  # fmt: skip
    k = blocks.shape[-1] * 2
    if blocks.shape[:-1] != scales.shape[:-1] or scales.shape[-1] * MXFP4_BLOCK != k:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} disagree "
            f"(a row of K values takes K/2 bytes and K/{MXFP4_BLOCK} scales)"
        )
    return k


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """MXFP4 -> ``dtype``: ``value * 2^(scale - 127)`` (``torch.ldexp``, as transformers'
    dequantization of gpt-oss checkpoints; exact in bfloat16 and float32).

    Args:
        blocks: uint8 ``[..., K / 2]``.
        scales: uint8 ``[..., K / 32]``.
        dtype: the result's dtype.

    Returns:
        ``[..., K]`` in ``dtype``, on the inputs' device.

    Raises:
        ValueError: see ``check_mxfp4_shapes``.
    """
    k = check_mxfp4_shapes(blocks, scales)
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], k)
    values = lut[codes.long()].view(*scales.shape, MXFP4_BLOCK)
    exponents = scales.to(torch.int32).unsqueeze(-1) - E8M0_BIAS
    return torch.ldexp(values, exponents).reshape(*blocks.shape[:-1], k).to(dtype)


def decode_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``dequantize_mxfp4``'s result, by one Triton launch where the tensors are on CUDA
    (bit for bit the same values).

    Raises:
        ValueError: see ``check_mxfp4_shapes``.
    """
    if not (HAS_TRITON and blocks.is_cuda):
        return dequantize_mxfp4(blocks, scales, dtype)
    k = check_mxfp4_shapes(blocks, scales)
    blocks2 = blocks.reshape(-1, k // 2).contiguous()
    scales2 = scales.reshape(-1, k // MXFP4_BLOCK).contiguous()
    rows = blocks2.shape[0]
    out = torch.empty(rows, k, dtype=dtype, device=blocks.device)
    grid = (triton.cdiv(rows, _DECODE_ROWS), triton.cdiv(k // 2, _DECODE_BYTES))
    _decode_kernel[grid](blocks2, scales2, out, rows, k // 2, BLOCK_R=_DECODE_ROWS,
                         BLOCK_H=_DECODE_BYTES)  # fmt: skip
    return out.view(*blocks.shape[:-1], k)


# Rows and bytes per program of ``decode_mxfp4``'s kernel.
_DECODE_ROWS = 16
_DECODE_BYTES = 128

if HAS_TRITON:

    @triton.jit
    def _decode_kernel(blocks_ptr, scales_ptr, out_ptr, R, H, BLOCK_R: tl.constexpr,
                       BLOCK_H: tl.constexpr):  # fmt: skip
        """Rows ``[BLOCK_R]`` x bytes ``[BLOCK_H]`` of ``blocks [R, H]`` (scales ``[R,
        H / 16]``) -> values ``2j`` and ``2j + 1`` of ``out [R, 2H]``."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (rows < R)[:, None] & (cols < H)[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        packed = tl.load(blocks_ptr + rows64 * H + cols[None, :], mask=mask, other=0)
        scale = tl.load(scales_ptr + rows64 * (H // 16) + cols[None, :] // 16, mask=mask,
                        other=0)  # fmt: skip
        even, odd = mxfp4_tile(packed, scale, out_ptr.dtype.element_ty)
        out = out_ptr + rows64 * (2 * H) + 2 * cols[None, :]
        tl.store(out, even, mask=mask)
        tl.store(out + 1, odd, mask=mask)

    @triton.jit
    def _fp4_e2m1(code, scale_bits):
        """Float32 values of FP4 codes (int32, 0..15) times the E8M0 scales' powers of two
        (``scale_bits``: float32 bit patterns, from ``_e8m0_bits``), built bit by bit."""
        sign = (code & 8) << 28
        exponent = (code >> 1) & 3
        mantissa = code & 1
        # Normal codes: 2^(e - 1) * (1 + m / 2), float32 exponent field e - 1 + 127; the
        # subnormal code 1 is 0.5 (field 126), code 0 is zero.
        field = tl.where(exponent == 0, mantissa * 126, exponent + 126)
        bits = sign | (field << 23) | tl.where(exponent == 0, 0, mantissa << 22)
        return bits.to(tl.float32, bitcast=True) * scale_bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _e8m0_bits(scale):
        """The float32 bit pattern of ``2^(s - 127)`` for E8M0 bytes ``s`` (int32): the
        byte is the exponent field; ``s == 0`` is the subnormal ``2^-127``."""
        return tl.where(scale == 0, 1 << 22, scale << 23)

    @triton.jit
    def mxfp4_tile(packed, scale, dtype: tl.constexpr):
        """Decode a tile of packed MXFP4 bytes.

        Args:
            packed: uint8 ``[R, C]``: byte ``r`` holds values ``2r`` (low nibble) and
                ``2r + 1`` (high nibble) along the reduction dimension.
            scale: uint8 ``[R, C]``, each byte's E8M0 scale.
            dtype: the result's element type.

        Returns:
            ``(even, odd)``, each ``[R, C]``: values ``2r`` and ``2r + 1``.
        """
        codes = packed.to(tl.int32)
        scale_bits = _e8m0_bits(scale.to(tl.int32))
        even = _fp4_e2m1(codes & 15, scale_bits)
        odd = _fp4_e2m1(codes >> 4, scale_bits)
        return even.to(dtype), odd.to(dtype)

    @triton.jit
    def mxfp4_rows(packed, scale, dtype: tl.constexpr):
        """Decode rows of packed MXFP4 in their stored order.

        Args:
            packed: uint8 ``[R, H]``, ``H`` bytes of each row (``2H`` values along the
                reduction dimension, a multiple of 32).
            scale: uint8 ``[R, H / 16]``, the rows' E8M0 scales.
            dtype: the result's element type.

        Returns:
            ``[R, 2H]`` values in ``dtype``.
        """
        R: tl.constexpr = packed.shape[0]
        H: tl.constexpr = packed.shape[1]
        per_byte = tl.reshape(tl.broadcast_to(scale[:, :, None], (R, H // 16, 16)), (R, H))
        even, odd = mxfp4_tile(packed, per_byte, dtype)
        return tl.reshape(tl.join(even, odd), (R, 2 * H))

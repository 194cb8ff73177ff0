"""GGUF (llama.cpp) quantized blocks in torch: their layout, unpacking and dequantization.

A quantized GGUF tensor of shape ``[N, K]`` is stored as ``N`` rows of ``K / QK`` blocks,
each block ``type_size`` bytes (``gguf.GGML_QUANT_SIZES``). Every supported block type is a
small integer per weight with a scale (and for some types an offset) per group of 16 or 32
weights::

    w = scale_g * q            (Q4_0, Q5_0, Q8_0, Q3_K, Q6_K)
    w = scale_g * q + offset_g (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K)

``unpack_blocks`` returns that form (an exact repacking: ``q`` as int8, the group scales and
offsets computed in float32 exactly as the ``gguf`` package computes them), and
``dequantize`` evaluates it. The bit layouts follow ggml's ``block_q*`` structs
(ggml/src/ggml-common.h) and the ``gguf`` package's ``quants.py``; the values equal the
``gguf`` package's dequantization bit for bit (tests/kernels/test_gguf_blocks.py).

Everything here is device-side torch (no host round trip), so a dequantization can run
inside a CUDA graph (token embeddings dequantize the rows they read at every step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK_K = 256

# GGML type id -> (name, weights per block, bytes per block, weights per scale group)
BLOCK_TYPES: dict[int, tuple[str, int, int, int]] = {
    2: ("Q4_0", 32, 18, 32),
    3: ("Q4_1", 32, 20, 32),
    6: ("Q5_0", 32, 22, 32),
    7: ("Q5_1", 32, 24, 32),
    8: ("Q8_0", 32, 34, 32),
    10: ("Q2_K", QK_K, 84, 16),
    11: ("Q3_K", QK_K, 110, 16),
    12: ("Q4_K", QK_K, 144, 32),
    13: ("Q5_K", QK_K, 176, 32),
    14: ("Q6_K", QK_K, 210, 16),
}
# Unquantized GGML types (loaded as floats).
FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
TYPE_IDS = {name: tid for tid, (name, *_rest) in BLOCK_TYPES.items()}


def type_name(qtype: int) -> str:
    """The GGML name of a type id (``Q4_K``), or ``type <id>`` if unknown."""
    if qtype in BLOCK_TYPES:
        return BLOCK_TYPES[qtype][0]
    return FLOAT_TYPES.get(qtype, f"type {qtype}")


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of ``k`` weights.

    Raises:
        ValueError: ``k`` is not a whole number of blocks, or the type is not supported.
    """
    _name, qk, size, _group = block_info(qtype)
    if k % qk:
        raise ValueError(f"{type_name(qtype)} rows hold multiples of {qk} weights, got {k}")
    return k // qk * size


def block_info(qtype: int) -> tuple[str, int, int, int]:
    """``(name, weights per block, bytes per block, weights per group)`` of a block type.

    Raises:
        ValueError: not a supported block type.
    """
    if qtype not in BLOCK_TYPES:
        supported = ", ".join(name for name, *_r in BLOCK_TYPES.values())
        raise ValueError(f"GGUF tensor type {type_name(qtype)} is not supported ({supported} are)")
    return BLOCK_TYPES[qtype]


@dataclass
class UnpackedBlocks:
    """An exact repacking of GGUF blocks: ``w = scale * q (+ offset)`` per group.

    Attributes:
        q: ``[N, K]`` int8 quantized values.
        scale: ``[N, K / group]`` float32.
        offset: ``[N, K / group]`` float32, or None for types without one.
        group: weights per scale group (16 or 32).
    """

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group: int

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` float32; the product and the sum rounded apart, as numpy does."""
        n, k = self.q.shape
        q = self.q.float().view(n, k // self.group, self.group)
        w = self.scale.unsqueeze(-1) * q
        if self.offset is not None:
            w = w + self.offset.unsqueeze(-1)
        return w.view(n, k)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from ``[..., 2]`` uint8 -> ``[...]`` float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., B]`` bytes -> ``[..., 2B]``: the low nibbles of all bytes, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """``[..., 4]`` bytes read as a little-endian uint32 -> ``[..., count]`` bits 0..count-1."""
    word = b.to(torch.int64)
    word = word[..., 0] | word[..., 1] << 8 | word[..., 2] << 16 | word[..., 3] << 24
    shifts = torch.arange(count, device=b.device)
    return ((word.unsqueeze(-1) >> shifts) & 1).to(torch.uint8)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: twelve bytes -> eight 6-bit scales and eight 6-bit mins (uint8)."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, m_d = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _unpack_32(blocks: torch.Tensor, name: str):
    """The 32-weight block types: ``blocks [B, type_size]`` -> q ``[B, 32]``, scale, offset."""
    d = _f16(blocks[:, 0:2, None].transpose(1, 2)).reshape(-1, 1)
    if name == "Q8_0":
        return blocks[:, 2:].contiguous().view(torch.int8), d, None
    if name == "Q4_0":
        return (_nibbles(blocks[:, 2:]).to(torch.int8) - 8), d, None
    if name == "Q4_1":
        m = _f16(blocks[:, 2:4, None].transpose(1, 2)).reshape(-1, 1)
        return _nibbles(blocks[:, 4:]).to(torch.int8), d, m
    if name == "Q5_0":
        high = _bits(blocks[:, 2:6], 32) << 4
        return ((_nibbles(blocks[:, 6:]) | high).to(torch.int8) - 16), d, None
    # Q5_1
    m = _f16(blocks[:, 2:4, None].transpose(1, 2)).reshape(-1, 1)
    high = _bits(blocks[:, 4:8], 32) << 4
    return (_nibbles(blocks[:, 8:]) | high).to(torch.int8), d, m


def _unpack_k(blocks: torch.Tensor, name: str):
    """The 256-weight K-quant types: q ``[B, 256]`` and per-group scale/offset ``[B, G]``."""
    nb = blocks.shape[0]
    if name == "Q2_K":
        scales, qs = blocks[:, :16], blocks[:, 16:80]
        d, dmin = _f16(blocks[:, 80:82, None].transpose(1, 2)), _f16(
            blocks[:, 82:84, None].transpose(1, 2)
        )
        dl = d * (scales & 0x0F).float()
        ml = dmin * (scales >> 4).float()
        shifts = torch.arange(0, 8, 2, device=blocks.device, dtype=torch.uint8)
        q = (qs.reshape(nb, 2, 1, 32) >> shifts.view(1, 1, 4, 1)) & 3
        return q.reshape(nb, QK_K).to(torch.int8), dl, -ml
    if name == "Q3_K":
        hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
        d = _f16(blocks[:, 108:110, None].transpose(1, 2))
        low = torch.cat([scales[:, :8] & 0x0F, scales[:, :8] >> 4], dim=-1)
        hs = scales[:, 8:12]
        high = torch.cat([(hs >> s) & 3 for s in (0, 2, 4, 6)], dim=-1)
        sc = ((low | (high << 4)).to(torch.int8) - 32).float()
        dl = d * sc
        shifts = torch.arange(0, 8, 2, device=blocks.device, dtype=torch.uint8)
        ql = ((qs.reshape(nb, 2, 1, 32) >> shifts.view(1, 1, 4, 1)) & 3).reshape(nb, QK_K)
        bit = torch.arange(8, device=blocks.device, dtype=torch.uint8).view(1, 1, 8, 1)
        qh = ((hmask.reshape(nb, 1, 1, 32) >> bit) & 1).reshape(nb, QK_K) ^ 1
        return (ql.to(torch.int8) - (qh << 2).to(torch.int8)), dl, None
    if name == "Q6_K":
        ql, qh, scales = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208]
        d = _f16(blocks[:, 208:210, None].transpose(1, 2))
        dl = d * scales.contiguous().view(torch.int8).float()
        low = ql.reshape(nb, 2, 1, 64) >> torch.arange(0, 8, 4, device=blocks.device,
                                                        dtype=torch.uint8).view(1, 1, 2, 1)
        low = (low & 0x0F).reshape(nb, 8, 32)
        shifts = torch.arange(0, 8, 2, device=blocks.device, dtype=torch.uint8)
        high = ((qh.reshape(nb, 2, 1, 32) >> shifts.view(1, 1, 4, 1)) & 3).reshape(nb, 8, 32)
        q = (low | (high << 4)).to(torch.int8) - 32
        return q.reshape(nb, QK_K), dl, None
    # Q4_K, Q5_K
    d = _f16(blocks[:, 0:2, None].transpose(1, 2))
    dmin = _f16(blocks[:, 2:4, None].transpose(1, 2))
    sc, mn = _k_scale_min(blocks[:, 4:16])
    scale = d * sc.float()
    offset = -(dmin * mn.float())
    if name == "Q4_K":
        q = (blocks[:, 16:].reshape(nb, 4, 1, 32) >> torch.arange(
            0, 8, 4, device=blocks.device, dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F
        return q.reshape(nb, QK_K).to(torch.int8), scale, offset
    qh, qs = blocks[:, 16:48], blocks[:, 48:]
    low = (qs.reshape(nb, 4, 1, 32) >> torch.arange(
        0, 8, 4, device=blocks.device, dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F
    bit = torch.arange(8, device=blocks.device, dtype=torch.uint8).view(1, 1, 8, 1)
    high = (qh.reshape(nb, 1, 1, 32) >> bit) & 1
    q = low.reshape(nb, QK_K) | (high.reshape(nb, QK_K) << 4)
    return q.to(torch.int8), scale, offset


def unpack_blocks(raw: torch.Tensor, qtype: int) -> UnpackedBlocks:
    """Unpack GGUF blocks into ``q``, per-group scales and offsets (exactly).

    Args:
        raw: ``[N, row_bytes]`` uint8, each row ``K / QK`` blocks of the type.
        qtype: the GGML type id (``gguf.GGMLQuantizationType``).

    Returns:
        The ``UnpackedBlocks`` of the ``[N, K]`` tensor.

    Raises:
        ValueError: an unsupported type, or rows that are not whole blocks.
    """
    name, qk, size, group = block_info(qtype)
    n, nbytes = raw.shape
    if nbytes % size:
        raise ValueError(f"{name} rows of {nbytes} bytes are not whole {size}-byte blocks")
    k = nbytes // size * qk
    blocks = raw.reshape(-1, size)
    if qk == 32:
        q, scale, offset = _unpack_32(blocks, name)
    else:
        q, scale, offset = _unpack_k(blocks, name)
    return UnpackedBlocks(
        q=q.reshape(n, k),
        scale=scale.reshape(n, k // group),
        offset=None if offset is None else offset.reshape(n, k // group),
        group=group,
    )


def dequantize(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """``[N, row_bytes]`` uint8 blocks -> ``[N, K]`` float32 (bit-exact with ``gguf``).

    Raises:
        ValueError: see ``unpack_blocks``.
    """
    return unpack_blocks(raw, qtype).dequantize()

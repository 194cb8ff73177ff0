"""A layer's GGUF weights in the form its device's product reads: consecutive output rows of
one block type joined into a segment (rows of blocks are independent), held as the blocks
themselves (CUDA's Triton kernel, or dequantized per product on the CPU), as exact int4
planes for torch's CPU int4 kernel, or as floats for F16/F32 tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.kernels.quant import int4_cpu
from tokenmill.kernels.quant.gguf_blocks import block_info, dequantize, unpack_blocks
from tokenmill.model.layers.quantization.tensors import GGUFTensor


@dataclass
class GGUFSegment:
    """Consecutive output rows of one layer held in one form.

    Exactly one of ``raw`` (blocks, ``[rows, row_bytes]`` uint8), ``planes`` (a CPU kernel's
    packing) or ``dense`` (float ``[rows, K]``) is set; ``bf16_copy`` (``[rows, K]``) may
    join ``planes`` for the prompt tokens' products (``int4_cpu.planes_mm``).
    """

    start: int
    rows: int
    qtype: int | None = None
    raw: torch.Tensor | None = None
    planes: int4_cpu.Planes = field(default_factory=list)
    dense: torch.Tensor | None = None
    bf16_copy: torch.Tensor | None = None

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, rows]`` in ``x``'s dtype."""
        if self.planes:
            return int4_cpu.planes_mm(x, self.planes, self.bf16_copy)
        if self.dense is not None:
            return torch.nn.functional.linear(x, self.dense)
        assert self.raw is not None and self.qtype is not None
        if x.is_cuda:
            from tokenmill.kernels.gemm.gguf import gguf_linear

            return gguf_linear(x, self.raw, self.qtype)
        return torch.nn.functional.linear(x, dequantize(self.raw, self.qtype).to(x.dtype))

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this segment keeps (for memory accounting)."""
        out = [t for p in self.planes for t in p.tensors()]
        return out + [t for t in (self.raw, self.dense, self.bf16_copy) if t is not None]


def build_segments(
    parts: list[tuple[int, torch.Tensor | GGUFTensor]], dtype: torch.dtype, device: torch.device,
    bf16_copy: bool = False,
) -> list[GGUFSegment]:
    """Join the loaded parts (output offset, tensor) into segments in their device form;
    ``bf16_copy``: CPU int4 planes also keep the weights in bfloat16 (``GGUFSegment``)."""
    segments: list[GGUFSegment] = []
    pending: list[tuple[int, torch.Tensor | GGUFTensor]] = []

    def flush() -> None:
        if not pending:
            return
        start, first = pending[0]
        if isinstance(first, GGUFTensor):
            raw = torch.cat([p.data for _, p in pending]) if len(pending) > 1 else first.data
            segments.append(_device_segment(start, raw, first.qtype, device, bf16_copy))
        else:
            dense = torch.cat([p for _, p in pending]).to(device=device, dtype=dtype)
            segments.append(GGUFSegment(start, dense.shape[0], dense=dense))
        pending.clear()

    for start, part in sorted(parts, key=lambda p: p[0]):
        if pending:
            prev = pending[-1][1]
            same = (
                isinstance(prev, GGUFTensor) and isinstance(part, GGUFTensor)
                and prev.qtype == part.qtype
            ) or (not isinstance(prev, GGUFTensor) and not isinstance(part, GGUFTensor))
            if not same:
                flush()
        pending.append((start, part))
    flush()
    return segments


def _device_segment(start: int, raw: torch.Tensor, qtype: int, device: torch.device,
                    bf16_copy: bool) -> GGUFSegment:
    """Blocks in the form the device's product reads: as they are on CUDA; int4 planes on
    the CPU where torch's kernel takes the type's groups and the shape (with a bfloat16
    copy if asked), else as they are."""
    rows = raw.shape[0]
    if device.type != "cpu":
        return GGUFSegment(start, rows, qtype=qtype, raw=raw.to(device).contiguous())
    _name, qk, size, group = block_info(qtype)
    k = raw.shape[1] // size * qk
    if int4_cpu.supports(group, rows, k):
        u = unpack_blocks(raw, qtype)
        dense = dequantize(raw, qtype).to(torch.bfloat16) if bf16_copy else None
        return GGUFSegment(start, rows, qtype=qtype, bf16_copy=dense,
                           planes=int4_cpu.make_planes(u.q, u.scale, u.offset, group))
    return GGUFSegment(start, rows, qtype=qtype, raw=raw.contiguous())


def register_segments(layer: nn.Module, segments: list[GGUFSegment]) -> None:
    """Keep the segments on ``layer`` and register their tensors as buffers, so the
    model's weight bytes count them."""
    layer.gguf_segments = segments
    for i, seg in enumerate(segments):
        for j, t in enumerate(seg.tensors()):
            layer.register_buffer(f"gguf_{i}_{j}", t, persistent=False)


def segments_mm(segments: list[GGUFSegment], x: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` through every segment, outputs side by side: ``[..., N]``."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if len(segments) == 1:
        y = segments[0].mm(x2)
    else:
        y = torch.cat([s.mm(x2) for s in segments], dim=-1)
    return y.reshape(*shape[:-1], y.shape[-1])

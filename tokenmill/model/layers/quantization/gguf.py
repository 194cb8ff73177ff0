"""GGUF weights kept in their blocks (llama.cpp's Q4_0 ... Q6_K; ``--quantization gguf``, the
default for ``.gguf`` models).

A layer keeps each checkpoint tensor's blocks as they are in the file (merged q/k/v or
gate/up parts may have different types, as in Q4_K_M files; consecutive parts of one type
are joined, since rows of blocks are independent). The product then depends on the device:

- CUDA: a Triton kernel that dequantizes the blocks inside the GEMM
  (``tokenmill.kernels.gemm.gguf``).
- CPU: the 32-weight group types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K) are repacked
  exactly into int4 planes for torch's int4 kernel (``tokenmill.kernels.quant.int4_cpu``:
  one plane for 4-bit values, two for wider ones; scales in bfloat16, the kernel's format),
  and the products run in bfloat16. The 16-weight group types (Q2_K, Q3_K, Q6_K) keep their
  blocks and are dequantized per product (correct, slower).

Token embeddings keep their blocks too; a lookup dequantizes only the rows it reads, and a
tied LM head shares them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.kernels.quant import int4_cpu
from tokenmill.kernels.quant.gguf_blocks import block_info, dequantize, unpack_blocks
from tokenmill.model.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    ShardSlice,
)
from tokenmill.model.layers.quantization.tensors import GGUFTensor


@dataclass
class GGUFSegment:
    """Consecutive output rows of one layer held in one form.

    Exactly one of ``raw`` (blocks, ``[rows, row_bytes]`` uint8), ``planes`` (CPU int4
    planes) or ``dense`` (float ``[rows, K]``) is set.
    """

    start: int
    rows: int
    qtype: int | None = None
    raw: torch.Tensor | None = None
    planes: list[int4_cpu.Int4Plane] = field(default_factory=list)
    dense: torch.Tensor | None = None

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K]`` -> ``[M, rows]`` in ``x``'s dtype."""
        if self.planes:
            return int4_cpu.planes_mm(x, self.planes)
        if self.dense is not None:
            return torch.nn.functional.linear(x, self.dense)
        assert self.raw is not None and self.qtype is not None
        if x.is_cuda:
            from tokenmill.kernels.gemm.gguf import gguf_linear

            return gguf_linear(x, self.raw, self.qtype)
        return torch.nn.functional.linear(x, dequantize(self.raw, self.qtype).to(x.dtype))

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this segment keeps (for memory accounting)."""
        out = [t for p in self.planes for t in (p.packed, p.scales_and_zeros)]
        return out + [t for t in (self.raw, self.dense) if t is not None]


def build_segments(
    parts: list[tuple[int, torch.Tensor | GGUFTensor]], dtype: torch.dtype, device: torch.device
) -> list[GGUFSegment]:
    """Join the loaded parts (output offset, tensor) into segments in their device form."""
    segments: list[GGUFSegment] = []
    pending: list[tuple[int, torch.Tensor | GGUFTensor]] = []

    def flush() -> None:
        if not pending:
            return
        start, first = pending[0]
        if isinstance(first, GGUFTensor):
            raw = torch.cat([p.data for _, p in pending]) if len(pending) > 1 else first.data
            segments.append(_device_segment(start, raw, first.qtype, device))
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


def _device_segment(start: int, raw: torch.Tensor, qtype: int, device: torch.device
                    ) -> GGUFSegment:
    """Blocks in the form the device's product reads: as they are on CUDA; int4 planes on
    the CPU where torch's kernel takes the type's groups and the shape, else as they are."""
    rows = raw.shape[0]
    if device.type != "cpu":
        return GGUFSegment(start, rows, qtype=qtype, raw=raw.to(device).contiguous())
    _name, qk, size, group = block_info(qtype)
    k = raw.shape[1] // size * qk
    if int4_cpu.supports(group, rows, k):
        u = unpack_blocks(raw, qtype)
        return GGUFSegment(start, rows, qtype=qtype,
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


def _placeholder() -> nn.Parameter:
    return nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)


class GGUFLinearMethod(LinearMethod):
    """A linear layer over GGUF blocks (see the module docstring)."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype
    ) -> None:
        layer.weight = _placeholder()
        layer.gguf_parts = []
        layer.gguf_dtype = dtype

    def load_weight(
        self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, s: ShardSlice
    ) -> None:
        if layer.tp_size > 1:
            raise QuantizationError("GGUF weights with tensor parallelism are not supported")
        start = s.dst_start or 0
        size = s.size if s.size is not None else sum(layer.output_partition_sizes)
        if loaded.shape[-2] != size and s.size is not None:  # a part of a fused tensor
            loaded = (loaded.rows(s.src_start, size) if isinstance(loaded, GGUFTensor)
                      else loaded.narrow(0, s.src_start, size))
        if isinstance(loaded, GGUFTensor):
            n, k = loaded.shape[-2:]
            if loaded.data.shape[-2] != size or k != layer.input_size:
                raise QuantizationError(
                    f"tensor {getattr(param, '_tm_name', '?')!r} has shape {(n, k)}, expected "
                    f"{(size, layer.input_size)}"
                )
        elif tuple(loaded.shape) != (size, layer.input_size):
            raise QuantizationError(
                f"tensor {getattr(param, '_tm_name', '?')!r} has shape {tuple(loaded.shape)}, "
                f"expected {(size, layer.input_size)}"
            )
        layer.gguf_parts.append((start, loaded))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        device = layer.bias.device if layer.bias is not None else layer.weight.device
        segments = build_segments(layer.gguf_parts, layer.gguf_dtype, device)
        layer.gguf_parts = []
        register_segments(layer, segments)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        y = segments_mm(layer.gguf_segments, x)
        return y if bias is None else y + bias


class GGUFEmbeddingMethod:
    """Token embeddings (and a tied or separate LM head) over GGUF blocks.

    ``embed(ids [T]) -> [T, H]`` dequantizes only the rows read; ``apply(hidden [N, H]) ->
    [N, V]`` is the LM head's product (shared with the tied embedding's blocks).
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.raw: torch.Tensor | None = None
        self.qtype: int | None = None
        self.dense: torch.Tensor | None = None
        self.segments: list[GGUFSegment] = []

    def load(self, layer: nn.Module, loaded: torch.Tensor | GGUFTensor) -> None:
        if isinstance(loaded, GGUFTensor):
            self.raw, self.qtype = loaded.data, loaded.qtype
        else:
            self.dense = loaded
        expected = (layer.num_embeddings, layer.embedding_dim)
        got = tuple(loaded.shape)
        if got != expected:
            raise QuantizationError(
                f"tensor {getattr(layer.weight, '_tm_name', '?')!r} has shape {got}, expected "
                f"{expected}"
            )

    def process_weights_after_loading(self, layer: nn.Module, device: torch.device) -> None:
        if self.raw is not None:
            self.raw = self.raw.to(device).contiguous()
            layer.register_buffer("gguf_raw", self.raw, persistent=False)
        else:
            assert self.dense is not None
            self.dense = self.dense.to(device=device, dtype=self.dtype)
            layer.register_buffer("gguf_dense", self.dense, persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.raw is None:
            return torch.nn.functional.embedding(ids, self.dense)
        rows = self.raw.index_select(0, ids.reshape(-1))
        return dequantize(rows, self.qtype).to(self.dtype).reshape(*ids.shape, -1)

    def build_head(self, layer: nn.Module) -> None:
        """Make the LM head's product form (CPU int4 planes) from the blocks, once."""
        if self.segments:
            return
        part = GGUFTensor(self.raw, self.qtype, (layer.num_embeddings, layer.embedding_dim)) \
            if self.raw is not None else self.dense
        device = (self.raw if self.raw is not None else self.dense).device
        self.segments = build_segments([(0, part)], self.dtype, device)
        # The planes are new tensors (the embedding keeps the blocks): count them.
        for i, seg in enumerate(self.segments):
            for j, t in enumerate(seg.tensors()):
                if t is not self.raw and t is not self.dense:
                    layer.register_buffer(f"gguf_head_{i}_{j}", t, persistent=False)

    def apply(self, hidden: torch.Tensor) -> torch.Tensor:
        return segments_mm(self.segments, hidden)


class GGUFConfig(QuantizationConfig):
    """Every linear layer, the embeddings and the LM head keep their GGUF blocks."""

    name = "gguf"

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return GGUFLinearMethod()

    def get_moe_method(self, layer: nn.Module, prefix: str):
        from tokenmill.model.layers.quantization.moe import GGUFMoEMethod

        return GGUFMoEMethod()

    def quantizes_embeddings(self) -> bool:
        return True

    def describe(self) -> str:
        return "gguf (weights kept in their GGUF blocks)"

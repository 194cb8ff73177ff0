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
  and the products run in bfloat16; where ``KernelConfig.cpu_bf16_weights`` keeps a
  bfloat16 copy too, the prompt tokens' products run on it. The 16-weight group types (Q2_K,
  Q3_K, Q6_K) keep their blocks and are dequantized per product (correct, slower).

Token embeddings keep their blocks too; a lookup dequantizes only the rows it reads, and a
tied LM head shares them.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels.cpu.block_gemm import BlockWeights
from tokenmill.kernels.quant.gguf_blocks import dequantize
from tokenmill.model.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    ShardSlice,
    keeps_cpu_bf16_copy,
)
from tokenmill.model.layers.quantization.gguf_segments import (
    GGUFSegment,
    build_segments,
    register_segments,
    segments_mm,
)
from tokenmill.model.layers.quantization.tensors import GGUFTensor
from tokenmill.model.layers.weight_shape import WeightShapeError


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
        layer.gguf_bf16_copy = keeps_cpu_bf16_copy()

    def load_weight(
        self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, s: ShardSlice
    ) -> None:
        if layer.tp_size > 1:
            raise QuantizationError("GGUF weights with tensor parallelism are not supported")
        start = s.dst_start or 0
        size = s.size if s.size is not None else sum(layer.output_partition_sizes)
        if s.src_size is not None and loaded.shape[-2] != s.src_size:
            # A larger tensor is refused, not cut to the part's rows (WeightShapeError: the
            # loader names the checkpoint tensor).
            raise WeightShapeError(
                f"has shape {tuple(loaded.shape)}, expected {s.src_size} along dimension 0"
            )
        if loaded.shape[-2] != size and s.size is not None:  # a part of a fused tensor
            loaded = (loaded.rows(s.src_start, size) if isinstance(loaded, GGUFTensor)
                      else loaded.narrow(0, s.src_start, size))
        if isinstance(loaded, GGUFTensor):
            n, k = loaded.shape[-2:]
            if loaded.data.shape[-2] != size or k != layer.input_size:
                raise WeightShapeError(f"has shape {(n, k)}, expected {(size, layer.input_size)}")
        elif tuple(loaded.shape) != (size, layer.input_size):
            raise WeightShapeError(
                f"has shape {tuple(loaded.shape)}, expected {(size, layer.input_size)}")
        layer.gguf_parts.append((start, loaded))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        device = layer.bias.device if layer.bias is not None else layer.weight.device
        segments = build_segments(layer.gguf_parts, layer.gguf_dtype, device,
                                  layer.gguf_bf16_copy)
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
    [N, V]`` is the LM head's product (shared with the tied embedding's blocks). Where the
    head is packed for the native block product, the tied embedding reads its rows from that
    packing and the blocks are dropped (one copy of the vocabulary's weights).
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.bf16_copy = keeps_cpu_bf16_copy()
        self.raw: torch.Tensor | None = None
        self.qtype: int | None = None
        self.dense: torch.Tensor | None = None
        self.segments: list[GGUFSegment] = []
        self.head_rows: BlockWeights | None = None  # the embedding's rows, in the head
        self.raw_owner: nn.Module | None = None

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
            self.raw_owner = layer
        else:
            assert self.dense is not None
            self.dense = self.dense.to(device=device, dtype=self.dtype)
            layer.register_buffer("gguf_dense", self.dense, persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.head_rows is not None:
            return self.head_rows.rows(ids).to(self.dtype).reshape(*ids.shape, -1)
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
        self.segments = build_segments([(0, part)], self.dtype, device, self.bf16_copy)
        # The planes are new tensors (the embedding keeps the blocks): count them.
        for i, seg in enumerate(self.segments):
            for j, t in enumerate(seg.tensors()):
                if t is not self.raw and t is not self.dense:
                    layer.register_buffer(f"gguf_head_{i}_{j}", t, persistent=False)
        planes = self.segments[0].planes if len(self.segments) == 1 else []
        if self.raw is not None and planes and isinstance(planes[0], BlockWeights):
            self.head_rows = planes[0]
            if self.raw_owner is not None:
                delattr(self.raw_owner, "gguf_raw")
            self.raw = None

    def apply(self, hidden: torch.Tensor) -> torch.Tensor:
        return segments_mm(self.segments, hidden)


class GGUFConfig(QuantizationConfig):
    """Every linear layer, the embeddings and the LM head keep their GGUF blocks."""

    name = "gguf"

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod:
        return GGUFLinearMethod()

    def get_moe_method(self, layer: nn.Module, prefix: str):
        from tokenmill.model.layers.quantization.moe import GGUFMoEMethod

        w13 = getattr(layer, "w13", None)
        if w13 is not None and (w13.bias is not None or w13.mxfp4):
            return None  # gpt-oss' experts: read as its checkpoint's (MXFP4 or float)
        return GGUFMoEMethod()

    def quantizes_embeddings(self) -> bool:
        return True

    def describe(self) -> str:
        return "gguf (weights kept in their GGUF blocks)"

"""Linear layers that know how to load (and shard) their weights.

Column-parallel layers split the output dimension across tensor-parallel ranks, row-parallel
layers the input dimension (Megatron-LM, Shoeybi et al. 2019). Merged layers (q/k/v, gate/up)
hold several checkpoint tensors in one weight so one GEMM computes them all; each
checkpoint tensor is loaded into its slice by ``weight_loader(param, tensor, shard_id)``.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import current_kernel_config
from tokenmill.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from tokenmill.model.layers.quantization.base import (
    LinearMethod,
    ShardSlice,
    copy_shard,
    set_layout,
)
from tokenmill.model.layers.quantization.context import active_config
from tokenmill.model.layers.quantization.tensors import as_float
from tokenmill.model.layers.quantization.unquantized import UnquantizedLinearMethod
from tokenmill.model.layers.weight_shape import check_shape


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into ``param``, checking the shape (quantized blocks
    are dequantized first: this parameter keeps floats)."""
    loaded = as_float(loaded)
    check_shape(getattr(param, "_tm_name", "?"), param.shape, loaded.shape)
    param.data.copy_(loaded)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class LinearBase(nn.Module):
    """``y = x W^T (+ b)``; the weight's form and the product come from the layer's
    ``LinearMethod`` (``tokenmill.model.layers.quantization``), unquantized by default. The
    unquantized product of decode-sized batches follows ``KernelConfig.skinny_gemm`` of the
    model being built (``skinny_gemm``).

    Inside ``quantization_context`` the weights wait for ``create_weights`` (called by
    ``create_quantized_weights`` once the layer's name is known).
    """

    # Every tensor-parallel rank holds the whole weight (``ReplicatedLinear``: MoE routers,
    # which the int4 methods and bitsandbytes leave unquantized, as vLLM does).
    replicated = False

    def __init__(
        self, input_size: int, output_size: int, bias: bool,
        output_sizes: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        # Output features of each merged part on this rank (one part unless merged).
        self.output_partition_sizes = output_sizes or [output_size]
        self.skinny_gemm = current_kernel_config().skinny_gemm
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.quant_method: LinearMethod | None = None
        # The layer's module name in the model (``model.layers.3.mlp.down_proj``), given by
        # ``create_quantized_weights``; error messages name the layer by it.
        self.prefix = ""
        if active_config() is None:
            self.create_weights(UnquantizedLinearMethod())
        if bias:
            self.bias = set_layout(
                nn.Parameter(torch.empty(output_size), requires_grad=False), 0, None
            )
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def create_weights(self, method: LinearMethod) -> None:
        """Let ``method`` register the weight parameters (in the default dtype)."""
        before = set(self._parameters)
        self.quant_method = method
        method.create_weights(
            self, self.input_size, self.output_partition_sizes, torch.get_default_dtype()
        )
        for name in set(self._parameters) - before:
            self._parameters[name].weight_loader = self.weight_loader  # type: ignore[union-attr]

    def shard_slices(self, shard_id: str | int | None) -> list[ShardSlice]:
        """Where a checkpoint tensor (a merged part ``shard_id``) goes, in features."""
        return [ShardSlice()]

    def checkpoint_shape(self, shard_id: str | int | None = None) -> tuple[int, int]:
        """``(output, input)`` features of the checkpoint tensor ``shard_id`` (a merged
        part, None: every part), unsharded."""
        return self.output_size, self.input_size

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        if param is self.bias:
            for s in self.shard_slices(shard_id):
                copy_shard(param, loaded, s, getattr(param, "_tm_name", "?"))
            return
        assert self.quant_method is not None, "weights not created"
        for s in self.shard_slices(shard_id):
            self.quant_method.load_weight(self, param, loaded, s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)  # type: ignore[union-attr]


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole (e.g. MoE routers)."""

    replicated = True


class ColumnParallelLinear(LinearBase):
    """Output dimension split across ranks; each rank computes its slice of ``y``.

    Shapes: ``x [T, input_size] -> y [T, output_size / tp]``.
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False,
        output_sizes: list[int] | None = None,
    ) -> None:
        self.full_output_size = output_size
        tp = get_tensor_model_parallel_world_size()
        per_rank = [_divide(s, tp, "output size") for s in output_sizes] if output_sizes else None
        super().__init__(input_size, _divide(output_size, tp, "output size"), bias, per_rank)

    def shard_slices(self, shard_id=None) -> list[ShardSlice]:
        if self.tp_size == 1:
            return [ShardSlice()]
        size = self.output_size
        return [ShardSlice(size=size, src_start=self.tp_rank * size,
                           src_size=self.checkpoint_shape()[0])]  # fmt: skip

    def checkpoint_shape(self, shard_id=None) -> tuple[int, int]:
        return self.full_output_size, self.input_size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs (e.g. gate and up projections) in one weight.

    ``shard_id`` is the index of the part in ``output_sizes``; None: a checkpoint tensor
    that already holds every part (e.g. Phi-3 ``gate_up_proj``).
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, output_sizes)

    def forward_gated(self, x: torch.Tensor) -> torch.Tensor | None:
        """A gate/up pair's ``silu(gate) * up`` in the product's launch, where the layer's
        method computes it (unquantized: ``gated_dense``); None elsewhere (the caller applies
        the gate).

        Shapes: ``x [M, K]`` -> ``[M, N/2]``.
        """
        return self.quant_method.apply_gated(self, x, self.bias)  # type: ignore[union-attr]

    def shard_slices(self, shard_id=None) -> list[ShardSlice]:
        parts = range(len(self.output_sizes)) if shard_id is None else [int(shard_id)]
        slices = []
        for i in parts:
            per_rank = self.output_sizes[i] // self.tp_size
            src = self.tp_rank * per_rank + (sum(self.output_sizes[:i]) if shard_id is None else 0)
            slices.append(ShardSlice(i, sum(self.output_sizes[:i]) // self.tp_size, per_rank, src,
                                     src_size=self.checkpoint_shape(shard_id)[0]))  # fmt: skip
        return slices

    def checkpoint_shape(self, shard_id=None) -> tuple[int, int]:
        out = sum(self.output_sizes) if shard_id is None else self.output_sizes[int(shard_id)]
        return out, self.input_size


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one weight: ``[q | k | v]`` along the output.

    With tensor parallelism each rank holds ``num_heads / tp`` query heads and
    ``max(1, num_kv_heads / tp)`` KV heads (KV heads are replicated when there are fewer
    of them than ranks). ``shard_id`` is "q", "k" or "v"; None: a fused checkpoint tensor
    (e.g. Phi-3 ``qkv_proj``).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp = get_tensor_model_parallel_world_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "number of attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "number of KV heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp, num_kv_heads, "tensor-parallel size")
        self.total_num_kv_heads = num_kv_heads
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        # Built with the per-rank size directly: the base class would divide again.
        LinearBase.__init__(self, hidden_size, q + 2 * kv, bias, [q, kv, kv])
        self.full_output_size = (q + 2 * kv) * tp

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def shard_slices(self, shard_id=None) -> list[ShardSlice]:
        q_full = self.num_heads * self.tp_size * self.head_dim
        kv_full = self.total_num_kv_heads * self.head_dim
        kv_rank = self.tp_rank // self.kv_replicas
        table = {
            "q": (0, self.q_size, self.tp_rank * self.q_size, 0),
            "k": (self.q_size, self.kv_size, kv_rank * self.kv_size, q_full),
            "v": (self.q_size + self.kv_size, self.kv_size, kv_rank * self.kv_size,
                  q_full + kv_full),
        }
        parts = ("q", "k", "v") if shard_id is None else (shard_id,)
        slices = []
        for sid in parts:
            dst, size, src, fused_start = table[sid]
            src += fused_start if shard_id is None else 0
            slices.append(ShardSlice(sid, dst, size, src,
                                     src_size=self.checkpoint_shape(shard_id)[0]))  # fmt: skip
        return slices

    def checkpoint_shape(self, shard_id=None) -> tuple[int, int]:
        q = self.num_heads * self.tp_size * self.head_dim
        kv = self.total_num_kv_heads * self.head_dim
        out = {None: q + 2 * kv, "q": q, "k": kv, "v": kv}[shard_id]
        return out, self.input_size


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks; partial outputs are summed (all-reduce).

    Shapes: ``x [T, input_size / tp] -> y [T, output_size]``. The bias is added once,
    after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp = get_tensor_model_parallel_world_size()
        super().__init__(_divide(input_size, tp, "input size"), output_size, bias)

    def shard_slices(self, shard_id=None) -> list[ShardSlice]:
        if self.tp_size == 1:
            return [ShardSlice()]
        size = self.input_size
        return [ShardSlice(in_start=self.tp_rank * size, in_size=size)]

    def checkpoint_shape(self, shard_id=None) -> tuple[int, int]:
        return self.output_size, self.input_size * self.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce_output(self.quant_method.apply(self, x))  # type: ignore[union-attr]

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial product ``y [T, output_size]`` summed over the ranks (in
        place), then the bias. A LoRA layer adds its term to ``y`` before this."""
        if self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y

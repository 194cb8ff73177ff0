"""Linear layers that know how to load (and shard) their weights.

Column-parallel layers split the output dimension across tensor-parallel ranks, row-parallel
layers the input dimension (Megatron-LM, Shoeybi et al. 2019). Merged layers (q/k/v, gate/up)
hold several checkpoint tensors in one weight so one GEMM computes them all; each
checkpoint tensor is loaded into its slice by ``weight_loader(param, tensor, shard_id)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import SkinnyGemm, current_kernel_config
from tokenmill.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
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


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape its parameter expects."""


def check_shape(param_name: str, expected: torch.Size, got: torch.Size) -> None:
    if tuple(expected) != tuple(got):
        raise WeightShapeError(
            f"tensor {param_name!r} has shape {tuple(got)}, expected {tuple(expected)}"
        )


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into ``param``, checking the shape."""
    check_shape(getattr(param, "_tm_name", "?"), param.shape, loaded.shape)
    param.data.copy_(loaded)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class LinearBase(nn.Module):
    """``y = x W^T (+ b)`` with weight ``[out_per_rank, in_per_rank]``; its kernel for
    decode-sized batches is ``KernelConfig.skinny_gemm`` of the model being built."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.skinny_gemm = current_kernel_config().skinny_gemm
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias, self.skinny_gemm)


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole (e.g. MoE routers)."""


class ColumnParallelLinear(LinearBase):
    """Output dimension split across ranks; each rank computes its slice of ``y``.

    Shapes: ``x [T, input_size] -> y [T, output_size / tp]``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.full_output_size = output_size
        super().__init__(input_size, _divide(output_size, get_tensor_model_parallel_world_size(),
                                             "output size"), bias)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        shard = param.shape[0]
        loaded = loaded.narrow(0, self.tp_rank * shard, shard) if self.tp_size > 1 else loaded
        default_weight_loader(param, loaded)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs (e.g. gate and up projections) in one weight.

    ``shard_id`` is the index of the part in ``output_sizes``.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def forward_gated(self, x: torch.Tensor) -> torch.Tensor | None:
        """A gate/up pair's ``silu(gate) * up`` in the product's launch, where the skinny GEMM
        computes it (``gated_dense``); None elsewhere (the caller applies the gate).

        Shapes: ``x [M, K]`` -> ``[M, N/2]``.
        """
        return gated_dense(x, self.weight, self.bias, self.skinny_gemm)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if shard_id is None:  # an already-merged checkpoint tensor (e.g. Phi-3 gate_up_proj)
            for i, size in enumerate(self.output_sizes):
                offset = sum(self.output_sizes[:i])
                self.weight_loader(param, loaded.narrow(0, offset, size), i)
            return
        i = int(shard_id)
        per_rank = self.output_sizes[i] // self.tp_size
        offset = sum(self.output_sizes[:i]) // self.tp_size
        if self.tp_size > 1:
            loaded = loaded.narrow(0, self.tp_rank * per_rank, per_rank)
        target = param.data.narrow(0, offset, per_rank)
        check_shape(f"{getattr(param, '_tm_name', '?')}[{i}]", target.shape, loaded.shape)
        target.copy_(loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one weight: ``[q | k | v]`` along the output.

    With tensor parallelism each rank holds ``num_heads / tp`` query heads and
    ``max(1, num_kv_heads / tp)`` KV heads (KV heads are replicated when there are fewer
    of them than ranks). ``shard_id`` is "q", "k" or "v".
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
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        # Built with the per-rank size directly: the base class would divide again.
        LinearBase.__init__(self, hidden_size, out, bias)
        self.full_output_size = out * tp

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if shard_id is None:  # a fused qkv checkpoint tensor (e.g. Phi-3 qkv_proj)
            q = self.num_heads * self.tp_size * self.head_dim
            kv = (loaded.shape[0] - q) // 2
            for sid, start, size in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                self.weight_loader(param, loaded.narrow(0, start, size), sid)
            return
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        else:
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, rank = self.kv_size, self.tp_rank // self.kv_replicas
        if self.tp_size > 1:
            loaded = loaded.narrow(0, rank * size, size)
        target = param.data.narrow(0, offset, size)
        check_shape(f"{getattr(param, '_tm_name', '?')}[{shard_id}]", target.shape, loaded.shape)
        target.copy_(loaded)


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks; partial outputs are summed (all-reduce).

    Shapes: ``x [T, input_size / tp] -> y [T, output_size]``. The bias is added once,
    after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp = get_tensor_model_parallel_world_size()
        super().__init__(_divide(input_size, tp, "input size"), output_size, bias)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if self.tp_size > 1 and param.dim() == 2:
            shard = param.shape[1]
            loaded = loaded.narrow(1, self.tp_rank * shard, shard)
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = dense(x, self.weight, skinny=self.skinny_gemm)
        if self.tp_size > 1:
            y = tensor_model_parallel_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y

"""Mixture-of-experts (MoE) layer: the routed experts' stacked weights and how checkpoints
fill them; routing and the expert kernels are ``kernels/moe/fused_moe.py``.

Expert weights are stacked per layer: ``w13 [E, 2I, H]`` (gate rows then up rows) and
``w2 [E, H, I]``, so each kernel reads one tensor; checkpoints that store one tensor per
expert are loaded into them by ``weight_loader(param, tensor, (expert_id, shard))``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenmill.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from tokenmill.kernels.moe.fused_moe import fused_experts, select_experts
from tokenmill.model.layers.quantization.tensors import as_float
from tokenmill.model.layers.weight_shape import check_shape


class ExpertWeights(nn.Module):
    """One stacked weight of all experts, ``[E, rows, cols]``, filled one expert at a time."""

    def __init__(
        self,
        num_experts: int,
        rows: int,
        cols: int,
        loader: Callable[[nn.Parameter, torch.Tensor, Any], None],
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, rows, cols), requires_grad=False)
        self.weight.weight_loader = loader


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer: ``forward(hidden [T, H], router_logits [T, E])``.

    Parameters ``w13.weight [E, 2I/tp, H]`` (gate rows then up rows) and
    ``w2.weight [E, H, I/tp]``; with tensor parallelism each rank holds a slice of every
    expert's intermediate dimension and the outputs are all-reduced (Megatron-style).

    Args:
        num_experts: ``E``.
        top_k: experts per token.
        hidden_size: ``H``.
        intermediate_size: each expert's ``I`` (all ranks together).
        renormalize: renormalise the top-k routing weights to sum to 1.

    Raises:
        ValueError: ``intermediate_size`` is not divisible by the tensor-parallel size.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"MoE intermediate size ({intermediate_size}) is not divisible by the "
                f"tensor-parallel size ({self.tp_size})"
            )
        self.intermediate_per_rank = intermediate_size // self.tp_size
        i = self.intermediate_per_rank
        self.w13 = ExpertWeights(num_experts, 2 * i, hidden_size, self._load_w13)
        self.w2 = ExpertWeights(num_experts, hidden_size, i, self._load_w2)
        self.hidden_size = hidden_size
        # A quantized checkpoint's experts (``tokenmill.model.layers.quantization.moe``).
        self.quant_method: Any = None

    def set_quant_method(self, method: Any) -> None:
        """Hold the experts' weights as ``method`` creates them (quantized checkpoints)."""
        self.quant_method = method
        method.create_weights(self)

    @staticmethod
    def expert_params_mapping(
        num_experts: int, gate_name: str, up_name: str, down_name: str
    ) -> list[tuple[str, str, tuple[int, str]]]:
        """``stacked_params_mapping`` entries for per-expert checkpoint tensors.

        Maps ``experts.{e}.{gate_name}`` / ``{up_name}`` into ``experts.w13`` and
        ``experts.{e}.{down_name}`` into ``experts.w2`` with shard id ``(e, "gate"|"up"|"down")``.
        """
        mapping = []
        for e in range(num_experts):
            mapping += [
                ("experts.w13", f"experts.{e}.{gate_name}", (e, "gate")),
                ("experts.w13", f"experts.{e}.{up_name}", (e, "up")),
                ("experts.w2", f"experts.{e}.{down_name}", (e, "down")),
            ]
        return mapping

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
        loaded = as_float(loaded)
        expert, part = self._parse_shard(shard_id, ("gate", "up"))
        i = self.intermediate_per_rank
        if self.tp_size > 1:
            loaded = loaded.narrow(0, self.tp_rank * i, i)
        target = param.data[expert].narrow(0, 0 if part == "gate" else i, i)
        check_shape(f"{getattr(param, '_tm_name', '?')}[{expert}, {part}]", target.shape,
                    loaded.shape)
        target.copy_(loaded)

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
        loaded = as_float(loaded)
        expert, _ = self._parse_shard(shard_id, ("down",))
        i = self.intermediate_per_rank
        if self.tp_size > 1:
            loaded = loaded.narrow(1, self.tp_rank * i, i)
        target = param.data[expert]
        check_shape(f"{getattr(param, '_tm_name', '?')}[{expert}]", target.shape, loaded.shape)
        target.copy_(loaded)

    def _parse_shard(self, shard_id: Any, parts: tuple[str, ...]) -> tuple[int, str]:
        if not isinstance(shard_id, tuple) or shard_id[1] not in parts:
            raise ValueError(f"expert weights need a shard id (expert, one of {parts}), "
                             f"got {shard_id!r}")
        if not 0 <= shard_id[0] < self.num_experts:
            raise ValueError(f"expert id {shard_id[0]} out of range [0, {self.num_experts})")
        return int(shard_id[0]), shard_id[1]

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.quant_method is not None:
            out = self.quant_method.apply(self, hidden, weights, ids)
        else:
            out = fused_experts(hidden, self.w13.weight, self.w2.weight, weights, ids)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

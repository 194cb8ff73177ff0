"""Mixture-of-experts (MoE) layer: routing, the routed experts' stacked weights and how
checkpoints fill them (``expert_weights.py``); the expert kernels are
``kernels/moe/fused_moe.py``.

Expert weights are stacked per layer: ``w13 [E, 2I, H]`` (gate rows then up rows) and
``w2 [E, H, I]``, so each kernel reads one tensor; checkpoints that store one tensor per
expert are loaded into them by ``weight_loader(param, tensor, (expert_id, shard))``, and
whole-layer tensors (Llama 4, gpt-oss) with shard id None in the layer's
``checkpoint_layout``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from tokenmill.config import current_kernel_config
from tokenmill.distributed.parallel_state import (
    expert_parallel_enabled,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from tokenmill.kernels.moe.fused_moe import fused_experts, select_experts
from tokenmill.kernels.moe.mxfp4 import MXFP4_BLOCK
from tokenmill.kernels.moe.tiles import SILU, GatedActivation
from tokenmill.model.layers.expert_weights import (
    CheckpointLayout,
    ExpertWeights,
    copy_checked,
    narrow_w2,
    narrow_w13,
    stacked_w2,
    stacked_w13,
)
from tokenmill.model.layers.quantization.base import QuantizationError
from tokenmill.model.layers.quantization.tensors import as_float
from tokenmill.model.layers.weight_shape import check_shape


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer: ``forward(hidden [T, H], router_logits [T, E])``.

    Parameters ``w13.weight [E, 2I/tp, H]`` (gate rows then up rows) and
    ``w2.weight [E, H, I/tp]`` (MXFP4: ``w13.blocks``/``w13.scales`` and ``w2.blocks``/
    ``w2.scales``), with ``w13.bias``/``w2.bias`` when the experts have biases; with tensor
    parallelism each rank holds a slice of every expert's intermediate dimension and the
    outputs are all-reduced (Megatron-style).
    With expert parallelism (``--enable-expert-parallel``) each rank instead holds
    ``E_local`` whole experts, a contiguous range (the first ``E % tp`` ranks one more, as
    vLLM spreads them): ``w13.weight [E_local, 2I, H]``, ``w2.weight [E_local, H, I]``. Every
    rank has every token (the hidden states are replicated over the group), computes the
    assignments to its own experts, and the all-reduce sums the ranks' parts.

    Args:
        num_experts: ``E``.
        top_k: experts per token.
        hidden_size: ``H``.
        intermediate_size: each expert's ``I`` (all ranks together).
        renormalize: renormalise the top-k routing weights to sum to 1 (softmax scoring).
        scoring: ``"softmax"``: softmax over all experts, keep the top k (Mixtral, Qwen3-MoE,
            gpt-oss with ``renormalize``); ``"sigmoid"``: the top k logits, each through a
            sigmoid (Llama 4).
        apply_router_weight_on_input: scale each expert's input by its routing weight
            instead of its output (Llama 4).
        bias: the experts have biases.
        activation: how gate and up combine (SiLU, or gpt-oss' clamped form).
        mxfp4: the expert weights are MXFP4 (decoded by the kernels).
        checkpoint_layout: how the checkpoint stores the experts (``expert_weights.py``).

    Raises:
        ValueError: ``intermediate_size`` is not divisible by the tensor-parallel size (with
            MXFP4: into whole blocks of 32).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        *,
        scoring: Literal["softmax", "sigmoid"] = "softmax",
        apply_router_weight_on_input: bool = False,
        bias: bool = False,
        activation: GatedActivation = SILU,
        mxfp4: bool = False,
        checkpoint_layout: CheckpointLayout = "per_expert",
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.scoring = scoring
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self.activation = activation
        self.prompt_experts = current_kernel_config().moe_prompt_experts
        self.checkpoint_layout = checkpoint_layout
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        # Expert parallelism: global expert id -> index in this rank's weights, -1 for the
        # experts of other ranks. A buffer, so it follows the module to its device.
        self.register_buffer("expert_map", None, persistent=False)
        self.hidden_size = hidden_size
        # A quantized checkpoint's experts (``tokenmill.model.layers.quantization.moe``).
        self.quant_method: Any = None
        if expert_parallel_enabled():
            if mxfp4 or bias or checkpoint_layout != "per_expert":
                raise ValueError("expert parallelism supports experts read from one tensor "
                                 "per expert, without biases or MXFP4 (not Llama 4 or "
                                 "gpt-oss)")  # fmt: skip
            self._init_expert_parallel(num_experts, hidden_size, intermediate_size)
            return
        unit = self.tp_size * (MXFP4_BLOCK if mxfp4 else 1)
        if intermediate_size % unit:
            raise ValueError(
                f"MoE intermediate size ({intermediate_size}) is not divisible by the "
                f"tensor-parallel size ({self.tp_size})"
                + (f" into blocks of {MXFP4_BLOCK} (MXFP4)" if mxfp4 else "")
            )
        self.intermediate_per_rank = intermediate_size // self.tp_size
        i = self.intermediate_per_rank
        self.w13 = ExpertWeights(num_experts, 2 * i, hidden_size, self._load_w13, mxfp4, bias)
        self.w2 = ExpertWeights(num_experts, hidden_size, i, self._load_w2, mxfp4, bias)

    def set_quant_method(self, method: Any) -> None:
        """Hold the experts' weights as ``method`` creates them (quantized checkpoints).

        Raises:
            QuantizationError: experts the quantized methods do not compute (biases, MXFP4,
                an activation other than SiLU, whole-layer checkpoint tensors).
        """
        if self.w13.bias is not None or self.w13.mxfp4 or self.activation is not SILU:
            raise QuantizationError("quantized experts support SiLU experts without biases "
                                    "only (not gpt-oss' experts)")  # fmt: skip
        if self.checkpoint_layout != "per_expert":
            raise QuantizationError("quantized experts are read from one tensor per expert; "
                                    "this model's checkpoint stacks them (Llama 4)")  # fmt: skip
        self.quant_method = method
        method.create_weights(self)

    def _init_expert_parallel(
        self, num_experts: int, hidden_size: int, intermediate_size: int
    ) -> None:
        base, extra = divmod(num_experts, self.tp_size)
        self.num_local_experts = base + (self.tp_rank < extra)
        self.first_expert = self.tp_rank * base + min(self.tp_rank, extra)
        local = torch.full((num_experts,), -1, dtype=torch.int32)
        span = slice(self.first_expert, self.first_expert + self.num_local_experts)
        local[span] = torch.arange(self.num_local_experts, dtype=torch.int32)
        self.expert_map = local
        self.intermediate_per_rank = i = intermediate_size
        self.w13 = ExpertWeights(self.num_local_experts, 2 * i, hidden_size, self._load_w13)
        self.w2 = ExpertWeights(self.num_local_experts, hidden_size, i, self._load_w2)

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

    # ---- loading ---------------------------------------------------------------------------

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
        loaded = as_float(loaded)
        i = self.intermediate_per_rank
        if shard_id is None:
            loaded = self._as_checkpoint_layout(loaded, param.expert_part, hidden_axis=1)
            full = stacked_w13(loaded, param.expert_part, self.checkpoint_layout)
            copy_checked(param, narrow_w13(full, self.tp_rank, i), "")
            return
        expert, part = self._parse_shard(shard_id, ("gate", "up"))
        if expert < 0:
            return  # another rank's expert
        if self.tp_size > 1 and self.expert_map is None:
            loaded = loaded.narrow(0, self.tp_rank * i, i)
        target = param.data[expert].narrow(0, 0 if part == "gate" else i, i)
        check_shape(f"{getattr(param, '_tm_name', '?')}[{expert}, {part}]", target.shape,
                    loaded.shape)  # fmt: skip
        target.copy_(loaded)

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any) -> None:
        loaded = as_float(loaded)
        i = self.intermediate_per_rank
        if shard_id is None:
            loaded = self._as_checkpoint_layout(loaded, param.expert_part, hidden_axis=2)
            full = stacked_w2(loaded, param.expert_part, self.checkpoint_layout)
            copy_checked(param, narrow_w2(full, param.expert_part, self.tp_rank, i), "")
            return
        expert, _ = self._parse_shard(shard_id, ("down",))
        if expert < 0:
            return  # another rank's expert
        if self.tp_size > 1 and self.expert_map is None:
            loaded = loaded.narrow(1, self.tp_rank * i, i)
        target = param.data[expert]
        check_shape(f"{getattr(param, '_tm_name', '?')}[{expert}]", target.shape, loaded.shape)
        target.copy_(loaded)

    def _as_checkpoint_layout(self, loaded: torch.Tensor, part: str, hidden_axis: int
                              ) -> torch.Tensor:  # fmt: skip
        """A whole-layer plain weight in ``nn.Linear``'s orientation (``[E, 2I, H]`` /
        ``[E, H, I]``, as transformers 5 saves Qwen3-VL-MoE and Llama 4 experts) ->
        the layout's ``x @ W`` orientation (the released checkpoints': ``[E, H, 2I]`` /
        ``[E, I, H]``), told apart by where the hidden size ``H`` sits (``hidden_axis``:
        its axis in ``x @ W``); where both sides equal ``H`` the layout's orientation is
        assumed."""
        if part != "weight" or self.checkpoint_layout == "per_expert" or loaded.dim() != 3:
            return loaded
        h = self.hidden_size
        if loaded.shape[3 - hidden_axis] == h and loaded.shape[hidden_axis] != h:
            return loaded.transpose(1, 2)
        return loaded

    def _parse_shard(self, shard_id: Any, parts: tuple[str, ...]) -> tuple[int, str]:
        """``(index of the expert in this rank's weights, or -1 for another rank's, part)``."""
        if not isinstance(shard_id, tuple) or shard_id[1] not in parts:
            raise ValueError(f"expert weights need a shard id (expert, one of {parts}), "
                             f"got {shard_id!r}")
        if not 0 <= shard_id[0] < self.num_experts:
            raise ValueError(f"expert id {shard_id[0]} out of range [0, {self.num_experts})")
        expert = int(shard_id[0])
        if self.expert_map is not None:
            local = expert - self.first_expert
            expert = local if 0 <= local < self.num_local_experts else -1
        return expert, shard_id[1]

    # ---- forward ---------------------------------------------------------------------------

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] float32, expert ids [T, k])`` for ``router_logits [T, E]``."""
        if self.scoring == "sigmoid":
            top, ids = torch.topk(router_logits, self.top_k, dim=-1)
            return torch.sigmoid(top.float()), ids
        return select_experts(router_logits, self.top_k, self.renormalize)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(router_logits)
        return self.forward_routed(hidden, weights, ids)

    def forward_routed(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The experts on a routing chosen elsewhere (e.g. grouped top-k):
        ``topk_weights [T, k]`` float32 and ``topk_ids [T, k]`` -> ``[T, H]``."""
        weights, ids = topk_weights, topk_ids
        tokens, k = ids.shape
        if self.apply_router_weight_on_input:
            # Each (token, expert) pair gets its own input row, scaled by its weight; the
            # experts' outputs are then summed unweighted.
            hidden = (hidden[:, None, :] * weights[..., None].to(hidden.dtype)).reshape(
                tokens * k, -1
            )
            ids = ids.reshape(tokens * k, 1)
            weights = torch.ones_like(weights).reshape(tokens * k, 1)
        w13, w2 = self.w13, self.w2
        if self.quant_method is not None:
            out = self.quant_method.apply(self, hidden, weights, ids)
        else:
            out = fused_experts(
                hidden, w13.data, w2.data, weights, ids, w13_scale=w13.scale,
                w2_scale=w2.scale, w13_bias=w13.bias, w2_bias=w2.bias,
                activation=self.activation, expert_map=self.expert_map,
                large_batch=self.prompt_experts,
            )  # fmt: skip
        if self.apply_router_weight_on_input and k > 1:
            out = out.view(tokens, k, -1).sum(dim=1)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

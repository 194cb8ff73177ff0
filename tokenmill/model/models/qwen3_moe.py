"""Qwen3-MoE (Qwen Team 2025, arXiv:2505.09388): Qwen3's attention with routed experts.

Every ``decoder_sparse_step``-th layer not listed in ``mlp_only_layers`` replaces the dense
MLP by ``num_experts`` SwiGLU experts of size ``moe_intermediate_size``, ``num_experts_per_tok``
of them per token; the top-k router probabilities are renormalised only when
``norm_topk_prob`` is set.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.hf_config import HFConfig
from tokenmill.model.attention.backend import AttentionBackend
from tokenmill.model.layers.fused_moe import FusedMoE
from tokenmill.model.layers.linear import ReplicatedLinear
from tokenmill.model.models.llama import LlamaForCausalLM, LlamaMLP
from tokenmill.model.models.qwen3 import Qwen3ForCausalLM


def num_experts(config: HFConfig) -> int:
    """Experts per sparse layer: hub configs say ``num_experts``, transformers 5 writes
    ``num_local_experts``."""
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Router (``gate``) and routed experts: ``[T, H] -> [T, H]``."""

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, num_experts(config), bias=False)
        self.experts = FusedMoE(
            num_experts=num_experts(config),
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=bool(config.get("norm_topk_prob", False)),
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


def is_sparse_layer(config: HFConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` routes to experts (as transformers' Qwen3-MoE decides)."""
    if layer_idx in (config.get("mlp_only_layers") or []):
        return False
    step = config.get("decoder_sparse_step", 1)
    return num_experts(config) > 0 and (layer_idx + 1) % step == 0


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE causal LM; same interface as ``Qwen3ForCausalLM``.

    Per-expert checkpoint tensors (``mlp.experts.{e}.gate_proj/up_proj/down_proj``) load into
    each layer's stacked ``experts.w13`` / ``experts.w2``.
    """

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__(model_config, backend)
        self.stacked_params_mapping = [
            *FusedMoE.expert_params_mapping(
                num_experts(self.config), "gate_proj", "up_proj", "down_proj"
            ),
            *LlamaForCausalLM.stacked_params_mapping,
        ]

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        if is_sparse_layer(c, layer_idx):
            return Qwen3MoeSparseMoeBlock(c)
        return LlamaMLP(c.hidden_size, c.intermediate_size, c.get("hidden_act", "silu"), False)

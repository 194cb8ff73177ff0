"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B; Qwen Team 2024, arXiv:2407.10671): Qwen2's
attention (biases on q/k/v) with a mixture-of-experts block of routed experts and one shared
expert.

Every ``decoder_sparse_step``-th layer not listed in ``mlp_only_layers`` routes each token
to ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts (softmax router, the top-k
weights renormalised only with ``norm_topk_prob``) and adds a shared SwiGLU expert of
``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))``, a
per-token gate.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.hf_config import HFConfig
from tokenmill.model.attention.backend import AttentionBackend
from tokenmill.model.layers.fused_moe import FusedMoE
from tokenmill.model.layers.linear import ReplicatedLinear
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.models.decoder import DecoderForCausalLM, DecoderModel, PreNormDecoderLayer
from tokenmill.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from tokenmill.model.models.qwen3_moe import is_sparse_layer, num_experts


class Qwen2MoeSparseMoeBlock(nn.Module):
    """Router (``gate``), routed experts and the gated shared expert: ``[T, H] -> [T, H]``."""

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        c = config
        act = c.get("hidden_act", "silu")
        self.gate = ReplicatedLinear(c.hidden_size, num_experts(c), bias=False)
        self.experts = FusedMoE(
            num_experts=num_experts(c),
            top_k=c.num_experts_per_tok,
            hidden_size=c.hidden_size,
            intermediate_size=c.moe_intermediate_size,
            renormalize=bool(c.get("norm_topk_prob", False)),
        )
        shared = c.get("shared_expert_intermediate_size") or 0
        self.shared_expert = LlamaMLP(c.hidden_size, shared, act, bias=False) if shared else None
        self.shared_expert_gate = ReplicatedLinear(c.hidden_size, 1, bias=False) if shared else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate(hidden))
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(hidden))  # type: ignore[misc]
            out = out + gate * self.shared_expert(hidden)
        return out


class Qwen2MoeDecoderLayer(PreNormDecoderLayer):
    """Pre-norm block: Qwen2 attention, then the MoE block or a dense MLP."""

    def __init__(
        self,
        config: HFConfig,
        layer_idx: int,
        max_model_len: int,
        backend: type[AttentionBackend],
    ) -> None:
        super().__init__()
        c = config
        eps = c.get("rms_norm_eps", 1e-6)
        qkv_bias = bool(c.get("qkv_bias", True))
        self.input_layernorm = RMSNorm(c.hidden_size, eps)
        self.self_attn = LlamaAttention(c, layer_idx, max_model_len, backend, qkv_bias, False)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps)
        if is_sparse_layer(c, layer_idx):
            self.mlp: nn.Module = Qwen2MoeSparseMoeBlock(c)
        else:
            self.mlp = LlamaMLP(c.hidden_size, c.intermediate_size, c.get("hidden_act", "silu"),
                                bias=False)  # fmt: skip


class Qwen2MoeModel(DecoderModel):
    """Embedding, decoder layers and the final norm: ids ``[T]`` -> hidden ``[T, H]``."""

    def __init__(
        self, config: HFConfig, max_model_len: int, backend: type[AttentionBackend]
    ) -> None:
        super().__init__()
        self.build_stack(
            config, lambda i: Qwen2MoeDecoderLayer(config, i, max_model_len, backend), 1e-6
        )


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    """Qwen2-MoE causal LM (interface: ``DecoderForCausalLM``); per-expert checkpoint
    tensors (``mlp.experts.{e}.gate_proj/up_proj/down_proj``) load into each sparse layer's
    stacked ``experts.w13`` / ``experts.w2``."""

    gguf_permuted_qk = False

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__(model_config)
        self.stacked_params_mapping = [
            *FusedMoE.expert_params_mapping(
                num_experts(self.config), "gate_proj", "up_proj", "down_proj"
            ),
            *LlamaForCausalLM.stacked_params_mapping,
        ]
        self.attach(Qwen2MoeModel(self.config, model_config.max_model_len, backend))

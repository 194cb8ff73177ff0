"""Mixtral (Jiang et al. 2024, arXiv:2401.04088): Mistral's attention with a sparse MoE block
of ``num_local_experts`` SwiGLU experts in place of the MLP; each token goes to the top
``num_experts_per_tok`` experts, weighted by a softmax over their router logits.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.hf_config import HFConfig
from tokenmill.model.attention.backend import AttentionBackend
from tokenmill.model.layers.embedding import VocabEmbedding
from tokenmill.model.layers.fused_moe import FusedMoE
from tokenmill.model.layers.linear import ReplicatedLinear
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.stage import first_stage, last_stage, stage_layers
from tokenmill.model.models.decoder import (
    DecoderForCausalLM,
    DecoderModel,
    PreNormDecoderLayer,
)
from tokenmill.model.models.llama import LlamaAttention


class MixtralSparseMoeBlock(nn.Module):
    """Router (``gate``) and routed experts: ``[T, H] -> [T, H]``."""

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = FusedMoE(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            renormalize=True,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


class MixtralDecoderLayer(PreNormDecoderLayer):
    """Pre-norm block: attention then the MoE block; residual carried apart."""

    def __init__(
        self,
        config: HFConfig,
        layer_idx: int,
        max_model_len: int,
        backend: type[AttentionBackend],
    ) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-5)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = LlamaAttention(config, layer_idx, max_model_len, backend, False, False)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.block_sparse_moe = MixtralSparseMoeBlock(config)

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(hidden)


class MixtralModel(DecoderModel):
    """Embedding, decoder layers and final norm: ids ``[T]`` -> hidden ``[T, H]``."""

    def __init__(
        self, config: HFConfig, max_model_len: int, backend: type[AttentionBackend]
    ) -> None:
        super().__init__()
        self.embed_tokens = first_stage(
            lambda: VocabEmbedding(config.vocab_size, config.hidden_size)
        )
        self.layers = stage_layers(
            config.num_hidden_layers,
            lambda i: MixtralDecoderLayer(config, i, max_model_len, backend),
        )
        self.norm = last_stage(
            lambda: RMSNorm(config.hidden_size, config.get("rms_norm_eps", 1e-5))
        )


class MixtralForCausalLM(DecoderForCausalLM):
    """Mixtral causal LM.

    ``forward(input_ids [T] int64, positions [T] int64, metadata) -> hidden [T, H]``;
    ``compute_logits(hidden [N, H]) -> [N, vocab]``. Per-expert checkpoint tensors
    (``block_sparse_moe.experts.{e}.w1/w3/w2``: gate, up, down) load into each layer's
    stacked ``experts.w13`` / ``experts.w2``.
    """

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__(model_config)
        config = self.config
        self.attach(MixtralModel(config, model_config.max_model_len, backend))
        self.stacked_params_mapping = [
            *FusedMoE.expert_params_mapping(config.num_local_experts, "w1", "w3", "w2"),
            ("qkv_proj", "q_proj", "q"),
            ("qkv_proj", "k_proj", "k"),
            ("qkv_proj", "v_proj", "v"),
        ]

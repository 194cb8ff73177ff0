"""Qwen3 (Qwen Team 2025, arXiv:2505.09388): Llama's pre-norm layout with an RMSNorm over
each query and key head before RoPE ("QK-norm"), and no q/k/v biases.

``Qwen3Model`` takes the MLP of each layer from a factory so that Qwen3-MoE (qwen3_moe.py)
reuses the attention, the layers and the model loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.hf_config import HFConfig
from tokenmill.model.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.model.layers.embedding import VocabEmbedding
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.stage import first_stage, last_stage, stage_layers
from tokenmill.model.models.decoder import (
    DecoderForCausalLM,
    DecoderModel,
    PreNormDecoderLayer,
)
from tokenmill.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

MLPFactory = Callable[[int], nn.Module]


class Qwen3Attention(LlamaAttention):
    """Llama attention plus per-head ``q_norm`` / ``k_norm``: ``[T, H] -> [T, H]``."""

    def __init__(
        self,
        config: HFConfig,
        layer_idx: int,
        max_model_len: int,
        backend: type[AttentionBackend],
    ) -> None:
        bias = bool(config.get("attention_bias", False))
        super().__init__(config, layer_idx, max_model_len, backend, qkv_bias=bias, o_bias=bias)
        self.head_dim = self.qkv_proj.head_dim
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = hidden.shape[0]
        q = self.q_norm(q.reshape(t, -1, self.head_dim)).view(t, -1)
        k = self.k_norm(k.reshape(t, -1, self.head_dim)).view(t, -1)
        return self.o_proj(self.attn(q, k, v, metadata, positions))


class Qwen3DecoderLayer(PreNormDecoderLayer):
    """Pre-norm block ``x + attn(norm(x))``, then ``+ mlp(norm(.))``; residual carried apart.

    Args:
        mlp: the layer's MLP (dense, or a routed MoE block), ``[T, H] -> [T, H]``.
    """

    def __init__(
        self,
        config: HFConfig,
        layer_idx: int,
        max_model_len: int,
        backend: type[AttentionBackend],
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Qwen3Attention(config, layer_idx, max_model_len, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = mlp


class Qwen3Model(DecoderModel):
    """Embedding, decoder layers and final norm: ids ``[T]`` -> hidden ``[T, H]``.

    Args:
        make_mlp: builds layer ``i``'s MLP.
    """

    def __init__(
        self,
        config: HFConfig,
        max_model_len: int,
        backend: type[AttentionBackend],
        make_mlp: MLPFactory,
    ) -> None:
        super().__init__()
        self.embed_tokens = first_stage(
            lambda: VocabEmbedding(config.vocab_size, config.hidden_size)
        )
        self.layers = stage_layers(
            config.num_hidden_layers,
            lambda i: Qwen3DecoderLayer(config, i, max_model_len, backend, make_mlp(i)),
        )
        self.norm = last_stage(
            lambda: RMSNorm(config.hidden_size, config.get("rms_norm_eps", 1e-6))
        )


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 dense causal LM.

    ``forward(input_ids [T] int64, positions [T] int64, metadata) -> hidden [T, H]``;
    ``compute_logits(hidden [N, H]) -> [N, vocab]``.
    """

    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping
    gguf_permuted_qk = False

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__(model_config)
        self.attach(Qwen3Model(self.config, model_config.max_model_len, backend, self._make_mlp))

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        return LlamaMLP(c.hidden_size, c.intermediate_size, c.get("hidden_act", "silu"), False)

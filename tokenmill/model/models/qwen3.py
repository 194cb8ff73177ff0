"""Qwen3 (Qwen Team 2025, arXiv:2505.09388): Llama's pre-norm layout with an RMSNorm over
each query and key head before RoPE ("QK-norm"), and no q/k/v biases.

``Qwen3Model`` takes the MLP of each layer from a factory so that Qwen3-MoE (qwen3_moe.py)
reuses the attention, the layers and the model loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.model.layers.embedding import LMHead, VocabEmbedding
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.loader.hf_config import HFConfig
from tokenmill.model.loader.weights import load_model_weights
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
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, metadata))


class Qwen3DecoderLayer(nn.Module):
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

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3Model(nn.Module):
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
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, i, max_model_len, backend, make_mlp(i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.get("rms_norm_eps", 1e-6))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 dense causal LM.

    ``forward(input_ids [T] int64, positions [T] int64, metadata) -> hidden [T, H]``;
    ``compute_logits(hidden [N, H]) -> [N, vocab]``.
    """

    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping
    gguf_permuted_qk = False

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__()
        config = model_config.hf_config
        self.config = config
        self.model = Qwen3Model(config, model_config.max_model_len, backend, self._make_mlp)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.get("tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        return LlamaMLP(c.hidden_size, c.intermediate_size, c.get("hidden_act", "silu"), False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
    ) -> None:
        skip = ("lm_head.weight",) if self.config.get("tie_word_embeddings", False) else ()
        load_model_weights(self, weights, self.stacked_params_mapping, skip=skip, source=source)

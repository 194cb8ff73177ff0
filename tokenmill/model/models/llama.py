"""The Llama family: Llama 2/3/3.1/3.2, Mistral, Qwen2 and SmolLM2 (Touvron et al. 2023).

Pre-norm decoder layers: RMSNorm -> attention (merged QKV, RoPE, GQA, paged KV) -> RMSNorm
-> SwiGLU MLP (merged gate/up), with the residual add fused into the norms.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.hf_config import HFConfig
from tokenmill.model.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.model.layers.activation import SiluAndMul, get_act_and_mul
from tokenmill.model.layers.attention import Attention
from tokenmill.model.layers.embedding import VocabEmbedding
from tokenmill.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.rotary import get_rope
from tokenmill.model.layers.stage import first_stage, last_stage, stage_layers
from tokenmill.model.models.cpu_decode_stack import CpuDecodeStack
from tokenmill.model.models.decoder import (
    DecoderForCausalLM,
    DecoderModel,
    PreNormDecoderLayer,
)


def layer_sliding_window(config: HFConfig, layer_idx: int) -> int | None:
    """The sliding window of a layer (tokens), or None for full attention.

    transformers 5 configs list ``layer_types``; older Mistral configs set
    ``sliding_window`` for every layer; Qwen2 only with ``use_sliding_window``.
    """
    window = config.get("sliding_window")
    if not window:
        return None
    layer_types = config.get("layer_types")
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if config.get("model_type") in ("qwen2", "qwen3", "qwen2_moe"):
        use = config.get("use_sliding_window", False)
        return window if use and layer_idx >= config.get("max_window_layers", 0) else None
    return window


class LlamaMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: ``[T, H] -> [T, H]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias
        )
        self.act_fn = get_act_and_mul(hidden_act)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        # SiLU-and-mul in the gate/up product's epilogue where the skinny GEMM runs it.
        self.gated_product = isinstance(self.act_fn, SiluAndMul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated_product:
            gated = self.gate_up_proj.forward_gated(x)
            if gated is not None:
                return self.down_proj(gated)
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Self-attention: ``[T, H] -> [T, H]`` over the layer's paged KV cache."""

    def __init__(
        self,
        config: HFConfig,
        layer_idx: int,
        max_model_len: int,
        backend: type[AttentionBackend],
        qkv_bias: bool,
        o_bias: bool,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = config.get("num_key_value_heads", num_heads)
        head_dim = config.get("head_dim") or hidden // num_heads
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=o_bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.rotary_emb = get_rope(
            head_dim,
            max_position=config.get("max_position_embeddings", max_model_len),
            base=config.rope_theta,
            scaling=config.get("rope_scaling"),
            rotary_dim=int(head_dim * config.get("partial_rotary_factor", 1.0)),
            max_model_len=max_model_len,
        )
        self.attn = Attention(
            self.qkv_proj.num_heads,
            head_dim,
            head_dim**-0.5,
            self.qkv_proj.num_kv_heads,
            layer_idx,
            backend,
            sliding_window=layer_sliding_window(config, layer_idx),
            rotary_emb=self.rotary_emb,
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, metadata, positions))


class LlamaDecoderLayer(PreNormDecoderLayer):
    """One pre-norm transformer block; carries the residual stream separately."""

    def __init__(
        self,
        config: HFConfig,
        layer_idx: int,
        max_model_len: int,
        backend: type[AttentionBackend],
        qkv_bias: bool,
        o_bias: bool,
    ) -> None:
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = LlamaAttention(config, layer_idx, max_model_len, backend, qkv_bias, o_bias)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            config.get("hidden_act", "silu"),
            bias=config.get("mlp_bias", False),
        )


class LlamaModel(DecoderModel):
    """Embedding, decoder layers and the final norm: ids ``[T]`` -> hidden ``[T, H]``."""

    def __init__(
        self,
        config: HFConfig,
        max_model_len: int,
        backend: type[AttentionBackend],
        qkv_bias: bool,
        o_bias: bool,
    ) -> None:
        super().__init__()
        self.embed_tokens = first_stage(
            lambda: VocabEmbedding(config.vocab_size, config.hidden_size)
        )
        self.layers = stage_layers(
            config.num_hidden_layers,
            lambda i: LlamaDecoderLayer(config, i, max_model_len, backend, qkv_bias, o_bias),
        )
        self.norm = last_stage(
            lambda: RMSNorm(config.hidden_size, config.get("rms_norm_eps", 1e-6))
        )

    def build_cpu_decode_stack(self) -> CpuDecodeStack | None:
        return CpuDecodeStack.build(self.layers, LlamaAttention, LlamaMLP)


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama-family causal LM (interface: ``DecoderForCausalLM``)."""

    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    # GGUF files of these llama.cpp architectures permute Q/K rows for GPT-J-style RoPE.
    gguf_permuted_qk = True

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__(model_config)
        qkv_bias, o_bias = self.attention_biases(self.config)
        self.attach(
            LlamaModel(self.config, model_config.max_model_len, backend, qkv_bias, o_bias)
        )

    @staticmethod
    def attention_biases(config: HFConfig) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj) for this config."""
        bias = bool(config.get("attention_bias", False))
        return bias, bias


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layout, with a sliding window on every layer when configured."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: Llama's layout with biases on the q/k/v projections only."""

    gguf_permuted_qk = False

    @staticmethod
    def attention_biases(config: HFConfig) -> tuple[bool, bool]:
        return True, False

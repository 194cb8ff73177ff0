"""Gemma (Gemma Team 2024, arXiv:2403.08295), as transformers' GemmaForCausalLM.

Llama's pre-norm block with Gemma's conventions: embeddings multiplied by
``sqrt(hidden_size)`` (rounded to the activations' dtype), RMSNorm weights stored as
``w - 1`` and applied as ``(1 + w)``, a GeGLU MLP with tanh-approximated GELU, multi-head or
multi-query attention with ``head_dim`` 256, and the LM head tied to the embedding.
"""

from __future__ import annotations

import torch

from tokenmill.config import ModelConfig
from tokenmill.hf_config import HFConfig
from tokenmill.model.attention.backend import AttentionBackend
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.models.decoder import DecoderForCausalLM, DecoderModel, PreNormDecoderLayer
from tokenmill.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


def gemma_activation(config: HFConfig) -> str:
    """The MLP's activation. Gemma checkpoints say ``hidden_act: "gelu"`` but were trained
    with the tanh approximation, which transformers and vLLM both use for them."""
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    return "gelu_pytorch_tanh" if act == "gelu" else act


class GemmaDecoderLayer(PreNormDecoderLayer):
    """RMSNorm -> attention -> RMSNorm -> GeGLU MLP, with ``(1 + w)`` norms."""

    def __init__(
        self,
        config: HFConfig,
        layer_idx: int,
        max_model_len: int,
        backend: type[AttentionBackend],
    ) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.get("rms_norm_eps", 1e-6)
        bias = bool(config.get("attention_bias", False))
        self.input_layernorm = RMSNorm(h, eps, offset=1.0)
        self.self_attn = LlamaAttention(config, layer_idx, max_model_len, backend, bias, bias)
        self.post_attention_layernorm = RMSNorm(h, eps, offset=1.0)
        self.mlp = LlamaMLP(h, config.intermediate_size, gemma_activation(config), bias=False)


class GemmaModel(DecoderModel):
    """Scaled embedding, decoder layers and final norm: ids ``[T]`` -> hidden ``[T, H]``."""

    def __init__(
        self, config: HFConfig, max_model_len: int, backend: type[AttentionBackend]
    ) -> None:
        super().__init__()
        self.build_stack(
            config, lambda i: GemmaDecoderLayer(config, i, max_model_len, backend), 1e-6, offset=1.0
        )
        self.embed_scale = config.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # The scale is rounded to the activations' dtype first, as transformers does.
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma causal LM (interface: ``DecoderForCausalLM``)."""

    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping
    gguf_permuted_qk = False
    tie_word_embeddings_default = True

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__(model_config)
        self.attach(GemmaModel(self.config, model_config.max_model_len, backend))

"""Gemma 2 (Gemma Team 2024, arXiv:2408.00118), as transformers' Gemma2ForCausalLM.

Gemma 3's layout without its QK-norm (``gemma3.py`` holds the shared layer): embeddings
scaled by ``sqrt(hidden_size)``, RMSNorm weights applied as ``(1 + w)``, sandwich norms
around attention and the GeGLU MLP, the softmax scale ``query_pre_attn_scalar^-0.5``.
Layers alternate local (sliding window of ``sliding_window`` tokens; the even layers) and
global attention, all with one RoPE base. Attention scores are soft-capped by
``attn_logit_softcapping`` and final logits by ``final_logit_softcapping``
(``cap * tanh(x / cap)``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.hf_config import HFConfig
from tokenmill.model.attention.backend import AttentionBackend
from tokenmill.model.layers.rotary import RotaryEmbedding
from tokenmill.model.models.decoder import DecoderForCausalLM
from tokenmill.model.models.gemma3 import FULL, SLIDING, Gemma3DecoderLayer, Gemma3Model
from tokenmill.model.models.llama import LlamaForCausalLM


def gemma2_layer_types(config: HFConfig) -> list[str]:
    """``layer_types``, else even layers sliding and odd ones global (transformers' rule)."""
    types = config.get("layer_types")
    if types:
        return list(types)
    return [SLIDING if i % 2 == 0 else FULL for i in range(config.num_hidden_layers)]


def gemma2_rope(config: HFConfig, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)``: the same for every layer type."""
    return config.rope_theta, config.get("rope_scaling")


class Gemma2Model(Gemma3Model):
    """Scaled embedding, decoder layers and final norm: ids ``[T]`` -> hidden ``[T, H]``."""

    layer_types = staticmethod(gemma2_layer_types)
    rope_of = staticmethod(gemma2_rope)

    @staticmethod
    def make_layer(
        config: HFConfig,
        layer_idx: int,
        backend: type[AttentionBackend],
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
    ) -> nn.Module:
        return Gemma3DecoderLayer(
            config, layer_idx, backend, rotary_emb, sliding_window, qk_norm=False,
            logits_soft_cap=config.get("attn_logit_softcapping"),
        )  # fmt: skip


class Gemma2ForCausalLM(DecoderForCausalLM):
    """Gemma 2 causal LM.

    ``forward(input_ids [T] int64, positions [T] int64, metadata) -> hidden [T, H]``;
    ``compute_logits(hidden [N, H]) -> [N, vocab]`` (soft-capped by
    ``final_logit_softcapping`` when set).
    """

    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping
    gguf_permuted_qk = False
    tie_word_embeddings_default = True

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__(model_config)
        self.attach(
            Gemma2Model(self.config, model_config.max_model_len, backend),
            soft_cap=self.config.get("final_logit_softcapping"),
        )

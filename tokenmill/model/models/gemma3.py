"""Gemma 3 text models (Gemma Team 2025, arXiv:2503.19786), as transformers' Gemma3ForCausalLM.

Differences from Llama: token embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to
the activations' dtype); RMSNorm weights are stored as ``w - 1`` and applied as ``(1 + w)``;
each block normalises both the input and the output of attention and of the MLP (four norms);
queries and keys get a per-head RMSNorm; the softmax scale is ``query_pre_attn_scalar^-0.5``;
the MLP is GeGLU with tanh-approximated GELU. Layers alternate between sliding-window
("local", ``sliding_window`` tokens, RoPE base ``rope_local_base_freq``) and full ("global")
attention, five local to one global by default. Final logits are soft-capped
(``cap * tanh(x / cap)``) when ``final_logit_softcapping`` is set.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.hf_config import HFConfig
from tokenmill.model.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.model.layers.attention import Attention
from tokenmill.model.layers.embedding import VocabEmbedding
from tokenmill.model.layers.linear import QKVParallelLinear, RowParallelLinear
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.rotary import RotaryEmbedding, get_rope
from tokenmill.model.layers.stage import first_stage, last_stage, stage_layers
from tokenmill.model.models.decoder import DecoderForCausalLM, DecoderModel, open_residual
from tokenmill.model.models.llama import LlamaForCausalLM, LlamaMLP

SLIDING = "sliding_attention"
FULL = "full_attention"
# transformers' defaults for configs that predate ``layer_types`` / per-layer rope parameters
DEFAULT_SLIDING_WINDOW_PATTERN = 6
DEFAULT_LOCAL_ROPE_THETA = 10_000.0


def gemma3_layer_types(config: HFConfig) -> list[str]:
    """Each layer's attention type: ``layer_types``, else every ``sliding_window_pattern``-th
    layer global and the rest sliding (transformers' rule for older configs)."""
    types = config.get("layer_types")
    if types:
        return list(types)
    pattern = config.get("sliding_window_pattern", DEFAULT_SLIDING_WINDOW_PATTERN)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]


def gemma3_rope(config: HFConfig, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of a layer type.

    transformers 5 configs give ``rope_parameters[layer_type]``; older ones ``rope_theta`` and
    ``rope_scaling`` for global layers and ``rope_local_base_freq`` (unscaled) for local ones.
    """
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        p = dict(params[layer_type])
        theta = float(p.pop("rope_theta", config.rope_theta))
        rope_type = p.pop("type", None) or p.get("rope_type", "default")
        return theta, (None if rope_type == "default" else {**p, "rope_type": rope_type})
    if layer_type == SLIDING:
        return float(config.get("rope_local_base_freq", DEFAULT_LOCAL_ROPE_THETA)), None
    return config.rope_theta, config.get("rope_scaling")


class Gemma3Attention(nn.Module):
    """QK-normed attention of one layer: ``[T, H] -> [T, H]``.

    Args:
        rotary_emb: the RoPE of this layer's type (shared by the layers of that type).
        sliding_window: tokens a query sees (itself included), or None for global layers.
        qk_norm: normalise queries and keys per head (Gemma 3); Gemma 2 does not.
        logits_soft_cap: attention-score soft cap (Gemma 2), else None.
    """

    def __init__(
        self,
        config: HFConfig,
        layer_idx: int,
        backend: type[AttentionBackend],
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        qk_norm: bool = True,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = config.get("num_key_value_heads", num_heads)
        self.head_dim = config.get("head_dim") or hidden // num_heads
        bias = bool(config.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, num_heads, num_kv_heads, bias)
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, bias=bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        eps = config.get("rms_norm_eps", 1e-6)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps, offset=1.0)
            self.k_norm = RMSNorm(self.head_dim, eps, offset=1.0)
        self.attn = Attention(
            self.qkv_proj.num_heads,
            self.head_dim,
            config.get("query_pre_attn_scalar", self.head_dim) ** -0.5,
            self.qkv_proj.num_kv_heads,
            layer_idx,
            backend,
            sliding_window=sliding_window,
            rotary_emb=rotary_emb,
            # NOTE: Gemma 3 passes no soft cap: it replaced it by QK-norm, and transformers
            # and llama.cpp ignore ``attn_logit_softcapping`` for Gemma 3 even when set.
            logits_soft_cap=logits_soft_cap,
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            t = hidden.shape[0]
            q = self.q_norm(q.reshape(t, -1, self.head_dim)).view(t, -1)
            k = self.k_norm(k.reshape(t, -1, self.head_dim)).view(t, -1)
        return self.o_proj(self.attn(q, k, v, metadata, positions))


class Gemma3DecoderLayer(nn.Module):
    """``x + post_attn_norm(attn(input_norm(x)))``, then ``+ post_ff_norm(mlp(pre_ff_norm(.)))``
    (the sandwich norms of Gemma 2 and 3).

    The residual stream is carried apart (``hidden + residual``) so the adds fuse into the
    input and pre-feed-forward norms. ``qk_norm`` and ``logits_soft_cap`` go to the
    attention (``Gemma3Attention``).
    """

    def __init__(
        self,
        config: HFConfig,
        layer_idx: int,
        backend: type[AttentionBackend],
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        qk_norm: bool = True,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(h, eps, offset=1.0)
        self.self_attn = Gemma3Attention(
            config, layer_idx, backend, rotary_emb, sliding_window, qk_norm, logits_soft_cap
        )
        self.post_attention_layernorm = RMSNorm(h, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, offset=1.0)
        act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        self.mlp = LlamaMLP(h, config.intermediate_size, act, bias=False)
        self.post_feedforward_layernorm = RMSNorm(h, eps, offset=1.0)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = open_residual(self.input_layernorm, hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(DecoderModel):
    """Scaled embedding, decoder layers and final norm: ids ``[T]`` -> hidden ``[T, H]``.

    Gemma 2 differs only in its class hooks: ``layer_types``, ``rope_of`` and ``make_layer``.
    """

    def __init__(
        self, config: HFConfig, max_model_len: int, backend: type[AttentionBackend]
    ) -> None:
        super().__init__()
        self.embed_tokens = first_stage(
            lambda: VocabEmbedding(config.vocab_size, config.hidden_size)
        )
        self.embed_scale = config.hidden_size**0.5
        layer_types = self.layer_types(config)
        # NOTE: one RoPE table per layer type, shared by its layers (a table is
        # max_position x head_dim floats: 32 MiB for Gemma 3 270M).
        ropes = {t: self._rope(config, t, max_model_len) for t in sorted(set(layer_types))}
        window = config.get("sliding_window")
        self.layers = stage_layers(
            len(layer_types),
            lambda i: self.make_layer(
                config, i, backend, ropes[layer_types[i]],
                window if layer_types[i] == SLIDING else None,
            ),
        )  # fmt: skip
        self.norm = last_stage(
            lambda: RMSNorm(config.hidden_size, config.get("rms_norm_eps", 1e-6), offset=1.0)
        )

    layer_types = staticmethod(gemma3_layer_types)
    rope_of = staticmethod(gemma3_rope)
    make_layer = Gemma3DecoderLayer

    @classmethod
    def _rope(cls, config: HFConfig, layer_type: str, max_model_len: int) -> RotaryEmbedding:
        theta, scaling = cls.rope_of(config, layer_type)
        head_dim = config.get("head_dim") or config.hidden_size // config.num_attention_heads
        return get_rope(
            head_dim,
            max_position=config.get("max_position_embeddings", max_model_len),
            base=theta,
            scaling=scaling,
            max_model_len=max_model_len,
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # The scale is rounded to the activations' dtype first, as transformers does.
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3 causal LM (text-only checkpoints, ``model_type`` gemma3_text).

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
            Gemma3Model(self.config, model_config.max_model_len, backend),
            soft_cap=self.config.get("final_logit_softcapping"),
        )

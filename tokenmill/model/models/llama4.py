"""Llama 4 text models (Meta 2025, "The Llama 4 herd"), as transformers' Llama4ForCausalLM;
also the language model of Llama4ForConditionalGeneration checkpoints (their vision tower
is not loaded).

Llama's pre-norm block with these differences:

- RoPE layers rotate adjacent pairs (GPT-J style) and, with ``use_qk_norm``, normalise
  queries and keys per head by a weightless RMSNorm; with ``attention_chunk_size`` they
  attend only within their chunk of that many tokens (chunked local attention).
- Every ``no_rope_layer_interval``-th layer (``no_rope_layers[i] == 0``) is a NoPE layer:
  no rotary embedding, full attention, and with ``attn_temperature_tuning`` its queries
  scaled by ``1 + attn_scale * log(1 + floor((pos + 1) / floor_scale))`` (Nakanishi 2025,
  "Scalable-Softmax Is Superior for Attention", arXiv:2501.19399).
- The layers in ``moe_layers`` (every ``interleave_moe_layer_step``-th by default) replace
  the MLP by ``num_local_experts`` routed experts plus one shared expert: each token goes to
  its top ``num_experts_per_tok`` experts (one, in the released models), its input scaled
  by the sigmoid of the router logit, and the shared expert's output is added. Dense layers
  use an MLP of ``intermediate_size_mlp``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.hf_config import HFConfig
from tokenmill.model.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.model.layers.attention import Attention
from tokenmill.model.layers.fused_moe import FusedMoE
from tokenmill.model.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.rotary import get_rope
from tokenmill.model.models.decoder import DecoderForCausalLM, DecoderModel, open_residual
from tokenmill.model.models.llama import LlamaForCausalLM, LlamaMLP

# transformers' defaults for configs that leave them out
DEFAULT_NO_ROPE_LAYER_INTERVAL = 4
DEFAULT_FLOOR_SCALE = 8192
DEFAULT_ATTN_SCALE = 0.1


def uses_rope(config: HFConfig, layer_idx: int) -> bool:
    """Whether a layer rotates (``no_rope_layers[i]`` truthy), else it is a NoPE layer;
    without the list, every ``no_rope_layer_interval``-th layer is NoPE."""
    flags = config.get("no_rope_layers")
    if flags:
        return bool(flags[layer_idx])
    interval = config.get("no_rope_layer_interval", DEFAULT_NO_ROPE_LAYER_INTERVAL)
    return (layer_idx + 1) % interval != 0


def moe_layers(config: HFConfig) -> list[int]:
    """The layers with experts: ``moe_layers``, else every ``interleave_moe_layer_step``-th."""
    layers = config.get("moe_layers")
    if layers is not None:
        return list(layers)
    step = config.get("interleave_moe_layer_step", 1)
    return list(range(step - 1, config.num_hidden_layers, step))


def weightless_rms_norm(x: torch.Tensor, head_dim: int, eps: float) -> torch.Tensor:
    """RMSNorm without a weight over each head of ``x [T, heads * head_dim]``, in float32."""
    heads = x.view(x.shape[0], -1, head_dim).float()
    heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + eps)
    return heads.to(x.dtype).view(x.shape)


class Llama4Attention(nn.Module):
    """Attention of a RoPE (chunked) or NoPE (global) layer: ``[T, H] -> [T, H]``."""

    def __init__(
        self,
        config: HFConfig,
        layer_idx: int,
        max_model_len: int,
        backend: type[AttentionBackend],
    ) -> None:
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = config.get("head_dim") or hidden // num_heads
        bias = bool(config.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, num_heads, config.num_key_value_heads, bias
        )
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, bias=bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.eps = config.get("rms_norm_eps", 1e-5)
        self.use_rope = uses_rope(config, layer_idx)
        self.qk_norm = self.use_rope and bool(config.get("use_qk_norm", True))
        self.temperature_tuning = not self.use_rope and bool(
            config.get("attn_temperature_tuning", True)
        )
        self.floor_scale = float(config.get("floor_scale", DEFAULT_FLOOR_SCALE))
        self.attn_scale = float(config.get("attn_scale", DEFAULT_ATTN_SCALE))
        rope = None
        if self.use_rope:
            # NOTE: a table of max_model_len rows, not max_position_embeddings (10M for
            # Scout: 5 GiB of float32): Llama 4's RoPE (default or llama3 scaling) does not
            # depend on the model's maximum position.
            rope = get_rope(
                self.head_dim,
                max_position=max_model_len,
                base=config.rope_theta,
                scaling=config.get("rope_scaling"),
                is_neox_style=False,
                max_model_len=max_model_len,
            )
        chunk = config.get("attention_chunk_size") if self.use_rope else None
        self.attn = Attention(
            self.qkv_proj.num_heads, self.head_dim, self.head_dim**-0.5,
            self.qkv_proj.num_kv_heads, layer_idx, backend, rotary_emb=rope,
            attention_chunk_size=chunk,
        )  # fmt: skip

    def _temperature(self, positions: torch.Tensor) -> torch.Tensor:
        """The NoPE layers' query scale at each position, ``[T, 1]`` float32."""
        steps = torch.floor((positions.float() + 1.0) / self.floor_scale)
        return (torch.log1p(steps) * self.attn_scale + 1.0)[:, None]

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            # NOTE: normalised before the rotation that ``Attention`` applies, where
            # transformers normalises after it: a rotation keeps each head's norm, so the
            # two orders give the same vectors, and the rotation stays fused with the
            # KV-cache write (and on decode steps, with attention).
            q = weightless_rms_norm(q, self.head_dim, self.eps)
            k = weightless_rms_norm(k, self.head_dim, self.eps)
        if self.temperature_tuning:
            q = (q.float() * self._temperature(positions)).to(q.dtype)
        return self.o_proj(self.attn(q, k, v, metadata, positions))


def from_gguf(config: HFConfig) -> bool:
    """Whether the config was read from a GGUF file, whose experts load one tensor per expert
    and projection (llama.cpp stacks them as rows, ``[E, I, H]`` and ``[E, H, I]``, which the
    GGUF loader yields per expert, quantized blocks included)."""
    return bool(config.get("_gguf_architecture"))


class Llama4MoE(nn.Module):
    """Routed experts (sigmoid scores scaling their inputs) plus a shared expert."""

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        h, experts = config.hidden_size, config.num_local_experts
        act = config.get("hidden_act", "silu")
        self.router = ReplicatedLinear(h, experts, bias=False)
        self.experts = FusedMoE(
            experts, config.num_experts_per_tok, h, config.intermediate_size,
            renormalize=False, scoring="sigmoid", apply_router_weight_on_input=True,
            checkpoint_layout="per_expert" if from_gguf(config) else "gate_up_halves",
        )  # fmt: skip
        self.shared_expert = LlamaMLP(h, config.intermediate_size, act, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_expert(hidden) + self.experts(hidden, self.router(hidden))


class Llama4DecoderLayer(nn.Module):
    """RMSNorm -> attention -> RMSNorm -> MoE or MLP (``feed_forward``, the checkpoints'
    name); residual carried apart."""

    def __init__(
        self,
        config: HFConfig,
        layer_idx: int,
        max_model_len: int,
        backend: type[AttentionBackend],
    ) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.get("rms_norm_eps", 1e-5)
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Llama4Attention(config, layer_idx, max_model_len, backend)
        self.post_attention_layernorm = RMSNorm(h, eps)
        if layer_idx in moe_layers(config):
            self.feed_forward = Llama4MoE(config)
        else:
            mlp_size = config.get("intermediate_size_mlp") or config.intermediate_size
            self.feed_forward = LlamaMLP(h, mlp_size, config.get("hidden_act", "silu"), False)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = open_residual(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class Llama4Model(DecoderModel):
    """Embedding, decoder layers and the final norm: ids ``[T]`` -> hidden ``[T, H]``."""

    def __init__(
        self, config: HFConfig, max_model_len: int, backend: type[AttentionBackend]
    ) -> None:
        super().__init__()
        self.build_stack(
            config, lambda i: Llama4DecoderLayer(config, i, max_model_len, backend), 1e-5
        )


class Llama4ForCausalLM(DecoderForCausalLM):
    """Llama 4 text causal LM (interface: ``DecoderForCausalLM``).

    The experts' whole-layer checkpoint tensors (``feed_forward.experts.gate_up_proj
    [E, H, 2I]``, ``down_proj [E, I, H]``) load into each MoE layer's ``FusedMoE``; from a
    GGUF file, one tensor per expert and projection (``experts.{e}.gate_proj.weight``, ...).
    """

    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__(model_config)
        self.attach(Llama4Model(self.config, model_config.max_model_len, backend))
        if from_gguf(self.config) and self.config.get("num_local_experts"):
            self.stacked_params_mapping = [
                *FusedMoE.expert_params_mapping(
                    self.config.num_local_experts, "gate_proj", "up_proj", "down_proj"
                ),
                *LlamaForCausalLM.stacked_params_mapping,
            ]

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
    ) -> None:
        super().load_weights(map(_expert_name, weights), source=source)


def _expert_name(item: tuple[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
    """``...experts.gate_up_proj`` -> ``...experts.w13.weight`` (``down_proj``: ``w2``)."""
    name, tensor = item
    for checkpoint, ours in (("experts.gate_up_proj", "experts.w13.weight"),
                             ("experts.down_proj", "experts.w2.weight")):  # fmt: skip
        if name.endswith(checkpoint):
            return name[: -len(checkpoint)] + ours, tensor
    return name, tensor


# Prefixes of a Llama4ForConditionalGeneration checkpoint: the language model's, and the
# vision tower's and projector's (not loaded).
LANGUAGE_MODEL_PREFIX = "language_model."
VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """The language model of a Llama 4 checkpoint with a vision tower (text prompts only):
    its ``language_model.*`` tensors, the vision tower's skipped."""

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
    ) -> None:
        text = (
            (name.removeprefix(LANGUAGE_MODEL_PREFIX), tensor)
            for name, tensor in weights
            if not name.startswith(VISION_PREFIXES)
        )
        super().load_weights(text, source=source)

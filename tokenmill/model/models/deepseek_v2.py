"""DeepSeek-V2 (arXiv:2405.04434) and DeepSeek-V3 (arXiv:2412.19437; also Kimi K2's
architecture): multi-head latent attention and mixture-of-experts layers with shared experts.

- Attention (``DeepseekV2Attention``): queries from ``q_proj``, or through a low-rank
  ``q_a_proj -> q_a_layernorm -> q_b_proj`` when ``q_lora_rank`` is set; keys and values from
  one latent ``kv_a_proj_with_mqa -> [c | k_pe]``, ``c`` normalised by ``kv_a_layernorm``,
  expanded per head by ``kv_b_proj``. Only ``[c | k_pe]`` is cached (``MLAAttention``). RoPE
  on the ``qk_rope_head_dim`` dimensions, interleaved pairs (DeepSeek's layout) unless a V3
  config sets ``rope_interleave`` false; YaRN's ``mscale_all_dim`` also scales the softmax.
- Feed-forward: the first ``first_k_dense_replace`` layers (and those off
  ``moe_layer_freq``) are dense SwiGLU MLPs; the others route each token to
  ``num_experts_per_tok`` of ``n_routed_experts`` experts by grouped top-k
  (``kernels/moe/routing.py``: V2 softmax, V3 sigmoid with ``e_score_correction_bias``),
  weights times ``routed_scaling_factor``, plus ``n_shared_experts`` shared experts every
  token goes through.

Checkpoint layers past ``num_hidden_layers`` are the multi-token-prediction modules
(``deepseek_mtp.py``); the causal LM skips them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.distributed.parallel_state import get_tensor_model_parallel_world_size
from tokenmill.hf_config import HFConfig
from tokenmill.kernels.moe.routing import grouped_topk
from tokenmill.model.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.model.attention.mla import MLADims
from tokenmill.model.layers.fused_moe import FusedMoE
from tokenmill.model.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from tokenmill.model.layers.mla import MLAAttention
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.rotary import get_rope
from tokenmill.model.models.decoder import DecoderForCausalLM, DecoderModel, PreNormDecoderLayer
from tokenmill.model.models.llama import LlamaForCausalLM, LlamaMLP

# Epsilon of ``q_a_layernorm`` and ``kv_a_layernorm``.
LOW_RANK_NORM_EPS = 1e-6


def mla_softmax_scale(config: HFConfig) -> float:
    """``qk_head_dim^-0.5``, times ``mscale^2`` where YaRN sets ``mscale_all_dim``
    (DeepSeek scales the whole product ``q . k``, not only the rotary dimensions)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
        factor = scaling["factor"]
        mscale = 0.1 * scaling["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class DeepseekV2Attention(nn.Module):
    """MLA projections around the ``MLAAttention`` layer: ``[T, H] -> [T, H]``.

    With ``q_lora_rank`` the query's and the latent's down-projections are one product
    (``fused_qkv_a_proj``, loaded from ``q_a_proj`` and ``kv_a_proj_with_mqa``).

    Raises:
        ValueError: tensor parallelism (MLA runs on one device here).
    """

    def __init__(
        self,
        config: HFConfig,
        layer_idx: int,
        max_model_len: int,
        backend: type[AttentionBackend],
        is_neox_style: bool,
    ) -> None:
        super().__init__()
        if get_tensor_model_parallel_world_size() > 1:
            raise ValueError("multi-head latent attention runs without tensor parallelism")
        c = config
        self.dims = d = MLADims(
            c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
            c.kv_lora_rank,
        )  # fmt: skip
        bias = bool(c.get("attention_bias", False))
        # NOTE: DeepSeek's code (and transformers') builds the two low-rank norms with their
        # default epsilon, whatever rms_norm_eps says (the released configs say the same).
        eps = LOW_RANK_NORM_EPS
        self.q_lora_rank = c.get("q_lora_rank")
        q_size = d.num_heads * d.qk_head_dim
        if self.q_lora_rank:
            sizes = [self.q_lora_rank, d.latent_dim]
            self.fused_qkv_a_proj = MergedColumnParallelLinear(c.hidden_size, sizes, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, q_size)
        else:
            self.q_proj = ColumnParallelLinear(c.hidden_size, q_size)
            self.kv_a_proj_with_mqa = ReplicatedLinear(c.hidden_size, d.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, eps)
        self.kv_b_proj = ColumnParallelLinear(
            d.kv_lora_rank, d.num_heads * (d.qk_nope_head_dim + d.v_head_dim)
        )
        self.o_proj = RowParallelLinear(d.num_heads * d.v_head_dim, c.hidden_size, bias=bias)
        rope = get_rope(
            d.qk_rope_head_dim,
            max_position=c.get("max_position_embeddings", max_model_len),
            base=c.rope_theta,
            scaling=c.get("rope_scaling"),
            is_neox_style=is_neox_style,
            max_model_len=max_model_len,
        )
        self.attn = MLAAttention(
            d, mla_softmax_scale(c), layer_idx, backend, self.kv_b_proj, rope
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        d = self.dims
        if self.q_lora_rank:
            q_a, latent = self.fused_qkv_a_proj(hidden).split(
                [self.q_lora_rank, d.latent_dim], dim=-1
            )
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            q = self.q_proj(hidden)
            latent = self.kv_a_proj_with_mqa(hidden)
        kv_c, k_pe = latent.split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        out = self.attn(q, self.kv_a_layernorm(kv_c), k_pe, metadata, positions)
        return self.o_proj(out)


class DeepseekRouter(ReplicatedLinear):
    """The router: logits ``[T, E]`` from ``weight [E, H]``; DeepSeek-V3 adds the float32
    ``e_score_correction_bias [E]`` used to choose experts."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__(hidden_size, num_experts, bias=False)
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )
        else:
            self.register_parameter("e_score_correction_bias", None)


class DeepseekV2MoE(nn.Module):
    """Routed experts (grouped top-k) plus shared experts: ``[T, H] -> [T, H]``."""

    def __init__(self, config: HFConfig, is_v3: bool) -> None:
        super().__init__()
        c = config
        method = c.get("topk_method", "noaux_tc" if is_v3 else "greedy")
        self.scoring = c.get("scoring_func", "sigmoid" if is_v3 else "softmax")
        self.top_k = c.num_experts_per_tok
        grouped = is_v3 or method in ("group_limited_greedy", "noaux_tc")
        self.num_groups = int(c.get("n_group") or 1) if grouped else 1
        self.topk_groups = int(c.get("topk_group") or 1) if grouped else 1
        self.renormalize = bool(c.get("norm_topk_prob", False))
        self.routed_scaling_factor = float(c.get("routed_scaling_factor", 1.0))
        self.gate = DeepseekRouter(c.hidden_size, c.n_routed_experts, is_v3 or method == "noaux_tc")
        self.experts = FusedMoE(
            num_experts=c.n_routed_experts,
            top_k=self.top_k,
            hidden_size=c.hidden_size,
            intermediate_size=c.moe_intermediate_size,
            renormalize=self.renormalize,
        )
        shared = c.get("n_shared_experts") or 0
        self.shared_experts = (
            LlamaMLP(c.hidden_size, c.moe_intermediate_size * shared, c.get("hidden_act", "silu"),
                     bias=False)
            if shared
            else None
        )  # fmt: skip

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = grouped_topk(
            self.gate(hidden), self.top_k, self.num_groups, self.topk_groups, self.scoring,
            self.renormalize, self.gate.e_score_correction_bias, self.routed_scaling_factor,
        )  # fmt: skip
        out = self.experts.forward_routed(hidden, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out


def is_moe_layer(config: HFConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` routes to experts (DeepSeek's rule: past the first
    ``first_k_dense_replace`` layers, every ``moe_layer_freq``-th)."""
    if not config.get("n_routed_experts"):
        return False
    first_dense = config.get("first_k_dense_replace", 0)
    return layer_idx >= first_dense and layer_idx % config.get("moe_layer_freq", 1) == 0


class DeepseekV2DecoderLayer(PreNormDecoderLayer):
    """Pre-norm block: MLA, then a dense MLP or the MoE block; residual carried apart."""

    def __init__(
        self,
        config: HFConfig,
        layer_idx: int,
        max_model_len: int,
        backend: type[AttentionBackend],
        is_v3: bool,
        attn_layer_idx: int | None = None,
    ) -> None:
        super().__init__()
        c = config
        eps = c.get("rms_norm_eps", 1e-6)
        # V2 and V3 by default rotate interleaved pairs; V3 configs may ask for halves.
        neox = is_v3 and not c.get("rope_interleave", True)
        self.input_layernorm = RMSNorm(c.hidden_size, eps)
        cache_idx = layer_idx if attn_layer_idx is None else attn_layer_idx
        self.self_attn = DeepseekV2Attention(c, cache_idx, max_model_len, backend, neox)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps)
        if is_moe_layer(c, layer_idx):
            self.mlp: nn.Module = DeepseekV2MoE(c, is_v3)
        else:
            self.mlp = LlamaMLP(c.hidden_size, c.intermediate_size, c.get("hidden_act", "silu"),
                                bias=False)  # fmt: skip


class DeepseekV2Model(DecoderModel):
    """Embedding, decoder layers and the final norm: ids ``[T]`` -> hidden ``[T, H]``."""

    def __init__(
        self, config: HFConfig, max_model_len: int, backend: type[AttentionBackend], is_v3: bool
    ) -> None:
        super().__init__()
        self.build_stack(
            config, lambda i: DeepseekV2DecoderLayer(config, i, max_model_len, backend, is_v3), 1e-6
        )


def deepseek_params_mapping(config: HFConfig) -> list[tuple[str, str, Any]]:
    """``stacked_params_mapping`` of a DeepSeek decoder: per-expert tensors into the stacked
    experts, gate/up into ``gate_up_proj``, the query's and the latent's down-projections
    into ``fused_qkv_a_proj`` (with ``q_lora_rank``)."""
    mapping: list[tuple[str, str, Any]] = []
    if config.get("n_routed_experts"):
        mapping += FusedMoE.expert_params_mapping(
            config.n_routed_experts, "gate_proj", "up_proj", "down_proj"
        )
    mapping += [m for m in LlamaForCausalLM.stacked_params_mapping if m[0] == "gate_up_proj"]
    if config.get("q_lora_rank"):
        mapping += [
            ("fused_qkv_a_proj", "q_a_proj", 0),
            ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1),
        ]
    return mapping


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    """DeepSeek-V2 causal LM (interface: ``DecoderForCausalLM``)."""

    is_v3 = False

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__(model_config)
        self.stacked_params_mapping = deepseek_params_mapping(self.config)
        self.attach(
            DeepseekV2Model(self.config, model_config.max_model_len, backend, self.is_v3)
        )

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
    ) -> None:
        """Load the decoder's tensors; the multi-token-prediction layers' (``model.layers.N``
        with ``N >= num_hidden_layers``) are skipped."""
        num_layers = self.config.num_hidden_layers
        pattern = re.compile(r"model\.layers\.(\d+)\.")

        def decoder_only() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = pattern.match(name)
                if m is None or int(m.group(1)) < num_layers:
                    yield name, tensor

        super().load_weights(decoder_only(), source)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 (and Kimi K2) causal LM: sigmoid scoring with the correction bias."""

    is_v3 = True

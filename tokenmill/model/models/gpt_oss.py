"""gpt-oss (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card", arXiv:2508.10925), as
transformers' GptOssForCausalLM.

Pre-norm blocks of grouped-query attention and a sparse MoE. Attention has biases on its
projections, YaRN-scaled RoPE (NeoX halves) and a learned sink logit per head that joins
each row's softmax denominator (``AttentionImpl``: ``sinks``); layers alternate between a
sliding window of ``sliding_window`` (128) tokens, on the even layers, and full attention.
The MoE routes each token to the top ``num_experts_per_tok`` of ``num_local_experts``
experts by a softmax over their router logits (the router has a bias); the experts have
biases and combine gate and up by the clamped SwiGLU ``(up + 1) * g * sigmoid(alpha * g)``
(``GatedActivation("swigluoai")``). Released checkpoints store the experts in MXFP4
(``quantization_config.quant_method: "mxfp4"``), which the MoE kernels decode as they
multiply; bf16 checkpoints of the same layout load too.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from tokenmill.hf_config import HFConfig, ModelLoadError
from tokenmill.kernels.moe.tiles import GatedActivation
from tokenmill.model.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.model.layers.attention import Attention
from tokenmill.model.layers.fused_moe import FusedMoE
from tokenmill.model.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.rotary import get_rope
from tokenmill.model.models.decoder import DecoderForCausalLM, DecoderModel, PreNormDecoderLayer

SLIDING = "sliding_attention"
# transformers' defaults for configs that leave them out
DEFAULT_SWIGLU_ALPHA = 1.702
DEFAULT_SWIGLU_LIMIT = 7.0
# checkpoint name -> our parameter name, for the experts' whole-layer tensors
EXPERT_TENSORS = {
    f"experts.{proj}{suffix}": f"experts.{ours}.{part}"
    for proj, ours in (("gate_up_proj", "w13"), ("down_proj", "w2"))
    for suffix, part in (("", "weight"), ("_blocks", "blocks"), ("_scales", "scales"),
                         ("_bias", "bias"))
}  # fmt: skip


def gpt_oss_layer_types(config: HFConfig) -> list[str]:
    """``layer_types``, else even layers sliding and odd ones full (transformers' rule)."""
    types = config.get("layer_types")
    if types:
        return list(types)
    return [SLIDING if i % 2 == 0 else "full_attention" for i in range(config.num_hidden_layers)]


def experts_are_mxfp4(config: HFConfig) -> bool:
    """Whether the checkpoint's experts are MXFP4 (its ``quantization_config``).

    Raises:
        ModelLoadError: a quantization method other than MXFP4.
    """
    quant = config.get("quantization_config")
    if not quant:
        return False
    method = str(quant.get("quant_method", "")).lower()
    if method != "mxfp4":
        raise ModelLoadError(
            f"gpt-oss checkpoints quantized with {method!r} are not supported (MXFP4 or "
            "unquantized experts are)"
        )
    return True


class GptOssAttention(nn.Module):
    """Attention with sinks, over a sliding window on local layers: ``[T, H] -> [T, H]``."""

    def __init__(
        self,
        config: HFConfig,
        layer_idx: int,
        max_model_len: int,
        backend: type[AttentionBackend],
    ) -> None:
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        head_dim = config.get("head_dim") or hidden // num_heads
        bias = bool(config.get("attention_bias", True))
        self.qkv_proj = QKVParallelLinear(
            hidden, head_dim, num_heads, config.num_key_value_heads, bias
        )
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        heads_here = self.qkv_proj.num_heads
        self.sinks = nn.Parameter(torch.empty(heads_here), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks
        rope = get_rope(
            head_dim,
            max_position=config.get("max_position_embeddings", max_model_len),
            base=config.rope_theta,
            scaling=config.get("rope_scaling"),
            max_model_len=max_model_len,
        )
        layer_type = gpt_oss_layer_types(config)[layer_idx]
        self.attn = Attention(
            heads_here, head_dim, head_dim**-0.5, self.qkv_proj.num_kv_heads, layer_idx,
            backend, sliding_window=config.sliding_window if layer_type == SLIDING else None,
            rotary_emb=rope, sinks=self.sinks,
        )  # fmt: skip

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """This rank's heads' sinks (heads are split across tensor-parallel ranks)."""
        n = param.shape[0]
        if get_tensor_model_parallel_world_size() > 1:
            loaded = loaded.narrow(0, get_tensor_model_parallel_rank() * n, n)
        if loaded.shape != param.shape:
            raise ModelLoadError(f"sinks have shape {tuple(loaded.shape)}, expected ({n},)")
        param.data.copy_(loaded)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, metadata, positions))


class GptOssMLP(nn.Module):
    """Router (with bias) and routed experts: ``[T, H] -> [T, H]``."""

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        num_experts = config.num_local_experts
        self.router = ReplicatedLinear(config.hidden_size, num_experts, bias=True)
        self.experts = FusedMoE(
            num_experts, config.num_experts_per_tok, config.hidden_size,
            config.intermediate_size, renormalize=True, bias=True,
            activation=GatedActivation(
                "swigluoai", float(config.get("swiglu_alpha", DEFAULT_SWIGLU_ALPHA)),
                float(config.get("swiglu_limit", DEFAULT_SWIGLU_LIMIT)),
            ),
            mxfp4=experts_are_mxfp4(config), checkpoint_layout="gate_up_interleaved",
        )  # fmt: skip

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.router(hidden))


class GptOssDecoderLayer(PreNormDecoderLayer):
    """RMSNorm -> attention with sinks -> RMSNorm -> MoE; residual carried apart."""

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
        self.self_attn = GptOssAttention(config, layer_idx, max_model_len, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = GptOssMLP(config)


class GptOssModel(DecoderModel):
    """Embedding, decoder layers and the final norm: ids ``[T]`` -> hidden ``[T, H]``."""

    def __init__(
        self, config: HFConfig, max_model_len: int, backend: type[AttentionBackend]
    ) -> None:
        super().__init__()
        self.build_stack(
            config, lambda i: GptOssDecoderLayer(config, i, max_model_len, backend), 1e-5
        )


class GptOssForCausalLM(DecoderForCausalLM):
    """gpt-oss causal LM (interface: ``DecoderForCausalLM``).

    The experts' whole-layer checkpoint tensors (``mlp.experts.gate_up_proj_blocks`` ...,
    ``EXPERT_TENSORS``) load into each layer's ``FusedMoE``.
    """

    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
    ]

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__(model_config)
        self.attach(GptOssModel(self.config, model_config.max_model_len, backend))

    def load_weights(self, weights, source: str = "checkpoint") -> None:
        super().load_weights(((_param_name(n), t) for n, t in weights), source=source)


def _param_name(checkpoint_name: str) -> str:
    """Our name for a checkpoint tensor: the experts' tensors renamed, others as they are."""
    prefix, _, last = checkpoint_name.rpartition(".experts.")
    if prefix and f"experts.{last}" in EXPERT_TENSORS:
        return f"{prefix}.{EXPERT_TENSORS['experts.' + last]}"
    return checkpoint_name

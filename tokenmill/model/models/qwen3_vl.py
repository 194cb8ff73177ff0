"""Qwen3-VL (``Qwen3VLForConditionalGeneration``, and ``Qwen3VLMoeForConditionalGeneration``
over the Qwen3-MoE language model; Qwen Team 2025): a ViT of 16-pixel
patches with learned position embeddings (bilinearly resampled to each image's grid) and
2-D rotary angles, a 2x2 patch merger, and the Qwen3 language model (QK-norm) with
interleaved multimodal rotary positions.

Two differences from Qwen2.5-VL shape the engine's side:

- M-RoPE frequencies interleave (``MRotaryEmbedding(interleaved=True)``); the prompt's
  three position streams are Qwen2-VL's for images (``qwen2_5_vl.mrope_positions``).
- DeepStack (Meng et al. 2024, arXiv:2406.04334): the tower also merges the patches after
  some of its blocks (``deepstack_visual_indexes``), and each of those ``K`` features is
  added to the residual stream of the image's placeholders after decoder layer ``k``. The
  encoder output of an image is therefore ``[length, (1 + K) * H]`` (the embeddings, then
  the ``K`` DeepStack features), and a step that holds placeholders hands the features to
  the model (``set_deepstack``) before its forward pass, which adds them through forward
  hooks on the first ``K`` layers. Such steps run eagerly (no image-step CUDA graphs).

The tower is transformers' ``Qwen3VLVisionModel`` with tokenmill's attention (one
variable-length FlashAttention call per step on CUDA).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.attention.backend import AttentionBackend
from tokenmill.model.layers.fused_moe import FusedMoE
from tokenmill.model.layers.linear import ReplicatedLinear
from tokenmill.model.layers.mrope import MRotaryEmbedding
from tokenmill.model.models.llama import LlamaMLP
from tokenmill.model.models.qwen2_5_vl import MRopeImagesMixin
from tokenmill.model.models.qwen2_5_vl_vision import VisionWindowAttention
from tokenmill.model.models.qwen3 import Qwen3ForCausalLM
from tokenmill.model.models.qwen3_moe import Qwen3MoeForCausalLM, is_sparse_layer, num_experts

# Checkpoint name prefixes (transformers 5 layout) -> ours.
_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


class Qwen3VLParts(MRopeImagesMixin):
    """What Qwen3-VL adds to its language model (dense or MoE): the tower, the rotary
    positions and DeepStack; interface as ``DecoderForCausalLM`` plus the multimodal hooks
    (``embed_input_ids``, ``encode_images``, ``mrope_positions``, ``set_deepstack``)."""

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__(model_config, backend)  # type: ignore[call-arg]
        config = self.config
        head_dim = config.get("head_dim") or config.hidden_size // config.num_attention_heads
        self.rotary_emb = MRotaryEmbedding(
            head_dim,
            max_position=config.get("max_position_embeddings", model_config.max_model_len),
            base=config.rope_theta,
            mrope_section=list(config.get("mrope_section", [24, 20, 20])),
            max_model_len=model_config.max_model_len,
            interleaved=True,
        )
        for layer in self.model.layers:
            layer.self_attn.rotary_emb = self.rotary_emb
            layer.self_attn.attn.rotary_emb = self.rotary_emb
        vision = dict(config.vision_config)
        self.visual = _vision_tower(vision)
        self.image_token_id = int(config.image_token_id)
        self.spatial_merge_size = int(vision["spatial_merge_size"])
        self.deepstack_layers = len(vision.get("deepstack_visual_indexes") or ())
        # (placeholder rows of the step [N], features [N, K, H]) until the forward pass.
        self._deepstack: tuple[torch.Tensor, torch.Tensor] | None = None
        for k in range(self.deepstack_layers):
            self.model.layers[k].register_forward_hook(self._add_deepstack(k))

    def _add_deepstack(self, k: int) -> Any:
        def hook(module: nn.Module, args: Any, output: tuple[torch.Tensor, torch.Tensor]):
            if self._deepstack is None:
                return output
            rows, features = self._deepstack
            hidden, residual = output
            # The layer's output is ``hidden + residual``; adding to either adds to it.
            return hidden.index_add(0, rows, features[:, k].to(hidden.dtype)), residual

        return hook

    def set_deepstack(self, rows: torch.Tensor, features: torch.Tensor) -> None:
        """The next forward pass adds ``features [N, K, H]`` to the residual stream of the
        step's tokens ``rows [N]`` (int64) after layers ``0..K-1``."""
        self._deepstack = (rows, features)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """As ``MRopeImagesMixin.forward``; the step's DeepStack features are used once."""
        try:
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._deepstack = None

    def encode_images(self, items: Sequence[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Per image (``pixel_values`` ``[t*h*w, C*tp*p*p]`` float32, ``image_grid_thw``
        ``[3]`` int64) its ``[t*h*w / m^2, (1 + K) * H]`` rows in the model's dtype: the
        embeddings, then the ``K`` DeepStack features."""
        param = self.model.embed_tokens.weight
        pixels = torch.cat([torch.from_numpy(np.array(d["pixel_values"])) for d in items])
        grid = torch.from_numpy(np.stack([np.array(d["image_grid_thw"]) for d in items]))
        out = self.visual(pixels.to(param.device, self.visual.dtype),
                          grid_thw=grid.to(param.device))  # fmt: skip
        rows = torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
        sizes = (grid.prod(-1) // self.spatial_merge_size**2).tolist()
        return list(rows.to(param.dtype).split(sizes))

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
    ) -> None:
        super().load_weights(  # type: ignore[misc]
            ((_checkpoint_name(n), t) for n, t in weights), source
        )


class Qwen3VLForConditionalGeneration(Qwen3VLParts, Qwen3ForCausalLM):
    """Qwen3-VL with the dense Qwen3 language model."""


class Qwen3VLMoeSparseMoeBlock(nn.Module):
    """Router (``gate``) and routed experts, the probabilities of the top ``k``
    renormalised: ``[T, H] -> [T, H]``. The experts load from whole-layer tensors
    (``experts.gate_up_proj``, ``experts.down_proj``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, num_experts(config), bias=False)
        self.experts = FusedMoE(
            num_experts=num_experts(config),
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=True,
            checkpoint_layout="gate_up_halves",
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


class Qwen3VLMoeForConditionalGeneration(Qwen3VLParts, Qwen3MoeForCausalLM):
    """Qwen3-VL with the Qwen3-MoE language model (Qwen3-VL-30B-A3B, 235B-A22B)."""

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        if is_sparse_layer(c, layer_idx):
            return Qwen3VLMoeSparseMoeBlock(c)
        return LlamaMLP(c.hidden_size, c.intermediate_size, c.get("hidden_act", "silu"), False)


def _checkpoint_name(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    for checkpoint, ours in (("experts.gate_up_proj", "experts.w13.weight"),
                             ("experts.down_proj", "experts.w2.weight")):  # fmt: skip
        if name.endswith(checkpoint):
            return name[: -len(checkpoint)] + ours
    return name


def _vision_tower(vision_config: dict) -> nn.Module:
    """transformers' Qwen3-VL vision tower with tokenmill's attention, built on the current
    default device and dtype."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    config = Qwen3VLVisionConfig(**vision_config)
    config._attn_implementation = "sdpa"
    tower = Qwen3VLVisionModel(config)
    for block in tower.blocks:  # same parameter names (qkv, proj)
        block.attn = VisionWindowAttention(config.hidden_size, config.num_heads)
    return tower

"""Qwen2.5-VL (Bai et al. 2025): a ViT with window attention and a 2x2 patch merger in
front of the Qwen2 language model, with multimodal rotary positions (M-RoPE); and Qwen2-VL,
the same but for its vision tower (``Qwen2VLForConditionalGeneration``).

The language model is Qwen2's (``llama.py``) with ``MRotaryEmbedding`` in every layer. The
vision tower is transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` (patch embedding,
rotary angles, windows, merger) with tokenmill's blocks (``qwen2_5_vl_vision.py``: window
attention, fused kernels, the merged MLP); its weights load from the checkpoint's
``visual.*`` tensors like every other parameter. Image embeddings ``[num_placeholders, H]``
replace the embeddings of the ``<|image_pad|>`` placeholders
(``MultiModalFeature.offset/length``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tokenmill.config import ModelConfig
from tokenmill.model.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.model.layers.mrope import MRotaryEmbedding
from tokenmill.model.models.llama import Qwen2ForCausalLM
from tokenmill.model.models.qwen2_5_vl_vision import VisionBlock, VisionMLP, VisionWindowAttention


def mrope_positions(
    num_tokens: int, items: Sequence[tuple[int, int, Sequence[int]]], spatial_merge_size: int
) -> tuple[np.ndarray, int]:
    """Qwen2-VL's three position streams of a prompt (transformers' ``get_rope_index``).

    Text tokens count up by one on all three streams. An image's placeholders, an
    ``(t, h/m, w/m)`` grid in row-major order, take ``start + (t_i, h_i, w_i)``; the text after
    it starts at ``start + max(h, w) / m``.

    Args:
        num_tokens: prompt length.
        items: ``(offset, length, (t, h, w) patch grid)`` of each image, by offset.
        spatial_merge_size: ``m``, patches merged per side into one placeholder.

    Returns:
        ``([3, num_tokens] int64 positions, delta)``: token ``p >= num_tokens`` (generated)
        sits at ``p + delta`` on every stream.
    """
    pos = np.empty((3, num_tokens), dtype=np.int64)
    current = prev_end = 0
    for offset, length, (t, h, w) in items:
        pos[:, prev_end:offset] = current + np.arange(offset - prev_end)
        current += offset - prev_end
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij"))
        pos[:, offset : offset + length] = grid.reshape(3, -1) + current
        current += max(gh, gw)
        prev_end = offset + length
    pos[:, prev_end:] = current + np.arange(num_tokens - prev_end)
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos, delta


class MRopeImagesMixin:
    """The hooks a Qwen-VL model with M-RoPE adds to its language model (needs
    ``rotary_emb``, an ``MRotaryEmbedding``, and ``spatial_merge_size``)."""

    uses_mrope = True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
        mrope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As ``DecoderForCausalLM.forward``; ``mrope_positions`` ``[3, T]`` (int64), when
        the step holds image tokens, replaces ``positions`` for the rotary embedding."""
        self.rotary_emb.set_step_positions(mrope_positions)
        try:
            return self.model(input_ids, positions, metadata, inputs_embeds)
        finally:
            self.rotary_emb.set_step_positions(None)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, H]`` (placeholders included, to be overwritten)."""
        return self.model.embed(input_ids)

    def mrope_positions(
        self, num_tokens: int, items: Sequence[tuple[int, int, dict[str, np.ndarray]]]
    ) -> tuple[np.ndarray, int]:
        """The prompt's M-RoPE positions (see ``mrope_positions``); ``items`` are
        ``(offset, length, encoder inputs)`` of its images."""
        grids = [(o, n, [int(x) for x in d["image_grid_thw"]]) for o, n, d in items]
        return mrope_positions(num_tokens, grids, self.spatial_merge_size)


class Qwen2_5_VLForConditionalGeneration(MRopeImagesMixin, Qwen2ForCausalLM):
    """Qwen2.5-VL; interface as ``DecoderForCausalLM`` plus the multimodal hooks
    (``embed_input_ids``, ``encode_images``, ``mrope_positions``)."""

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__(model_config, backend)
        config = self.config
        head_dim = config.get("head_dim") or config.hidden_size // config.num_attention_heads
        self.rotary_emb = MRotaryEmbedding(
            head_dim,
            max_position=config.get("max_position_embeddings", model_config.max_model_len),
            base=config.rope_theta,
            mrope_section=list(config.get("mrope_section", [16, 24, 24])),
            max_model_len=model_config.max_model_len,
        )
        for layer in self.model.layers:
            layer.self_attn.rotary_emb = self.rotary_emb
            layer.self_attn.attn.rotary_emb = self.rotary_emb
        self.visual = self.build_vision_tower(config.vision_config)
        self.image_token_id = int(config.image_token_id)
        self.spatial_merge_size = int(config.vision_config["spatial_merge_size"])

    @staticmethod
    def build_vision_tower(vision_config: dict) -> torch.nn.Module:
        """The vision tower of ``vision_config`` (the checkpoint's), built on the current
        default device and dtype."""
        return _vision_tower(vision_config)

    def encode_images(self, items: Sequence[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Run the vision tower over images processed by the model's image processor.

        Args:
            items: per image ``pixel_values`` ``[t*h*w, C*tp*p*p]`` float32 and
                ``image_grid_thw`` ``[3]`` int64.

        Returns:
            Per image its embeddings ``[t*h*w / m^2, H]`` in the model's dtype.
        """
        param = self.model.embed_tokens.weight
        pixels = torch.cat([torch.from_numpy(np.array(d["pixel_values"])) for d in items])
        grid = torch.from_numpy(np.stack([np.array(d["image_grid_thw"]) for d in items]))
        pixels = pixels.to(param.device, self.visual.dtype)
        out = self.visual(pixels, grid_thw=grid.to(param.device))
        out = getattr(out, "pooler_output", out)  # transformers 4 returns the tensor itself
        sizes = (grid.prod(-1) // self.spatial_merge_size**2).tolist()
        return list(out.to(param.dtype).split(sizes))

def _vision_tower(vision_config: dict) -> torch.nn.Module:
    """transformers' Qwen2.5-VL vision tower, built on the current default device/dtype."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    config = Qwen2_5_VLVisionConfig(**vision_config)
    config._attn_implementation = "sdpa"
    tower = Qwen2_5_VisionTransformerPretrainedModel(config)
    # tokenmill's blocks (see qwen2_5_vl_vision.py): all windows in one varlen call, fused
    # norms, rotary and gate on CUDA, the MLP merged and padded.
    tower.blocks = torch.nn.ModuleList(
        VisionBlock(
            block.norm1,
            block.norm2,
            VisionWindowAttention(config.hidden_size, config.num_heads),
            VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act),
        )
        for block in tower.blocks
    )
    return tower


class Qwen2VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen2-VL (Wang et al. 2024, arXiv:2409.12191): Qwen2.5-VL's language model, prompt
    layout and M-RoPE, with the earlier vision tower -- every block attends over the whole
    image (no windows), LayerNorms, a QuickGELU MLP (``fc1``/``fc2``) -- built as
    transformers' ``Qwen2VisionTransformerPretrainedModel`` with tokenmill's attention
    (one variable-length FlashAttention call per step on CUDA)."""

    @staticmethod
    def build_vision_tower(vision_config: dict) -> torch.nn.Module:
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel,
        )

        settings = dict(vision_config)
        if "in_chans" in settings:  # the name in the released checkpoints' config.json
            settings.setdefault("in_channels", settings.pop("in_chans"))
        config = Qwen2VLVisionConfig(**settings)
        config._attn_implementation = "sdpa"
        tower = Qwen2VisionTransformerPretrainedModel(config)
        for block in tower.blocks:  # same parameter names (qkv, proj)
            block.attn = VisionWindowAttention(config.embed_dim, config.num_heads)
        return tower

"""InternVL (Chen et al. 2024, arXiv:2412.05271; ``InternVLForConditionalGeneration``, the
transformers form of InternVL 2.5, 3 and 3.5): an InternViT tower over square tiles, pixel
shuffle (each 2x2 group of patch features concatenated, ``downsample_ratio`` 0.5), a
LayerNorm + two-layer GELU projector, and a language model of the family its
``text_config`` names (Qwen2, Qwen3, Qwen3-MoE or Llama).

``multimodal/internvl.py`` lays an image out as ``<img>``, ``image_seq_length`` context
tokens per tile, ``</img>``; the encoder output of an image is its tiles' projected
features in order. Attention in the language model is causal everywhere, as in
transformers. The tower is transformers' ``InternVLVisionModel``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.attention.backend import AttentionBackend
from tokenmill.model.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from tokenmill.model.models.llava import hf_vision_tower, vlm_checkpoint_name
from tokenmill.model.models.qwen3 import Qwen3ForCausalLM
from tokenmill.model.models.qwen3_moe import Qwen3MoeForCausalLM
from tokenmill.model.registry import UnsupportedArchitectureError


def pixel_shuffle(features: torch.Tensor, ratio: float) -> torch.Tensor:
    """``[B, W, H, C] -> [B, W * r, H * r, C / r^2]`` for ``r = ratio`` (0.5: each 2x2
    neighbourhood's channels side by side), in InternVL's order.

    Raises:
        ValueError: a side not divisible by ``1 / ratio``.
    """
    b, w, h, c = features.shape
    if (h * ratio) % 1 or (w * ratio) % 1:
        raise ValueError(f"a {w} x {h} patch grid does not shuffle by {ratio}")
    x = features.reshape(b, w, int(h * ratio), int(c / ratio)).permute(0, 2, 1, 3)
    x = x.reshape(b, int(h * ratio), int(w * ratio), int(c / ratio**2))
    return x.permute(0, 2, 1, 3).contiguous()


class InternVLParts:
    """What InternVL adds to its language model: the tower, pixel shuffle and projector;
    interface as ``DecoderForCausalLM`` plus ``embed_input_ids`` and ``encode_images``."""

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__(model_config, backend)  # type: ignore[call-arg]
        from transformers import InternVLConfig
        from transformers.models.internvl.modeling_internvl import InternVLMultiModalProjector

        config = self.config  # type: ignore[attr-defined]
        vision = dict(config.vision_config)
        self.vision_tower = hf_vision_tower(vision)
        self.feature_layer = int(config.get("vision_feature_layer", -1))
        self.drop_cls = config.get("vision_feature_select_strategy", "default") == "default"
        self.downsample_ratio = float(config.get("downsample_ratio", 0.5))
        self.multi_modal_projector = InternVLMultiModalProjector(InternVLConfig(
            vision_config=vision,
            text_config={"model_type": "qwen2", "hidden_size": config.hidden_size},
            downsample_ratio=self.downsample_ratio,
            projector_hidden_act=config.get("projector_hidden_act", "gelu"),
        ))  # fmt: skip

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, H]`` (placeholders included, to be overwritten)."""
        return self.model.embed(input_ids)  # type: ignore[attr-defined]

    def encode_images(self, items: Sequence[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Per image (``pixel_values`` ``[tiles, 3, S, S]`` float32) its
        ``[tiles * image_seq_length, H]`` embeddings in the model's dtype."""
        param = self.model.embed_tokens.weight  # type: ignore[attr-defined]
        out = []
        for d in items:
            pixels = torch.from_numpy(np.array(d["pixel_values"])).to(param.device, param.dtype)
            result = self.vision_tower(pixel_values=pixels, output_hidden_states=True)
            features = (result.last_hidden_state if self.feature_layer == -1
                        else result.hidden_states[self.feature_layer])  # fmt: skip
            if self.drop_cls:
                features = features[:, 1:]
            side = int(features.shape[1] ** 0.5)
            features = features.reshape(features.shape[0], side, side, -1)
            features = pixel_shuffle(features, self.downsample_ratio)
            features = features.reshape(features.shape[0], -1, features.shape[-1])
            out.append(self.multi_modal_projector(features).flatten(0, 1).to(param.dtype))
        return out

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
    ) -> None:
        super().load_weights(  # type: ignore[misc]
            ((vlm_checkpoint_name(n), t) for n, t in weights), source
        )


# text_config.model_type -> the language model InternVL wraps.
_LANGUAGE_MODELS: dict[str, type[nn.Module]] = {
    "qwen2": Qwen2ForCausalLM,
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}
_CLASSES: dict[str, type[nn.Module]] = {
    name: type(f"InternVL{base.__name__}", (InternVLParts, base), {})
    for name, base in _LANGUAGE_MODELS.items()
}


def InternVLForConditionalGeneration(  # noqa: N802 - the architecture's name in config.json
    model_config: ModelConfig, backend: type[AttentionBackend]
) -> Any:
    """The InternVL model over the language model its config names.

    Raises:
        UnsupportedArchitectureError: a language model family tokenmill does not wrap.
    """
    family = model_config.hf_config.get("model_type")
    cls = _CLASSES.get(family)
    if cls is None:
        raise UnsupportedArchitectureError(
            f"InternVL with a {family!r} language model is not supported "
            f"(supported: {', '.join(sorted(_CLASSES))})"
        )
    return cls(model_config, backend)

"""LLaVA (Liu et al. 2023): a CLIP or SigLIP vision tower, a two-layer MLP projector and a
Llama-family language model; the generic path for vision-language checkpoints of that
shape (``LlavaForConditionalGeneration``). A Pixtral tower (Pixtral-12B) takes each image
at its own size instead, laid out as Mistral 3 lays it out (``mistral3.py``).

Each image is one fixed-size tile (the image processor's crop): the tower's hidden states
of ``vision_feature_layer`` (the CLS position dropped under the ``default`` strategy) are
projected to the language model's width, one embedding per placeholder token. Attention is
causal everywhere, as in transformers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.attention.backend import AttentionBackend
from tokenmill.model.models.llama import LlamaForCausalLM
from tokenmill.model.models.pixtral_image import pixtral_features, with_row_breaks

# Checkpoint name prefixes (transformers 4 and 5 layouts) -> ours.
_RENAMES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


class LlavaProjector(nn.Module):
    """``linear_2(act(linear_1(x)))``: vision features ``[N, Dv]`` -> ``[N, H]``."""

    def __init__(self, vision_dim: int, text_dim: int, act: str, bias: bool) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """LLaVA; interface as ``DecoderForCausalLM`` plus ``embed_input_ids`` and
    ``encode_images``."""

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__(model_config, backend)
        config = self.config
        vision = dict(config.vision_config)
        self.vision_tower = hf_vision_tower(vision)
        layer = config.get("vision_feature_layer", -2)
        self.feature_layers = [layer] if isinstance(layer, int) else list(layer)
        self.drop_cls = config.get("vision_feature_select_strategy", "default") == "default"
        # A Pixtral tower (Pixtral-12B): images at their own size, rows closed by breaks.
        self.pixtral_patch = int(vision["patch_size"]) if is_pixtral(vision) else 0
        self.multi_modal_projector = LlavaProjector(
            vision["hidden_size"] * len(self.feature_layers),
            config.hidden_size,
            config.get("projector_hidden_act", "gelu"),
            bool(config.get("multimodal_projector_bias", True)),
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, H]`` (placeholders included, to be overwritten)."""
        return self.model.embed(input_ids)

    def encode_images(self, items: Sequence[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Per image (``pixel_values`` ``[3, S, S]`` float32) its embeddings
        ``[tokens_per_image, H]`` in the model's dtype; with a Pixtral tower, as
        ``Mistral3ForConditionalGeneration.encode_images`` (no patch merging)."""
        param = self.model.embed_tokens.weight
        if self.pixtral_patch:
            out = []
            for d in items:
                special = torch.from_numpy(np.array(d["special_ids"], dtype=np.int64))
                features = pixtral_features(self.vision_tower, d, self.feature_layers,
                                            param.dtype, param.device)  # fmt: skip
                h, w = (int(x) // self.pixtral_patch for x in d["image_sizes"])
                out.append(with_row_breaks(self.multi_modal_projector(features), h, w,
                                           self.model.embed(special.to(param.device))))  # fmt: skip
            return out
        pixels = torch.from_numpy(np.stack([np.array(d["pixel_values"]) for d in items]))
        out = self.vision_tower(
            pixels.to(param.device, param.dtype), output_hidden_states=True
        ).hidden_states
        features = torch.cat([out[i][:, int(self.drop_cls) :] for i in self.feature_layers], -1)
        return list(self.multi_modal_projector(features).to(param.dtype))

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
    ) -> None:
        super().load_weights(((vlm_checkpoint_name(n), t) for n, t in weights), source)


def is_pixtral(vision_config: dict) -> bool:
    """Whether a LLaVA checkpoint's tower is Pixtral's (Pixtral-12B in transformers' form)."""
    return vision_config.get("model_type") == "pixtral"


def vlm_checkpoint_name(name: str) -> str:
    """A vision-language checkpoint's tensor name (transformers 4 or 5 layout) -> ours:
    the language model under ``model.`` / ``lm_head.``, the tower under ``vision_tower.``
    (its ``vision_model.`` level dropped), the projector under ``multi_modal_projector.``."""
    for old, new in _RENAMES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    return name.replace("vision_tower.vision_model.", "vision_tower.")


def hf_vision_tower(vision_config: dict) -> nn.Module:
    """transformers' CLIP or SigLIP vision model (flat parameter names), SDPA attention."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model(**vision_config)
    config._attn_implementation = "sdpa"
    return AutoModel.from_config(config)

"""Mistral 3 vision-language models (``Mistral3ForConditionalGeneration``: Mistral Small 3.1
and 3.2): a Pixtral vision tower (2-D rotary patches of any size and aspect ratio), a
projector that merges each 2x2 group of patches (RMSNorm, a learned merge, a two-layer
GELU MLP) and a Mistral language model (``llama.py``).

An image of ``R x C`` merged patches is written in the prompt as Mistral's processor
writes it: each row's ``C`` ``[IMG]`` tokens followed by ``[IMG_BREAK]``, the last row's
break replaced by ``[IMG_END]``. The image is one feature over all ``R * (C + 1)`` tokens:
its encoder output holds the projected patches at the ``[IMG]`` places and the embeddings
of the break and end tokens at theirs, so the run is written into the step's embeddings
as one block (the break and end rows equal what the token embedding would give).

The tower and projector are transformers' modules (``PixtralVisionModel``,
``Mistral3MultiModalProjector``), run once per image; attention in the language model is
causal everywhere, as in transformers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from tokenmill.config import ModelConfig
from tokenmill.model.attention.backend import AttentionBackend
from tokenmill.model.models.llama import LlamaForCausalLM
from tokenmill.model.models.llava import hf_vision_tower, vlm_checkpoint_name
from tokenmill.model.models.pixtral_image import pixtral_features, with_row_breaks


class Mistral3ForConditionalGeneration(LlamaForCausalLM):
    """Mistral 3 with images; interface as ``DecoderForCausalLM`` plus ``embed_input_ids``
    and ``encode_images``."""

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__(model_config, backend)
        from transformers import Mistral3Config
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

        config = self.config
        vision = dict(config.vision_config)
        self.vision_tower = hf_vision_tower(vision)
        layer = config.get("vision_feature_layer", -1)
        self.feature_layers = [layer] if isinstance(layer, int) else list(layer)
        projector_config = Mistral3Config(
            vision_config=vision,
            text_config={"model_type": "mistral", "hidden_size": config.hidden_size,
                         "rms_norm_eps": config.rms_norm_eps},  # fmt: skip
            spatial_merge_size=int(config.get("spatial_merge_size", 2)),
            vision_feature_layer=layer,
            projector_hidden_act=config.get("projector_hidden_act", "gelu"),
            multimodal_projector_bias=bool(config.get("multimodal_projector_bias", False)),
        )
        self.multi_modal_projector = Mistral3MultiModalProjector(projector_config)
        self.downsample = int(vision["patch_size"]) * projector_config.spatial_merge_size

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, H]`` (placeholders included, to be overwritten)."""
        return self.model.embed(input_ids)

    def encode_images(self, items: Sequence[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Per image (``pixel_values`` ``[3, h, w]`` float32, ``h`` and ``w`` multiples of
        the merged patch side; ``image_sizes`` ``[2]``; ``special_ids`` ``[2]``: the
        tokenizer's ``[IMG_BREAK]`` and ``[IMG_END]``) its ``R * (C + 1)`` rows (see the
        module docstring) in the model's dtype."""
        param = self.model.embed_tokens.weight
        out = []
        for d in items:
            special = torch.from_numpy(np.array(d["special_ids"], dtype=np.int64))
            features = pixtral_features(self.vision_tower, d, self.feature_layers, param.dtype,
                                        param.device)  # fmt: skip
            size = [int(x) for x in d["image_sizes"]]
            merged = self.multi_modal_projector(features, torch.tensor([size]))
            rows, cols = size[0] // self.downsample, size[1] // self.downsample
            out.append(with_row_breaks(merged, rows, cols,
                                       self.model.embed(special.to(param.device))))  # fmt: skip
        return out

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
    ) -> None:
        super().load_weights(((vlm_checkpoint_name(n), t) for n, t in weights), source)

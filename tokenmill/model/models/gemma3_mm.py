"""Gemma 3 vision-language models (Gemma Team 2025, arXiv:2503.19786): a SigLIP vision
tower, a pooling projector and the Gemma 3 text model (``Gemma3ForConditionalGeneration``,
the 4B, 12B and 27B checkpoints).

Each image is one fixed-size crop (``vision_config.image_size``, 896 for the released
models). The tower's last hidden states, a ``p x p`` grid of patch features, are
average-pooled to ``mm_tokens_per_image`` tokens (a ``sqrt(mm_tokens_per_image)``-sided
grid), normalised by a Gemma RMSNorm (``mm_soft_emb_norm``, weights applied as
``1 + w``) and projected to the text width by ``mm_input_projection_weight``
(``[vision_hidden, text_hidden]``). Those embeddings replace the embeddings of the
prompt's ``<image_soft_token>`` placeholders unscaled, while text tokens keep Gemma's
``sqrt(hidden_size)``-scaled embeddings.

An image's placeholders attend to each other both ways (the rest of the prompt stays
causal): ``bidirectional_image_attention`` tells the runner to give each placeholder
token the last position of its image as the last key it may see.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.attention.backend import AttentionBackend
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.models.gemma3 import Gemma3ForCausalLM
from tokenmill.model.models.llava import hf_vision_tower, vlm_checkpoint_name


class Gemma3MultiModalProjector(nn.Module):
    """Patch features ``[N, p*p, Dv]`` -> image embeddings ``[N, t*t, H]`` (transformers'
    ``Gemma3MultiModalProjector``): ``t x t`` average pooling of the ``p x p`` patch grid,
    ``mm_soft_emb_norm``, then ``@ mm_input_projection_weight``.

    Args:
        vision_dim: ``Dv``, the tower's width.
        text_dim: ``H``, the language model's width.
        patches_per_side: ``p``, ``image_size // patch_size``.
        tokens_per_image: ``t * t``, ``mm_tokens_per_image``.
        eps: the norm's epsilon (the tower's ``layer_norm_eps``).

    Raises:
        ValueError: ``tokens_per_image`` is not a square whose side divides ``p``.
    """

    def __init__(
        self, vision_dim: int, text_dim: int, patches_per_side: int, tokens_per_image: int,
        eps: float,
    ) -> None:  # fmt: skip
        super().__init__()
        side = round(tokens_per_image**0.5)
        if side * side != tokens_per_image or side == 0 or patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image {tokens_per_image} must be the square of a number that "
                f"divides the {patches_per_side} patches per side of the vision tower"
            )
        self.patches_per_side = patches_per_side
        self.kernel = patches_per_side // side
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision_dim, text_dim))
        self.mm_soft_emb_norm = RMSNorm(vision_dim, eps, offset=1.0)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        n, _, dim = features.shape
        p = self.patches_per_side
        grid = features.transpose(1, 2).reshape(n, dim, p, p)
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel)
        pooled = pooled.flatten(2).transpose(1, 2)  # [N, t*t, Dv], row-major grid order
        normed = self.mm_soft_emb_norm(pooled.reshape(-1, dim)).view(pooled.shape)
        return torch.matmul(normed, self.mm_input_projection_weight).to(features.dtype)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3 with images; interface as ``Gemma3ForCausalLM`` plus ``embed_input_ids`` and
    ``encode_images``. Config: the text model's keys (``text_config``, merged to the top
    level) with ``vision_config`` (SigLIP), ``mm_tokens_per_image`` and
    ``image_token_index``."""

    # The runner lets each image's placeholders see the whole image (see the module doc).
    bidirectional_image_attention = True

    def __init__(self, model_config: ModelConfig, backend: type[AttentionBackend]) -> None:
        super().__init__(model_config, backend)
        config = self.config
        vision = dict(config.vision_config)
        vision.setdefault("model_type", "siglip_vision_model")
        self.vision_tower = hf_vision_tower(vision)
        tower = self.vision_tower.config
        self.multi_modal_projector = Gemma3MultiModalProjector(
            tower.hidden_size,
            config.hidden_size,
            tower.image_size // tower.patch_size,
            int(config.get("mm_tokens_per_image", 256)),
            tower.layer_norm_eps,
        )
        self.image_token_id = int(config.get("image_token_index", config.get("image_token_id")))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, H]``, scaled by ``sqrt(hidden_size)`` as transformers'
        ``Gemma3TextScaledWordEmbedding`` (placeholders included, to be overwritten; an
        image token id past the vocabulary reads row 0, as in transformers)."""
        vocab = self.model.embed_tokens.weight.shape[0]
        if self.image_token_id >= vocab:
            input_ids = input_ids.masked_fill(input_ids == self.image_token_id, 0)
        return self.model.embed(input_ids)

    def encode_images(self, items: Sequence[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Run the tower and the projector over images processed by Gemma3ImageProcessor.

        Args:
            items: per image ``pixel_values`` ``[3, S, S]`` float32.

        Returns:
            Per image its embeddings ``[mm_tokens_per_image, H]`` in the model's dtype.
        """
        param = self.model.embed_tokens.weight
        pixels = torch.from_numpy(np.stack([np.array(d["pixel_values"]) for d in items]))
        features = self.vision_tower(pixel_values=pixels.to(param.device, param.dtype))
        return list(self.multi_modal_projector(features.last_hidden_state).to(param.dtype))

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint"
    ) -> None:
        super().load_weights(((vlm_checkpoint_name(n), t) for n, t in weights), source)

"""InternVL images in a prompt (``InternVLForConditionalGeneration``, transformers' form of
InternVL 2.5 / 3 / 3.5): the image processor tiles each image (``crop_to_patches``: up to
``max_patches`` square tiles of the tower's size by the aspect ratio, and a thumbnail), and
the prompt's ``<IMG_CONTEXT>`` becomes ``<img>``, ``image_seq_length`` context tokens per
tile, ``</img>`` -- as transformers' ``InternVLProcessor`` writes it. The image is one
feature over its context tokens, its tiles encoded together."""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenmill.multimodal.errors import MultiModalConfigError


def uses_internvl_layout(hf_config: Any) -> bool:
    return (hf_config.get("architectures") or [""])[0] == "InternVLForConditionalGeneration"


class InternVLImageTokens:
    """The prompt layout of InternVL images.

    Args:
        hf_config: the model's config (``image_token_id``, ``image_seq_length``,
            ``vision_config.image_size``).
        tokenizer: the model's tokenizer (``<img>`` and ``</img>`` ids).

    Raises:
        MultiModalConfigError: the tokenizer has no ``<img>`` or ``</img>`` token.
    """

    def __init__(self, hf_config: Any, tokenizer: Any) -> None:
        vision = hf_config.get("vision_config") or {}
        size = vision.get("image_size", 448)
        self.tile = int(size[0] if isinstance(size, (list, tuple)) else size)
        patch = vision.get("patch_size", 14)
        patch = int(patch[0] if isinstance(patch, (list, tuple)) else patch)
        ratio = float(hf_config.get("downsample_ratio", 0.5))
        self.image_token_id = int(hf_config.get("image_token_id"))
        self.tokens_per_tile = int(hf_config.get("image_seq_length")
                                   or round((self.tile // patch) ** 2 * ratio**2))  # fmt: skip
        ids = []
        for token in ("<img>", "</img>"):
            tid = tokenizer.convert_tokens_to_ids(token)
            if tid is None or tid == getattr(tokenizer, "unk_token_id", None):
                raise MultiModalConfigError(
                    f"the tokenizer has no {token} token, which InternVL images need"
                )
            ids.append(int(tid))
        self.start_token_id, self.end_token_id = ids

    def processor_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` (``--mm-processor-kwargs``) over tiling on, as InternVLProcessor
        asks for it."""
        return {"crop_to_patches": True, **kwargs}

    def encoder_input(self, out: Any) -> dict[str, np.ndarray]:
        """The image processor's output for one image -> ``pixel_values [tiles, 3, S, S]``."""
        return {"pixel_values": np.asarray(out["pixel_values"], dtype=np.float32)}

    def check(self, data: dict[str, np.ndarray]) -> str | None:
        """What the tower takes, where ``data`` is not that; None where it is."""
        shape = list(data["pixel_values"].shape)
        if len(shape) == 4 and shape[0] >= 1 and shape[1:] == [3, self.tile, self.tile]:
            return None
        return f"[tiles, 3, {self.tile}, {self.tile}] pixel values"

    def replacement(self, data: dict[str, np.ndarray]) -> tuple[list[int], list[tuple[int, int]]]:
        """``<img>``, the context tokens of every tile, ``</img>``; the feature covers the
        context tokens."""
        length = self.tokens_per_tile * int(data["pixel_values"].shape[0])
        return [self.start_token_id, *[self.image_token_id] * length, self.end_token_id], [
            (1, length)
        ]

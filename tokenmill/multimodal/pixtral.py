"""Mistral 3 (and Pixtral-12B: LLaVA with a Pixtral tower) images in a prompt: the tokens
that replace an image's ``[IMG]`` placeholder, and the image processor's arguments, as
transformers' ``PixtralProcessor`` makes them.

An image resized to ``R x C`` merged patches (each ``patch_size * spatial_merge_size``
pixels a side; the processor's resize rounds the sides to that unit) is written as ``R``
rows of ``C`` ``[IMG]`` tokens, each row closed by ``[IMG_BREAK]``, the last by
``[IMG_END]`` instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenmill.multimodal.errors import MultiModalConfigError


def uses_pixtral_layout(hf_config: Any) -> bool:
    """Mistral 3, or a LLaVA checkpoint with a Pixtral tower (Pixtral-12B)."""
    arch = (hf_config.get("architectures") or [""])[0]
    vision = hf_config.get("vision_config") or {}
    return arch == "Mistral3ForConditionalGeneration" or (
        arch == "LlavaForConditionalGeneration" and vision.get("model_type") == "pixtral"
    )


class PixtralImageTokens:
    """The prompt layout of Mistral 3 images.

    Args:
        hf_config: the model's config (``image_token_index``, ``spatial_merge_size``,
            ``vision_config.patch_size``).
        tokenizer: the model's tokenizer (``[IMG_BREAK]`` and ``[IMG_END]`` ids).

    Raises:
        MultiModalConfigError: the tokenizer has no ``[IMG_BREAK]`` or ``[IMG_END]`` token.
    """

    def __init__(self, hf_config: Any, tokenizer: Any) -> None:
        vision = hf_config.get("vision_config") or {}
        self.image_token_id = int(hf_config.get("image_token_index",
                                                hf_config.get("image_token_id", 10)))  # fmt: skip
        # Mistral 3 merges 2x2 patches; a LLaVA checkpoint's Pixtral tower does not.
        arch = (hf_config.get("architectures") or [""])[0]
        merge = hf_config.get("spatial_merge_size", 2 if arch.startswith("Mistral3") else 1)
        self.unit = int(vision.get("patch_size", 14)) * int(merge)
        ids = []
        for token in ("[IMG_BREAK]", "[IMG_END]"):
            tid = tokenizer.convert_tokens_to_ids(token)
            if tid is None or tid == getattr(tokenizer, "unk_token_id", None):
                raise MultiModalConfigError(
                    f"the tokenizer has no {token} token, which Mistral 3 images need"
                )
            ids.append(int(tid))
        self.break_token_id, self.end_token_id = ids

    def processor_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` (``--mm-processor-kwargs``) with the merged patch side as the resize
        unit (``patch_size``), as ``PixtralProcessor`` passes it, unless they set it."""
        return {"patch_size": {"height": self.unit, "width": self.unit}, **kwargs}

    def encoder_input(self, out: Any) -> dict[str, np.ndarray]:
        """The image processor's output for one image -> the encoder's input:
        ``pixel_values [3, h, w]``, ``image_sizes [2]`` and ``special_ids`` (the break and
        end ids, whose embeddings the model writes at their places)."""
        pixels = np.asarray(out["pixel_values"][0], dtype=np.float32)
        size = np.asarray(out["image_sizes"][0], dtype=np.int64)
        return {"pixel_values": pixels[:, : size[0], : size[1]], "image_sizes": size,
                "special_ids": np.array([self.break_token_id, self.end_token_id])}  # fmt: skip

    def check(self, data: dict[str, np.ndarray]) -> str | None:
        """What the tower takes, where ``data`` is not that; None where it is."""
        h, w = (int(x) for x in data["image_sizes"])
        shape = list(data["pixel_values"].shape)
        if shape == [3, h, w] and h % self.unit == w % self.unit == 0 and h and w:
            return None
        return f"[3, h, w] pixel values whose sides are multiples of {self.unit}"

    def replacement(self, data: dict[str, np.ndarray]) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids that replace the image's ``[IMG]`` and the one run its feature covers
        (all of them: the model fills the break and end rows)."""
        h, w = (int(x) for x in data["image_sizes"])
        rows, cols = h // self.unit, w // self.unit
        ids: list[int] = []
        for _ in range(rows):
            ids += [self.image_token_id] * cols + [self.break_token_id]
        ids[-1] = self.end_token_id
        return ids, [(0, len(ids))]

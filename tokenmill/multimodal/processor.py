"""MultiModalProcessor: a tokenized prompt and its images -> the prompt with each image's
placeholder expanded to the image's token count, and one ``MultiModalFeature`` per image.

Images go through the model's own image processor (transformers' ``AutoImageProcessor``
from the model folder: resizing, normalization, patching). The prompt marks each image with
one image token (``config.image_token_id``, written by the chat template); the model's
processor rule decides how many tokens replace it (Qwen2-VL: one per 2x2 merged patches;
LLaVA: one per patch of the fixed-size crop).
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import numpy as np

from tokenmill.multimodal.inputs import MultiModalFeature, PackedArray
from tokenmill.multimodal.media import MediaError, check_image


def llava_tokens_per_image(hf_config: Any) -> int:
    """Placeholder tokens of one image: the tower's patches, plus its CLS token under the
    ``full`` strategy, minus one under ``default`` (which drops the first position)."""
    vision = hf_config.get("vision_config")
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    has_cls = vision.get("model_type", "clip_vision_model") == "clip_vision_model"
    strategy = hf_config.get("vision_feature_select_strategy", "default")
    return patches + int(has_cls) - int(strategy == "default")


def image_hash(image: Any) -> str:
    """sha256 hex digest of an image's mode, size and pixels."""
    h = hashlib.sha256()
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


class MultiModalProcessor:
    """Expands image placeholders and runs the model's image processor (thread-safe).

    Args:
        model: the model folder (its ``preprocessor_config.json``).
        hf_config: the model's config (``image_token_id``, ``vision_config``).
        limit_per_prompt: modality -> most items per prompt.
        processor_kwargs: keyword arguments of every image processor call
            (``--mm-processor-kwargs``).
    """

    def __init__(
        self,
        model: str,
        hf_config: Any,
        limit_per_prompt: dict[str, int],
        processor_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.processor_kwargs = dict(processor_kwargs or {})
        token = hf_config.get("image_token_id", hf_config.get("image_token_index"))
        self.image_token_id = int(token)
        self.merge_size = int(hf_config.get("vision_config", {}).get("spatial_merge_size", 1))
        # Fixed-size models (LLaVA): placeholders per image; None: from the patch grid.
        self.tokens_per_image: int | None = None
        if (hf_config.get("architectures") or [""])[0] == "LlavaForConditionalGeneration":
            self.tokens_per_image = llava_tokens_per_image(hf_config)
        self.limit_per_prompt = limit_per_prompt
        self._image_processor: Any = None
        self._lock = threading.Lock()

    def preload(self) -> None:
        """Load the image processor in a background thread (the first image then does not
        wait seconds for transformers' imports)."""
        threading.Thread(target=lambda: self.image_processor, daemon=True).start()

    @property
    def image_processor(self) -> Any:
        with self._lock:  # loaded once, on first use (start-up stays fast)
            if self._image_processor is None:
                from transformers import AutoImageProcessor

                self._image_processor = AutoImageProcessor.from_pretrained(self.model)
            return self._image_processor

    def process(
        self, prompt_ids: list[int], images: list[Any]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Expand the prompt's image placeholders and process its images.

        Args:
            prompt_ids: the prompt, one image token per image, in image order.
            images: RGB ``PIL.Image.Image`` objects.

        Returns:
            ``(prompt ids with placeholders expanded, one feature per image)``.

        Raises:
            MediaError: more images than ``limit_per_prompt``, a count of image tokens
                other than the count of images, or an image past the pixel bound.
        """
        limit = self.limit_per_prompt.get("image", 0)
        if len(images) > limit:
            raise MediaError(
                f"at most {limit} image(s) may be provided in one prompt, got {len(images)} "
                "(--limit-mm-per-prompt)"
            )
        positions = [i for i, t in enumerate(prompt_ids) if t == self.image_token_id]
        if len(positions) != len(images):
            raise MediaError(
                f"the prompt has {len(positions)} image placeholder(s) for {len(images)} "
                "image(s)"
            )
        if not images:
            return list(prompt_ids), []
        images = [check_image(im) for im in images]
        hashes = [image_hash(im) for im in images]
        try:
            out = self.image_processor(images=images, return_tensors="np", **self.processor_kwargs)
        except ValueError as e:  # e.g. Qwen2-VL's resize refuses an aspect ratio above 200
            raise MediaError(f"the model's image processor refused the image: {e}") from None
        per_image = self._split(out, len(images))
        ids: list[int] = []
        features = []
        prev = 0
        for pos, data, digest in zip(positions, per_image, hashes, strict=True):
            ids.extend(prompt_ids[prev:pos])
            length = self.tokens_per_image or (
                int(np.prod(data["image_grid_thw"])) // self.merge_size**2
            )
            features.append(
                MultiModalFeature(
                    "image",
                    digest,
                    offset=len(ids),
                    length=length,
                    data={k: PackedArray.pack(v) for k, v in data.items()},
                )
            )
            ids.extend([self.image_token_id] * length)
            prev = pos + 1
        ids.extend(prompt_ids[prev:])
        return ids, features

    @staticmethod
    def _split(out: Any, num_images: int) -> list[dict[str, np.ndarray]]:
        """The image processor's batch output -> per image arrays (Qwen2-VL concatenates
        the patches of all images, ``image_grid_thw`` says how many are each's; others
        stack one ``[3, S, S]`` crop per image)."""
        if "image_grid_thw" not in out:
            pixels = np.asarray(out["pixel_values"], dtype=np.float32)
            return [{"pixel_values": pixels[i]} for i in range(num_images)]
        grid = np.asarray(out["image_grid_thw"], dtype=np.int64)
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        bounds = np.concatenate([[0], np.cumsum(grid.prod(-1))])
        return [
            {"pixel_values": pixels[bounds[i] : bounds[i + 1]], "image_grid_thw": grid[i]}
            for i in range(num_images)
        ]

"""MultiModalProcessor: a tokenized prompt and its images -> the prompt with each image's
placeholder expanded to the image's token count, and one ``MultiModalFeature`` per image.

Images go through the model's own image processor (transformers' ``AutoImageProcessor``
from the model folder: resizing, normalization, patching). The prompt marks each image with
one placeholder token written by the chat template (``config.image_token_id``; Gemma 3:
``<start_of_image>``); the model's processor rule decides what replaces it (Qwen2-VL: one
image token per 2x2 merged patches; LLaVA: one per patch of the fixed-size crop; Gemma 3:
``mm_tokens_per_image`` soft tokens between ``<start_of_image>`` and ``<end_of_image>``,
see ``gemma3.py``).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from tokenmill.multimodal.embeds import ImageEmbeds, split_embeds
from tokenmill.multimodal.gemma3 import (
    Gemma3ImageTokens,
    gemma3_processor_kwargs,
    gemma3_tokens_per_image,
)
from tokenmill.multimodal.inputs import MultiModalFeature, PackedArray
from tokenmill.multimodal.internvl import InternVLImageTokens, uses_internvl_layout
from tokenmill.multimodal.media import MediaError, check_image
from tokenmill.multimodal.pixtral import PixtralImageTokens, uses_pixtral_layout


def llava_tokens_per_image(hf_config: Any) -> int:
    """Placeholder tokens of one image: the tower's patches, plus its CLS token under the
    ``full`` strategy, minus one under ``default`` (which drops the first position)."""
    vision = hf_config.get("vision_config")
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    has_cls = vision.get("model_type", "clip_vision_model") == "clip_vision_model"
    strategy = hf_config.get("vision_feature_select_strategy", "default")
    return patches + int(has_cls) - int(strategy == "default")


def fixed_tokens_per_image(hf_config: Any) -> int | None:
    """Placeholder tokens of every image (each crop) for models with a fixed-size crop:
    LLaVA's patches, Gemma 3's ``mm_tokens_per_image``; None where the count follows the
    image's size (Qwen2.5-VL)."""
    arch = (hf_config.get("architectures") or [""])[0]
    if arch == "LlavaForConditionalGeneration" and not uses_pixtral_layout(hf_config):
        return llava_tokens_per_image(hf_config)
    if arch == "Gemma3ForConditionalGeneration":
        return gemma3_tokens_per_image(hf_config)
    return None


def image_hash(image: Any) -> str:
    """sha256 hex digest of an image's mode, size and pixels."""
    h = hashlib.sha256()
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def crop_identifier(digest: str, index: int) -> str:
    """The identifier of an image's ``index``-th encoder input: the image's hash for the
    first (the whole image), a hash of it and the index for further crops (Gemma 3's
    pan-and-scan)."""
    if index == 0:
        return digest
    return hashlib.sha256(f"{digest}:crop:{index}".encode()).hexdigest()


class MultiModalProcessor:
    """Expands image placeholders and runs the model's image processor (thread-safe).

    Args:
        model: the model folder (its ``preprocessor_config.json``).
        hf_config: the model's config (``image_token_id``, ``vision_config``).
        limit_per_prompt: modality -> most items per prompt.
        processor_kwargs: keyword arguments of every image processor call
            (``--mm-processor-kwargs``).
        tokenizer: the model's tokenizer (Gemma 3 tokenizes the text around its images);
            None: loaded from ``model`` when needed.

    Attributes:
        placeholder_token_id: the token that marks an image in a prompt, once per image.
        image_token_id: the token the image's embeddings replace (the features cover runs
            of it); the same as ``placeholder_token_id`` but for Gemma 3.
    """

    def __init__(
        self,
        model: str,
        hf_config: Any,
        limit_per_prompt: dict[str, int],
        processor_kwargs: dict[str, Any] | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.model = model
        self.processor_kwargs = dict(processor_kwargs or {})
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        token = hf_config.get("image_token_id", hf_config.get("image_token_index"))
        self.image_token_id = int(token)
        self.placeholder_token_id = self.image_token_id
        vision = hf_config.get("vision_config") or {}
        self.merge_size = int(vision.get("spatial_merge_size", 1))
        # The width of an image's encoder output (given embeddings must match): the
        # language model's, and Qwen3-VL's DeepStack features after it.
        deepstack = len(vision.get("deepstack_visual_indexes") or ())
        self.embed_dim = int(hf_config.get("hidden_size", 0)) * (1 + deepstack)
        # Fixed-size models (LLaVA, Gemma 3): placeholders per crop and the crop the tower
        # takes; None: from the patch grid, whose patches the tower takes flattened.
        self.tokens_per_image = fixed_tokens_per_image(hf_config)
        self.pixel_shape: tuple[int, ...] | None = None
        arch = (hf_config.get("architectures") or [""])[0]
        # Gemma 3: the text its processor writes around each image (None for the others).
        self.gemma3: Gemma3ImageTokens | None = None
        if arch == "Gemma3ForConditionalGeneration":
            self.gemma3 = Gemma3ImageTokens(hf_config, self.tokenizer)
            self.image_token_id = self.gemma3.image_token_id
            self.placeholder_token_id = self.gemma3.boi_token_id
        # Mistral 3 / Pixtral-12B (row breaks), InternVL (tiles between <img> and </img>):
        # the encoder input, its check and its tokens (None for the others).
        self.layout: PixtralImageTokens | InternVLImageTokens | None = None
        if uses_pixtral_layout(hf_config):
            self.layout = PixtralImageTokens(hf_config, self.tokenizer())
        elif uses_internvl_layout(hf_config):
            self.layout = InternVLImageTokens(hf_config, self.tokenizer())
        if self.tokens_per_image is not None:
            size = int(vision["image_size"])
            self.pixel_shape = (int(vision.get("num_channels", 3)), size, size)
        channels = vision.get("in_channels", vision.get("in_chans", 3))
        patch = vision.get("patch_size", 14)
        patch = int(patch[0] if isinstance(patch, list | tuple) else patch)  # InternViT: [p, p]
        self.patch_dim = int(channels) * int(vision.get("temporal_patch_size", 2)) * patch * patch
        self.limit_per_prompt = limit_per_prompt
        # What each image processor call takes (``processor_kwargs`` and model defaults).
        self.call_kwargs = self.processor_kwargs
        self._image_processor: Any = None

    @property
    def feature_token_ids(self) -> frozenset[int]:
        """The tokens an image's placeholder range holds: the image token, and Mistral 3's
        row breaks, whose embeddings the model writes with the image's."""
        ids = {self.image_token_id}
        if isinstance(self.layout, PixtralImageTokens):
            ids |= {self.layout.break_token_id, self.layout.end_token_id}
        return frozenset(ids)

    def preload(self) -> None:
        """Load the image processor in a background thread (the first image then does not
        wait seconds for transformers' imports)."""
        threading.Thread(target=lambda: self.image_processor, daemon=True).start()

    @property
    def image_processor(self) -> Any:
        with self._lock:  # loaded once, on first use (start-up stays fast)
            if self._image_processor is None:
                from transformers import AutoImageProcessor

                processor = AutoImageProcessor.from_pretrained(self.model)
                if self.gemma3 is not None:
                    self.call_kwargs = gemma3_processor_kwargs(processor, self.processor_kwargs)
                if self.layout is not None:
                    self.call_kwargs = self.layout.processor_kwargs(self.processor_kwargs)
                self._image_processor = processor
            return self._image_processor

    def tokenizer(self) -> Any:
        """The model's tokenizer (loaded from the model folder on first use if none was
        given)."""
        with self._lock:
            if self._tokenizer is None:
                from tokenmill.tokenizer import get_tokenizer

                self._tokenizer = get_tokenizer(self.model)
            return self._tokenizer

    def process(
        self,
        prompt_ids: list[int],
        images: list[Any],
        max_len: int | None = None,
        load: Callable[[Any], Any] | None = None,
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Expand the prompt's image placeholders and process its images, one at a time:
        only one decoded image is held at once.

        Args:
            prompt_ids: the prompt, one placeholder token per image, in image order.
            images: ``PIL.Image.Image`` objects, or what ``load`` turns into them.
            max_len: the context length: processing stops once the expanded prompt
                reaches it (None: no bound).
            load: called on each item of ``images`` just before it is processed (e.g. to
                decode an image URL).

        Returns:
            ``(prompt ids with placeholders expanded, one feature per image)``; Gemma 3
            with pan-and-scan: one per image and one per crop of it, in prompt order.

        Raises:
            MediaError: more images than ``limit_per_prompt``, a count of placeholder
                tokens other than the count of images, image tokens in a prompt whose
                placeholder is another token, an image past the pixel bound, or a prompt
                that reaches ``max_len``; ``load``'s errors pass through.
        """
        limit = self.limit_per_prompt.get("image", 0)
        if len(images) > limit:
            raise MediaError(
                f"at most {limit} image(s) may be provided in one prompt, got {len(images)} "
                "(--limit-mm-per-prompt)"
            )
        positions = [i for i, t in enumerate(prompt_ids) if t == self.placeholder_token_id]
        if len(positions) != len(images):
            raise MediaError(
                f"the prompt has {len(positions)} image placeholder(s) for {len(images)} "
                "image(s)"
            )
        if not images:
            return list(prompt_ids), []
        if self.placeholder_token_id != self.image_token_id and self.image_token_id in prompt_ids:
            raise MediaError(
                f"the prompt holds image tokens (id {self.image_token_id}) of its own; mark "
                f"each image with its placeholder token (id {self.placeholder_token_id}) only"
            )
        ids: list[int] = []
        features: list[MultiModalFeature] = []
        prev = 0
        self._check_length(len(prompt_ids), 0, len(images), max_len)  # a token per image
        for n, (pos, item) in enumerate(zip(positions, images, strict=True)):
            if isinstance(item, ImageEmbeds):
                digest, inputs = item.digest(), [self._embeds_input(item)]
            else:
                image = check_image(load(item) if load is not None else item)
                digest = image_hash(image)
                inputs = self.encoder_inputs(image)
                del image
            tokens, runs = self._replacement(inputs)
            if isinstance(item, ImageEmbeds) and runs[0][1] != item.embeds.shape[0]:
                raise MediaError(
                    f"image {n} has {item.embeds.shape[0]} embedding rows where the model "
                    f"takes {runs[0][1]}"
                )
            self._append(ids, prompt_ids[prev:pos])
            self._append(ids, tokens)
            base = len(ids) - len(tokens)  # the tokens after a junction keep their places
            for k, ((start, length), data) in enumerate(zip(runs, inputs, strict=True)):
                features.append(
                    MultiModalFeature(
                        "image",
                        crop_identifier(digest, k),
                        offset=base + start,
                        length=length,
                        data={key: PackedArray.pack(v) for key, v in data.items()},
                    )
                )
            prev = pos + 1
            self._check_length(len(ids) + len(prompt_ids) - prev, n + 1, len(images), max_len)
        self._append(ids, prompt_ids[prev:])
        return ids, features

    def split_embeds(self, value: Any) -> list[ImageEmbeds]:
        """``multi_modal_data["image"]`` embeddings -> one ``ImageEmbeds`` per image
        (``multimodal/embeds.py``).

        Raises:
            MediaError: a form the model does not take.
        """
        return split_embeds(value, self.merge_size)

    def _embeds_input(self, item: ImageEmbeds) -> dict[str, np.ndarray]:
        """The encoder-cache entry of given embeddings, checked against the model."""
        if self.layout is not None or self.gemma3 is not None:
            raise MediaError("this model takes images, not image embeddings")
        if (item.grid_thw is None) != (self.tokens_per_image is not None):
            form = ("a [F, D] tensor per image" if self.tokens_per_image is not None
                    else "{'image_embeds': ..., 'image_grid_thw': ...}")  # fmt: skip
            raise MediaError(f"this model takes image embeddings as {form}")
        if item.embeds.shape[1] != self.embed_dim:
            raise MediaError(f"image embeddings of width {item.embeds.shape[1]}; the model "
                             f"takes {self.embed_dim}")  # fmt: skip
        return item.encoder_input()

    def encoder_inputs(self, image: Any) -> list[dict[str, np.ndarray]]:
        """Run the image processor on one RGB image: the vision encoder's inputs, one
        dict of arrays per encoder call (an image, or each of its crops).

        Raises:
            MediaError: the processor refuses the image, or its output is not what the
                vision tower takes.
        """
        processor = self.image_processor
        try:
            out = processor(images=[image], return_tensors="np", **self.call_kwargs)
        except Exception as e:  # e.g. Qwen2-VL's resize refuses an aspect ratio above 200
            # Whatever the processor raises on one image (settings that pass the start-up
            # check may fail on another shape) refuses that image, not the server.
            raise MediaError(
                f"the model's image processor refused the image: {type(e).__name__}: {e}"
            ) from None
        inputs = [self.layout.encoder_input(out)] if self.layout else self._split(out)
        for data in inputs:
            self._check_encoder_input(data)
        return inputs

    def _replacement(
        self, inputs: list[dict[str, np.ndarray]]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids that replace an image's placeholder and the ``(start, length)`` of the
        image token run of each of its encoder inputs in them."""
        if self.gemma3 is not None:
            return self.gemma3.replacement(len(inputs) - 1)
        [data] = inputs
        if self.layout is not None:
            return self.layout.replacement(data)
        length = self.tokens_per_image or (
            int(np.prod(data["image_grid_thw"])) // self.merge_size**2
        )
        return [self.image_token_id] * length, [(0, length)]

    def _append(self, ids: list[int], more: list[int]) -> None:
        """``ids.extend(more)``; Gemma 3 tokenizes the newlines that meet again together."""
        if self.gemma3 is not None:
            self.gemma3.append(ids, more)
        else:
            ids.extend(more)

    def _check_encoder_input(self, data: dict[str, np.ndarray]) -> None:
        """Raise unless the processed image is what the vision tower takes: processor
        arguments (--mm-processor-kwargs) can change the crop or the patch size, and the
        encoder would fail on the image in the engine."""
        shape = list(data["pixel_values"].shape)
        if self.layout is not None:
            takes = self.layout.check(data)
            ok = takes is None
        elif "image_grid_thw" in data:
            t, h, w = (int(x) for x in data["image_grid_thw"])
            m = self.merge_size
            takes = f"{[t * h * w, self.patch_dim]} (a patch grid whose sides divide by {m})"
            ok = shape == [t * h * w, self.patch_dim] and h % m == w % m == 0
        else:
            takes = str(list(self.pixel_shape or ()))
            ok = self.pixel_shape is None or shape == list(self.pixel_shape)
        if not ok:
            raise MediaError(
                f"the model's image processor made pixel values of shape {shape} from the "
                f"image, where the vision tower takes {takes}; check --mm-processor-kwargs"
            )

    @staticmethod
    def _check_length(num_tokens: int, done: int, num_images: int, max_len: int | None) -> None:
        """Raise once the prompt, ``done`` of its images expanded (the others one token
        each), leaves no room for a completion."""
        if max_len is not None and num_tokens >= max_len:
            raise MediaError(
                f"the prompt has at least {num_tokens} tokens with {done} of its "
                f"{num_images} image(s) processed, which leaves no room for the completion "
                f"in the model's maximum context length of {max_len} tokens"
            )

    @staticmethod
    def _split(out: Any) -> list[dict[str, np.ndarray]]:
        """The image processor's output for one image -> its encoder inputs: the patches
        and ``image_grid_thw`` (Qwen2-VL), or each ``[3, S, S]`` crop it stacked (LLaVA:
        one; Gemma 3: the image, then its pan-and-scan crops)."""
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        if "image_grid_thw" not in out:
            return [{"pixel_values": crop} for crop in pixels]
        grid = np.asarray(out["image_grid_thw"], dtype=np.int64)
        return [{"pixel_values": pixels, "image_grid_thw": grid[0]}]

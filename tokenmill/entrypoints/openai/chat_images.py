"""Images in chat messages: ``image_url`` content parts (OpenAI's form,
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``), loaded and
processed off the event loop into the prompt's image placeholders and features."""

from __future__ import annotations

import asyncio
from typing import Any

from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.multimodal.inputs import MultiModalFeature
from tokenmill.multimodal.media import MediaError, load_image_url


def image_part_url(part: Any, param: str) -> str:
    """The URL of an ``image_url`` content part.

    Raises:
        OpenAIError: 400 when the part has no ``image_url.url`` string.
    """
    image_url = getattr(part, "image_url", None)
    if isinstance(image_url, str):  # vLLM also accepts the URL itself
        return image_url
    url = image_url.get("url") if isinstance(image_url, dict) else None
    if not isinstance(url, str) or not url:
        raise bad_request(
            "an image_url content part needs 'image_url': {'url': '...'}", f"{param}.image_url"
        )
    return url


def check_model_takes_images(engine: Any, messages: list[Any]) -> None:
    """Refuse image parts for a model that takes no images, before any rendering.

    Raises:
        OpenAIError: 400 naming the first image part.
    """
    if engine.model_config.multimodal_config is not None:
        return
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type == "image_url":
                    raise bad_request(
                        f"The model {engine.model_config.served_model_name} does not take "
                        "images (image_url content parts).",
                        f"messages.{i}.content.{j}.image_url",
                    )


async def attach_images(
    engine: Any, prompt_ids: list[int], images: list[tuple[str, str]]
) -> tuple[list[int], list[MultiModalFeature]]:
    """Load the images (data:, allowed http(s) and file: URLs) and process them with the
    model's processor, in a worker thread.

    Args:
        engine: the AsyncLLM (its input processor and model config).
        prompt_ids: the rendered prompt, one placeholder token per image.
        images: ``(url, request field)`` per image, in prompt order.

    Returns:
        ``(prompt ids with placeholders expanded, one feature per image)``.

    Raises:
        OpenAIError: 400 naming the field of the image that cannot be used, or when the
            model takes no images or more images than ``--limit-mm-per-prompt``.
    """
    processor = engine.input_processor
    mm_config = engine.model_config.multimodal_config
    if mm_config is None:
        raise bad_request(
            f"The model {engine.model_config.served_model_name} does not take images "
            "(image_url content parts).",
            images[0][1],
        )
    limit = mm_config.limit_per_prompt.get("image", 0)
    if len(images) > limit:  # before any image is fetched or decoded
        raise bad_request(
            f"Invalid image input: at most {limit} image(s) may be provided in one prompt, "
            f"got {len(images)} (--limit-mm-per-prompt).",
            "messages",
        )

    def load(image: tuple[str, str]) -> Any:
        url, param = image
        try:
            return load_image_url(
                url, mm_config.allowed_media_domains, mm_config.allowed_local_media_path
            )
        except MediaError as e:
            raise bad_request(f"{param}: {e}", param) from None

    def work() -> tuple[list[int], list[MultiModalFeature]]:
        # Each image is decoded just before it is processed: a prompt of many large
        # images never holds more than one of them decoded.
        return processor.process_multimodal(prompt_ids, {"image": images}, "messages", load)

    return await asyncio.get_running_loop().run_in_executor(None, work)

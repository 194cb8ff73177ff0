"""MultiModalConfig: how many images a prompt may carry and where images may come from."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# Defined apart so that the image layouts (pixtral.py, internvl.py) raise it without a cycle.
from tokenmill.multimodal.errors import MultiModalConfigError as MultiModalConfigError

# Modalities tokenmill serves.
MODALITIES = ("image",)
# Images per prompt when --limit-mm-per-prompt does not say (vLLM's default is 999).
DEFAULT_IMAGE_LIMIT = 999
# The image processor's arguments that each call passes itself (MultiModalProcessor).
SERVER_PROCESSOR_ARGUMENTS = frozenset({"images", "return_tensors"})


@dataclass(frozen=True)
class MultiModalConfig:
    """Set for models with a vision encoder.

    Attributes:
        limit_per_prompt: modality -> most items one prompt may carry.
        allowed_media_domains: host names http(s) image URLs may point at; empty: URLs are
            refused (only ``data:`` URLs and in-memory images are served).
        processor_kwargs: keyword arguments of every image processor call.
        allowed_local_media_path: the folder (resolved, absolute) ``file:`` image URLs may
            read from; None: ``file:`` URLs are refused.
    """

    limit_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 999})
    allowed_media_domains: tuple[str, ...] = ()
    processor_kwargs: dict[str, Any] = field(default_factory=dict)
    allowed_local_media_path: str | None = None


# Models whose image placeholders attend to each other both ways (transformers' Gemma 3
# masks: causal OR same image): an image's placeholders are computed in one step.
BIDIRECTIONAL_IMAGE_ARCHITECTURES = frozenset({"Gemma3ForConditionalGeneration"})

# Checkpoints with a vision encoder whose language model tokenmill serves alone (the vision
# tower is not loaded): text prompts only, image flags refused.
TEXT_ONLY_ARCHITECTURES = {"Llama4ForConditionalGeneration"}


def build_multimodal_config(
    hf_config: Any,
    model: str,
    takes_images: bool,
    limit_mm_per_prompt: str | dict[str, Any] | None,
    allowed_media_domains: list[str] | None,
    mm_processor_kwargs: str | dict[str, Any] | None,
    allowed_local_media_path: str | None = None,
    image_architectures: Sequence[str] = (),
) -> MultiModalConfig | None:
    """The image settings of the model in folder ``model`` from the image flags; None for
    a text-only model (``takes_images``: tokenmill runs the model's vision encoder;
    ``image_architectures``: those it runs, named when refusing another).

    Raises:
        MultiModalConfigError: a checkpoint with a vision encoder tokenmill does not run (it
            is not served as text-only, unless in ``TEXT_ONLY_ARCHITECTURES``), image flags
            for a text-only model, a local media path that is not a folder, or a bad flag
            value (see the parsers).
    """
    local_root = None
    if allowed_local_media_path:  # vLLM's default is "": file URLs refused
        local_root = os.path.realpath(allowed_local_media_path)
        if not os.path.isdir(local_root):
            raise MultiModalConfigError(
                f"--allowed-local-media-path {allowed_local_media_path}: not a folder"
            )
    arch = hf_config.architectures[0]
    if not takes_images:
        if hf_config.get("vision_config") is not None and arch not in TEXT_ONLY_ARCHITECTURES:
            raise MultiModalConfigError(
                f"{arch} has a vision encoder, which tokenmill does not implement for this "
                f"architecture (images are supported for {', '.join(image_architectures)})"
            )
        for flag, value in [("--limit-mm-per-prompt", limit_mm_per_prompt),
                            ("--mm-processor-kwargs", mm_processor_kwargs)]:  # fmt: skip
            if value is not None:
                raise MultiModalConfigError(f"{flag}: {arch} does not take images")
        return None
    limits = parse_limit_mm_per_prompt(limit_mm_per_prompt)
    domains = tuple(d.lower() for d in allowed_media_domains or ())
    kwargs = parse_mm_processor_kwargs(mm_processor_kwargs)
    if kwargs:
        check_processor_kwargs(model, kwargs, hf_config)
    return MultiModalConfig(limits, domains, kwargs, local_root)


def parse_mm_processor_kwargs(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """``'{"max_pixels": 1003520}'`` (or the dict) -> the dict; None -> ``{}``.

    Raises:
        MultiModalConfigError: not a JSON object.
    """
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise MultiModalConfigError(
                f"--mm-processor-kwargs must be a JSON object such as "
                f"'{{\"max_pixels\": 1003520}}': {e}"
            ) from None
    if not isinstance(value, dict):
        raise MultiModalConfigError("--mm-processor-kwargs must be a JSON object")
    own = sorted(set(value) & SERVER_PROCESSOR_ARGUMENTS)
    if own:
        raise MultiModalConfigError(
            f"--mm-processor-kwargs may not hold {', '.join(own)}: set by the server for "
            "each image"
        )
    return dict(value)


def check_processor_kwargs(model: str, kwargs: dict[str, Any], hf_config: Any) -> None:
    """Run the model's image processor with ``kwargs`` on a square and an oblong test
    image, so that a keyword it does not take, or one that makes images the vision tower
    cannot encode (another crop or patch size), is refused at start-up rather than on each
    request.

    Raises:
        MultiModalConfigError: the processor refuses the keywords or their values, or its
            output does not fit the model's vision tower.
    """
    from PIL import Image

    from tokenmill.multimodal.media import MediaError
    from tokenmill.multimodal.processor import MultiModalProcessor

    images = [Image.new("RGB", (64, 64)), Image.new("RGB", (96, 32))]
    try:
        mm = MultiModalProcessor(model, hf_config, {"image": 2}, kwargs)
        mm.image_processor(images=images[:1], return_tensors="np", **mm.call_kwargs)
        for image in images:
            mm.encoder_inputs(image)
    except MediaError as e:  # the vision tower cannot take the output
        raise MultiModalConfigError(f"--mm-processor-kwargs {kwargs}: {e}") from None
    except Exception as e:  # TypeError, ValueError, a strict dataclass check's error...
        raise MultiModalConfigError(
            f"--mm-processor-kwargs: the image processor of {model} refuses {kwargs}: {e}"
        ) from None


def parse_limit_mm_per_prompt(value: str | dict[str, Any] | None) -> dict[str, int]:
    """``'{"image": 4}'`` (or the dict) -> ``{"image": 4}``; None -> the defaults.

    Raises:
        MultiModalConfigError: not a JSON object of modality -> non-negative integer, or an
            unknown modality.
    """
    limits = {"image": DEFAULT_IMAGE_LIMIT}
    if value is None:
        return limits
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise MultiModalConfigError(
                f"--limit-mm-per-prompt must be a JSON object such as '{{\"image\": 4}}': {e}"
            ) from None
    if not isinstance(value, dict):
        raise MultiModalConfigError(
            "--limit-mm-per-prompt must be a JSON object such as '{\"image\": 4}'"
        )
    for modality, limit in value.items():
        if modality not in MODALITIES and limit != 0:  # {"video": 0} is vLLM users' habit
            raise MultiModalConfigError(
                f"--limit-mm-per-prompt: modality {modality!r} is not supported "
                f"(supported: {', '.join(MODALITIES)})"
            )
        if isinstance(limit, dict):  # vLLM's {"image": {"count": 4, ...}} form
            limit = limit.get("count")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise MultiModalConfigError(
                f"--limit-mm-per-prompt: the limit of {modality!r} must be a non-negative "
                f"integer, got {limit!r}"
            )
        if modality in MODALITIES:
            limits[modality] = limit
    return limits

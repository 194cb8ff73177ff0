"""MultiModalConfig: how many images a prompt may carry and where images may come from."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# Modalities tokenmill serves.
MODALITIES = ("image",)
# Images per prompt when --limit-mm-per-prompt does not say (vLLM's default is 999).
DEFAULT_IMAGE_LIMIT = 999


class MultiModalConfigError(ValueError):
    """An invalid --limit-mm-per-prompt or --allowed-media-domains value."""


@dataclass(frozen=True)
class MultiModalConfig:
    """Set for models with a vision encoder.

    Attributes:
        limit_per_prompt: modality -> most items one prompt may carry.
        allowed_media_domains: host names http(s) image URLs may point at; empty: URLs are
            refused (only ``data:`` URLs and in-memory images are served).
    """

    limit_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 999})
    allowed_media_domains: tuple[str, ...] = ()


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

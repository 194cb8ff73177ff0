"""Image embeddings given instead of images (vLLM's ``multi_modal_data`` forms): the vision
encoder's output computed elsewhere, one ``[F, D]`` block per image, which the engine
writes at the image's placeholders without running the tower.

- LLaVA-style models (a fixed number of tokens per image): a tensor ``[F, D]`` (one image)
  or ``[N, F, D]`` (``N`` images), or a list of ``[F, D]`` tensors.
- Qwen2-VL, Qwen2.5-VL and Qwen3-VL: ``{"image_embeds": [sum F, D], "image_grid_thw":
  [N, 3]}``; image ``i`` takes ``t * h * w / m^2`` rows of its patch grid (its M-RoPE
  positions follow the grid). Qwen3-VL's rows hold its DeepStack features after the
  embeddings (``D`` = hidden size times one plus their count).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.multimodal.media import MediaError


@dataclass(frozen=True)
class ImageEmbeds:
    """One image's embeddings: ``embeds [F, D]`` float32 and, for grid models, its patch
    grid ``grid_thw [3]`` int64."""

    embeds: np.ndarray
    grid_thw: np.ndarray | None = None

    def digest(self) -> str:
        """sha256 hex digest of the embeddings (and grid): the encoder-cache key."""
        h = hashlib.sha256(b"embeds")
        h.update(str(self.embeds.shape).encode())
        h.update(np.ascontiguousarray(self.embeds).tobytes())
        if self.grid_thw is not None:
            h.update(np.ascontiguousarray(self.grid_thw).tobytes())
        return h.hexdigest()

    def encoder_input(self) -> dict[str, np.ndarray]:
        data = {"image_embeds": self.embeds}
        if self.grid_thw is not None:
            data["image_grid_thw"] = self.grid_thw
        return data


def _array(value: Any, name: str) -> np.ndarray:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.float32).numpy()
    if isinstance(value, np.ndarray) and value.dtype.kind == "f":
        return value.astype(np.float32)
    raise MediaError(f"{name} must be a float torch tensor or numpy array, got "
                     f"{type(value).__name__}")  # fmt: skip


def is_embeds(item: Any) -> bool:
    """Whether a ``multi_modal_data["image"]`` value holds embeddings rather than images."""
    import torch

    return isinstance(item, torch.Tensor) or (isinstance(item, dict) and "image_embeds" in item)


def split_embeds(value: Any, merge_size: int) -> list[ImageEmbeds]:
    """A ``multi_modal_data["image"]`` value of embeddings (see the module docstring) ->
    one ``ImageEmbeds`` per image (``merge_size``: patches merged per side into a row of a
    grid model's embeddings).

    Raises:
        MediaError: a shape or type the forms above do not allow.
    """
    if isinstance(value, (list, tuple)):
        return [e for item in value for e in split_embeds(item, merge_size)]
    if isinstance(value, dict):
        if set(value) - {"image_embeds", "image_grid_thw"} or "image_grid_thw" not in value:
            raise MediaError("image embeddings as a dict take 'image_embeds' and "
                             "'image_grid_thw' (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)")  # fmt: skip
        embeds = _array(value["image_embeds"], "image_embeds")
        grid = np.asarray(value["image_grid_thw"].tolist() if hasattr(value["image_grid_thw"],
                          "tolist") else value["image_grid_thw"], dtype=np.int64)  # fmt: skip
        grid = grid.reshape(-1, 3) if grid.size % 3 == 0 and grid.size else grid
        if embeds.ndim != 2 or grid.ndim != 2 or grid.shape[1] != 3 or (grid <= 0).any():
            raise MediaError(f"image_embeds must be [rows, D] and image_grid_thw [N, 3] of "
                             f"positive sizes, got {list(embeds.shape)} and "
                             f"{list(grid.shape)}")  # fmt: skip
        if (grid[:, 1:] % merge_size).any():
            # M-RoPE places the rows on the merged grid; the image path refuses such grids
            # too (the processor's output check).
            raise MediaError(f"image_grid_thw's heights and widths must be multiples of the "
                             f"spatial merge size {merge_size}, got {grid.tolist()}")  # fmt: skip
        # Python ints: numpy's int64 product of huge sizes wraps (to 0 rows).
        rows = [int(t) * int(h) * int(w) // merge_size**2 for t, h, w in grid]
        if sum(rows) != embeds.shape[0]:
            raise MediaError(f"image_grid_thw gives {sum(rows)} embedding rows, image_embeds "
                             f"has {embeds.shape[0]}")  # fmt: skip
        starts = np.cumsum([0, *rows])
        return [ImageEmbeds(embeds[a:b], g) for a, b, g in zip(starts[:-1], starts[1:], grid,
                                                               strict=True)]  # fmt: skip
    embeds = _array(value, "an image embedding")
    if embeds.ndim == 2:
        return [ImageEmbeds(embeds)]
    if embeds.ndim == 3:
        return [ImageEmbeds(e) for e in embeds]
    raise MediaError(f"image embeddings must be [F, D] or [N, F, D], got {list(embeds.shape)}")

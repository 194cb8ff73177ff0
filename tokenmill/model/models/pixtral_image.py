"""Images through a Pixtral vision tower (Mistral 3, and LLaVA checkpoints with a Pixtral
tower such as Pixtral-12B): one image at its own size, and its embeddings laid out as the
prompt holds them -- rows of patch embeddings, each closed by the ``[IMG_BREAK]`` token's
embedding, the last by ``[IMG_END]``'s (``multimodal/pixtral.py`` writes those tokens)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn


def pixtral_features(
    tower: nn.Module, data: dict[str, np.ndarray], layers: Sequence[int], dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """The tower's hidden states of ``layers`` (concatenated) for one image:
    ``pixel_values [3, h, w]`` float32, ``image_sizes [2]`` -> ``[(h/p) * (w/p), n * D]``."""
    pixels = torch.from_numpy(np.array(data["pixel_values"]))[None]
    size = [int(x) for x in data["image_sizes"]]
    hidden = tower(pixels.to(device, dtype), image_sizes=[size],
                   output_hidden_states=True).hidden_states  # fmt: skip
    return torch.cat([hidden[i] for i in layers], -1).squeeze(0)


def with_row_breaks(
    patches: torch.Tensor, rows: int, cols: int, special: torch.Tensor
) -> torch.Tensor:
    """``patches [rows * cols, H]`` (row-major) and the ``[IMG_BREAK]``, ``[IMG_END]``
    embeddings ``special [2, H]`` -> ``[rows * (cols + 1), H]``: each row followed by the
    break, the last by the end."""
    ends = special[0].expand(rows, 1, -1).clone()
    ends[-1, 0] = special[1]
    grid = patches.to(special.dtype).view(rows, cols, -1)
    return torch.cat([grid, ends], dim=1).reshape(rows * (cols + 1), -1)

"""Multimodal rotary position embedding (M-RoPE, Qwen2-VL: Wang et al. 2024, sec. 2.1).

Each token has three positions (temporal, height, width). The rotary frequencies are split
into three sections (``mrope_section``, over the half rotary dimension); frequency ``i``
rotates by the position of the section it falls in; or, interleaved (Qwen3-VL), frequency
``i`` takes the height position where ``i % 3 == 1`` and the width position where
``i % 3 == 2`` within the first ``3 * section`` frequencies, the temporal one elsewhere.
Text tokens have three equal
positions, which makes M-RoPE the plain 1-D RoPE of that position: steps without image
tokens pass one position per token and take the plain path (its fused kernels and CUDA
graphs); a step with image tokens sets its three streams first (``set_step_positions``).
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.model.layers.rotary import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE with per-section positions (see the module docstring).

    Args:
        head_dim: size of each head (all of it rotates, NeoX style).
        max_position: positions covered by the table.
        base: RoPE theta.
        mrope_section: frequencies of the temporal, height and width sections; they sum to
            ``head_dim // 2``.
        scaling: the config's ``rope_scaling`` (``rope_type`` default or none).
        max_model_len: the engine's context length.
        interleaved: the sections' frequencies interleave (see the module docstring).

    Raises:
        ValueError: the sections do not cover the half head dimension.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        mrope_section: list[int],
        scaling: dict[str, Any] | None = None,
        max_model_len: int | None = None,
        interleaved: bool = False,
    ) -> None:
        super().__init__(head_dim, head_dim, max_position, base, True, scaling, max_model_len)
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(
                f"mrope_section {mrope_section} must sum to head_dim // 2 = {head_dim // 2}"
            )
        if interleaved:
            stream = torch.zeros(head_dim // 2, dtype=torch.long)
            for axis in (1, 2):
                stream[axis : 3 * mrope_section[axis] : 3] = axis
        else:
            stream = torch.repeat_interleave(
                torch.arange(3), torch.tensor(mrope_section), output_size=head_dim // 2
            )
        # cos | sin columns of the table -> the position stream each takes.
        self.register_buffer("stream_of_column", torch.cat([stream, stream]), persistent=False)
        self._step_cos_sin: torch.Tensor | None = None

    def set_step_positions(self, positions: torch.Tensor | None) -> None:
        """Use the three position streams ``[3, T]`` (int64) for the next forward pass; None
        returns to one position per token."""
        if positions is None:
            self._step_cos_sin = None
            return
        table = self.cos_sin_cache[positions]  # [3, T, rot]
        index = self.stream_of_column.view(1, 1, -1).expand(1, positions.shape[1], -1)
        self._step_cos_sin = table.gather(0, index).squeeze(0)

    # Positions of the three streams, offset by the images: not the context's last.
    rotates_at_context_end = False

    def runs_fused(self, q: torch.Tensor) -> bool:
        return self._step_cos_sin is None and super().runs_fused(q)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = self._step_cos_sin
        if cos_sin is None:
            return super().forward(positions, q, k)
        t = q.shape[0]
        cos, sin = cos_sin[:t].unsqueeze(1).chunk(2, dim=-1)
        q = self._rotate(q.view(t, -1, self.head_dim), cos, sin).view(t, -1)
        k = self._rotate(k.view(t, -1, self.head_dim), cos, sin).view(t, -1)
        return q, k

"""The stacked weights of a layer's experts and how checkpoints fill them.

A MoE layer holds two ``ExpertWeights``: ``w13`` (gate rows then up rows, ``[E, 2I, H]``)
and ``w2`` (``[E, H, I]``), each as plain weights or as MXFP4 (``kernels/moe/mxfp4.py``:
``blocks`` uint8 ``[E, rows, cols / 2]`` and ``scales`` uint8 ``[E, rows, cols / 32]``),
with an optional ``bias [E, rows]``. Checkpoints store them in one of these layouts:

- ``per_expert`` (Mixtral, Qwen3-MoE): one ``[rows, cols]`` tensor per expert and
  projection, loaded with shard ids ``(expert, "gate" | "up" | "down")``.
- ``gate_up_halves`` (Llama 4): the whole layer in one tensor per projection, as
  ``x @ W``: ``gate_up_proj [E, H, 2I]`` (gate columns, then up) and ``down_proj [E, I, H]``.
- ``gate_up_interleaved`` (gpt-oss): like ``gate_up_halves`` but gate and up alternate
  (column ``2j`` is gate ``j``, ``2j + 1`` is up ``j``), with biases ``[E, 2I]`` / ``[E, H]``;
  MXFP4 checkpoints hold ``*_blocks [E, rows, cols / 32, 16]`` and ``*_scales
  [E, rows, cols / 32]`` with rows as in ``nn.Linear`` (gate and up alternating too).

Stacked tensors arrive with shard id None. With tensor parallelism each rank keeps a slice
of every expert's intermediate dimension (``I / tp``), and only rank 0 keeps ``w2``'s bias
(the ranks' outputs are summed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from tokenmill.kernels.moe.mxfp4 import MXFP4_BLOCK
from tokenmill.model.layers.weight_shape import check_shape

CheckpointLayout = Literal["per_expert", "gate_up_halves", "gate_up_interleaved"]
# A parameter's part of the expert weights.
Part = Literal["weight", "blocks", "scales", "bias"]
# E8M0 scales of the dummy weights: 2^-10 .. 2^-8, so values stay below 6 * 2^-8.
DUMMY_SCALE_RANGE = (117, 120)


def _fill_random_mxfp4(param: torch.Tensor, generator: torch.Generator) -> None:
    """Dummy MXFP4 bytes: any FP4 codes for blocks, small E8M0 scales for scales."""
    low, high = (0, 256) if param.expert_part == "blocks" else DUMMY_SCALE_RANGE
    param.data.copy_(torch.randint(low, high, param.shape, generator=generator,
                                   dtype=torch.uint8, device=param.device))  # fmt: skip


class ExpertWeights(nn.Module):
    """One projection of all experts: ``[E, rows, cols]`` as ``weight``, or MXFP4
    ``blocks``/``scales``; optionally ``bias [E, rows]``.

    Every parameter carries ``expert_part`` and ``weight_loader = loader``; MXFP4 ones also
    ``dummy_fill`` (random bytes for ``--load-format dummy``).

    Raises:
        ValueError: MXFP4 with ``cols`` not a multiple of 32.
    """

    def __init__(
        self,
        num_experts: int,
        rows: int,
        cols: int,
        loader: Callable[[nn.Parameter, torch.Tensor, Any], None],
        mxfp4: bool = False,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.mxfp4 = mxfp4
        if mxfp4:
            if cols % MXFP4_BLOCK:
                raise ValueError(f"MXFP4 expert rows of {cols} values are not whole blocks of "
                                 f"{MXFP4_BLOCK}")  # fmt: skip
            self.blocks = self._param(loader, "blocks", (num_experts, rows, cols // 2), torch.uint8)
            self.scales = self._param(
                loader, "scales", (num_experts, rows, cols // MXFP4_BLOCK), torch.uint8
            )
        else:
            self.weight = self._param(loader, "weight", (num_experts, rows, cols))
        self.bias = self._param(loader, "bias", (num_experts, rows)) if bias else None

    @staticmethod
    def _param(loader, part: Part, shape: tuple[int, ...], dtype=None) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        param.weight_loader = loader
        param.expert_part = part
        if dtype == torch.uint8:
            param.dummy_fill = _fill_random_mxfp4
        return param

    @property
    def data(self) -> torch.Tensor:
        """What the kernels multiply by: ``weight``, or MXFP4 ``blocks``."""
        return self.blocks if self.mxfp4 else self.weight

    @property
    def scale(self) -> torch.Tensor | None:
        return self.scales if self.mxfp4 else None


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rows (dim 1) ``g0 u0 g1 u1 ...`` -> ``g0 g1 ... u0 u1 ...``."""
    return torch.cat([x[:, 0::2], x[:, 1::2]], dim=1)


def _flatten_blocks(x: torch.Tensor, part: str) -> torch.Tensor:
    """Checkpoint blocks ``[E, rows, cols / 32, 16]`` -> ``[E, rows, cols / 2]``."""
    return x.reshape(*x.shape[:2], -1) if part == "blocks" and x.dim() == 4 else x


def stacked_w13(loaded: torch.Tensor, part: str, layout: CheckpointLayout) -> torch.Tensor:
    """A whole-layer gate/up checkpoint tensor -> our ``[E, 2I, ...]`` (gate rows, then up).

    Raises:
        ValueError: the layout stores no stacked tensors.
    """
    if layout == "per_expert":
        raise ValueError("per-expert checkpoints load with (expert, part) shard ids")
    if part == "weight":
        loaded = loaded.transpose(1, 2)  # x @ W layout -> rows
    loaded = _flatten_blocks(loaded, part)
    return _deinterleave(loaded) if layout == "gate_up_interleaved" else loaded


def stacked_w2(loaded: torch.Tensor, part: str, layout: CheckpointLayout) -> torch.Tensor:
    """A whole-layer down-projection checkpoint tensor -> our ``[E, H, ...]``."""
    if layout == "per_expert":
        raise ValueError("per-expert checkpoints load with (expert, part) shard ids")
    if part == "weight":
        loaded = loaded.transpose(1, 2)
    return _flatten_blocks(loaded, part)


def narrow_w13(full: torch.Tensor, rank: int, per_rank: int) -> torch.Tensor:
    """This rank's gate and up rows of ``[E, 2I, ...]``: ``[E, 2 * per_rank, ...]``."""
    total = full.shape[1] // 2
    gate = full.narrow(1, rank * per_rank, per_rank)
    up = full.narrow(1, total + rank * per_rank, per_rank)
    return torch.cat([gate, up], dim=1) if per_rank != total else full


def narrow_w2(full: torch.Tensor, part: str, rank: int, per_rank: int) -> torch.Tensor:
    """This rank's columns of ``[E, H, I(...)]`` (packed: ``I / 2`` bytes, ``I / 32``
    scales); the bias whole on rank 0 and zero elsewhere."""
    if part == "bias":
        return full if rank == 0 else torch.zeros_like(full)
    width = {"weight": per_rank, "blocks": per_rank // 2, "scales": per_rank // MXFP4_BLOCK}
    return full.narrow(2, rank * width[part], width[part])


def copy_checked(param: nn.Parameter, loaded: torch.Tensor, what: str) -> None:
    check_shape(f"{getattr(param, '_tm_name', '?')}{what}", param.shape, loaded.shape)
    param.data.copy_(loaded)

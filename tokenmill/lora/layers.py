"""The LoRA wrapper of a linear layer: the base product plus each row's adapter.

Every wrapped layer holds its adapters' weights stacked by slot — ``lora_a [S, P*r, in]``
and ``lora_b [S, P*r, out]`` with ``S = max_loras + 1`` (slot 0 stays zero: no adapter)
and ``P`` the checkpoint projections merged in the layer (3 for q/k/v, 2 for gate/up, else
1), each with a block of ``r = max_lora_rank`` ranks. A merged part's B block covers only
that part's output features, so one shrink and one expand apply all parts at once. The
adapter scale (``alpha / r``, rsLoRA's ``alpha / sqrt(r)``) is folded into B.

The slot of each token of the step comes from ``LoRABatch.token_slots`` (a persistent
buffer the model runner fills, so CUDA graphs read it at a fixed address).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels.device import use_triton
from tokenmill.kernels.lora.sgmv import lora_torch, lora_triton


class LoRABatch:
    """The step's adapter slot per token, shared by the LoRA layers of one model.

    Args:
        token_slots: ``[max_num_batched_tokens]`` int32, persistent; rows past the step's
            tokens hold stale but valid slots (padding rows' outputs are never read).
    """

    def __init__(self, token_slots: torch.Tensor) -> None:
        self.token_slots = token_slots


class LoRALinear(nn.Module):
    """``base(x) + B[s] A[s] x`` per row, ``s`` the row's slot.

    Args:
        base: the linear layer (its weights and product unchanged).
        parts: ``(shard id, first output feature, output features)`` per merged projection,
            in slot-block order (shard ids as the layer's ``weight_loader`` takes them).
        num_slots: ``max_loras + 1``.
        max_rank: ranks per part in a slot.
        dtype: the stacks' dtype.
        batch: where the step's token slots are.
    """

    def __init__(
        self,
        base: nn.Module,
        parts: list[tuple[str | int | None, int, int]],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        batch: LoRABatch,
    ) -> None:
        super().__init__()
        self.base = base
        self.parts = {shard: (i, start, size) for i, (shard, start, size) in enumerate(parts)}
        # Where parts 1.. start when they tile the output in slot-block order (the expand
        # then reads one part's rank block per column tile); otherwise every rank.
        starts = [start for _, start, _ in parts]
        tiled = starts[0] == 0 and all(
            starts[i + 1] == starts[i] + parts[i][2] for i in range(len(parts) - 1)
        )
        self.part_starts = tuple(starts[1:]) if tiled and len(parts) <= 3 else ()
        self.max_rank = max_rank
        self.batch = batch
        device = next(base.parameters()).device
        ranks = len(parts) * max_rank
        in_size, out_size = base.input_size, base.output_size
        self.register_buffer(
            "lora_a", torch.zeros(num_slots, ranks, in_size, dtype=dtype, device=device)
        )
        self.register_buffer(
            "lora_b", torch.zeros(num_slots, ranks, out_size, dtype=dtype, device=device)
        )

    @property
    def input_size(self) -> int:
        return self.base.input_size

    @property
    def output_size(self) -> int:
        return self.base.output_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        a, b = self.lora_a, self.lora_b
        xl = x if x.dtype == a.dtype and x.stride(-1) == 1 else x.to(a.dtype).contiguous()
        slots = self.batch.token_slots[: x.shape[0]]
        if use_triton(x):
            lora_triton(y, xl, a, b, slots, self.part_starts)
        else:
            lora_torch(y, xl, a, b, slots)
        return y

    def forward_gated(self, x: torch.Tensor) -> None:
        """None: the caller applies the gate after the adapters' sum (the fused gated
        product has no LoRA term)."""
        return None

    def set_slot(
        self, slot: int, weights: dict[str | int | None, tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Write an adapter's weights into ``slot`` (other parts zeroed).

        Args:
            slot: 1..max_loras.
            weights: shard id -> ``(A [r, in], B [part out, r])``, B already scaled.
        """
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for shard, (a, b) in weights.items():
            i, start, size = self.parts[shard]
            r0, r = i * self.max_rank, a.shape[0]
            self.lora_a[slot, r0 : r0 + r].copy_(a, non_blocking=True)
            self.lora_b[slot, r0 : r0 + r, start : start + size].copy_(b.T, non_blocking=True)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

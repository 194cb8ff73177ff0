"""The LoRA wrapper of a linear layer: the base product plus each row's adapter.

Every wrapped layer holds its adapters' weights stacked by slot — ``lora_a [S, P*r, in]``
and ``lora_b [S, P*r, out]`` with ``S = max_loras + 1`` (slot 0 stays zero: no adapter)
and ``P`` the checkpoint projections merged in the layer (3 for q/k/v, 2 for gate/up, else
1), each with a block of ``r = max_lora_rank`` ranks. A merged part's B block covers only
that part's output features, so one shrink and one expand apply all parts at once. The
adapter scale (``alpha / r``, rsLoRA's ``alpha / sqrt(r)``) is folded into B.

Under tensor parallelism (Megatron-LM's column/row split) each rank keeps the part of an
adapter its base layer's slice needs, as vLLM does:

- column-parallel (q/k/v, gate/up: output features split): A whole, B this rank's output
  features of each part; the base and the adapter both give this rank's output slice.
- row-parallel (o, down: input features split): A this rank's input features, B whole; the
  adapter's partial product is added before the all-reduce, which sums both.

``--fully-sharded-loras`` shards the rest too (vLLM's ``*WithShardedLoRA`` layers):
column-parallel A keeps this rank's ``r / tp`` ranks of each part and the shrink's
``[T, P*r/tp]`` is all-gathered before the expand; row-parallel B keeps this rank's output
features, the shrink's partial ``[T, r]`` is all-reduced, and the expand writes this rank's
slice of the partial output (the layer's all-reduce then assembles it). Each rank then
holds ``1/tp`` of every adapter, for one more collective per projection, on ``[T, P*r]``
floats.

The slot of each token of the step comes from ``LoRABatch.token_slots`` (a persistent
buffer the model runner fills, so CUDA graphs read it at a fixed address).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.distributed.parallel_state import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from tokenmill.kernels.device import use_triton
from tokenmill.kernels.lora.sgmv import (
    lora_expand_torch,
    lora_expand_triton,
    lora_shrink_torch,
    lora_shrink_triton,
    lora_torch,
    lora_triton,
)
from tokenmill.model.layers.linear import ColumnParallelLinear, RowParallelLinear

# (shard id, first output feature, output features) of a merged part on this rank
Part = tuple[str | int | None, int, int]


class LoRABatch:
    """The step's adapter slot per token, shared by the LoRA layers of one model.

    Args:
        token_slots: ``[max_num_batched_tokens]`` int32, persistent; rows past the step's
            tokens hold stale but valid slots (padding rows' outputs are never read).
    """

    def __init__(self, token_slots: torch.Tensor) -> None:
        self.token_slots = token_slots


class LoRALinear(nn.Module):
    """``base(x) + B[s] A[s] x`` per row, ``s`` the row's slot: one device, or a
    column-parallel base (B sliced to this rank's output features).

    Args:
        base: the linear layer (its weights and product unchanged).
        parts: ``(shard id, first output feature, output features)`` per merged projection
            on this rank, in slot-block order (shard ids as the layer's ``weight_loader``
            takes them).
        num_slots: ``max_loras + 1``.
        max_rank: ranks per part in a slot.
        dtype: the stacks' dtype.
        batch: where the step's token slots are.
    """

    def __init__(
        self,
        base: nn.Module,
        parts: list[Part],
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
        self.tp_rank = getattr(base, "tp_rank", 0)
        self.tp_size = getattr(base, "tp_size", 1)
        self.num_parts = len(parts)
        self.allocate_slots(num_slots, dtype)

    def allocate_slots(self, num_slots: int, dtype: torch.dtype) -> None:
        """(Re)create the zeroed stacks ``lora_a``/``lora_b`` for ``num_slots`` slots on the
        base layer's device (``wrap_lora_layers`` builds layers with none first, to check
        that the slots fit before any is allocated)."""
        device = next(self.base.parameters()).device
        a_ranks, b_ranks, b_out = self._stack_shape(self.num_parts)
        self.register_buffer(
            "lora_a", torch.zeros(num_slots, a_ranks, self.base.input_size, dtype=dtype,
                                  device=device)  # fmt: skip
        )
        self.register_buffer(
            "lora_b", torch.zeros(num_slots, b_ranks, b_out, dtype=dtype, device=device)
        )

    def slot_bytes(self) -> int:
        """Bytes of one slot's A and B stacks on this rank."""
        a_ranks, b_ranks, b_out = self._stack_shape(self.num_parts)
        return (a_ranks * self.base.input_size + b_ranks * b_out) * self.lora_a.element_size()

    def _stack_shape(self, num_parts: int) -> tuple[int, int, int]:
        """``(A's ranks, B's ranks, B's output features)`` of a slot on this rank."""
        ranks = num_parts * self.max_rank
        return ranks, ranks, self.base.output_size

    @property
    def input_size(self) -> int:
        return self.base.input_size

    @property
    def output_size(self) -> int:
        return self.base.output_size

    def checkpoint_shape(self, shard: str | int | None) -> tuple[int, int]:
        """``(output, input)`` features of part ``shard``'s checkpoint projection, unsharded:
        an adapter's ``B [output, r]`` and ``A [r, input]`` must match them."""
        return self.base.checkpoint_shape(shard)

    def shard_weights(
        self, shard: str | int | None, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of an adapter's weights of part ``shard``: B's rows of this
        rank's output features (several runs for a fused part of a merged layer), A's
        columns of its input features. Views where one run suffices.

        Args:
            a: ``A [r, input]`` as in the checkpoint.
            b: ``B [output, r]`` as in the checkpoint.
        """
        slices = self.base.shard_slices(shard)
        rows = [b[s.src_start : None if s.size is None else s.src_start + s.size] for s in slices]
        b = rows[0] if len(rows) == 1 else torch.cat(rows)
        s = slices[0]
        if s.in_start is not None:
            a = a[:, s.in_start : s.in_start + s.in_size]
        return a, b

    def split_fused(
        self, a: torch.Tensor, b: torch.Tensor
    ) -> list[tuple[str | int | None, torch.Tensor, torch.Tensor]]:
        """An adapter of a fused checkpoint projection (Phi-3's ``qkv_proj``: ``A [r, in]``,
        ``B [q + k + v, r]``) as one per merged part: ``(shard, A, B's rows of the part)``,
        whose ``B_p A x`` side by side are ``B A x``. Each part takes ``r`` of its ranks."""
        parts, start = [], 0
        for s in self.base.shard_slices(None):  # the parts in the fused tensor's order
            size = self.base.checkpoint_shape(s.shard_id)[0]
            parts.append((s.shard_id, a, b[start : start + size]))
            start += size
        return parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        self._add_lora(y, x)
        return y

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` in the stacks' dtype with contiguous rows, and the rows' slots."""
        a = self.lora_a
        xl = x if x.dtype == a.dtype and x.stride(-1) == 1 else x.to(a.dtype).contiguous()
        return xl, self.batch.token_slots[: x.shape[0]]

    def _add_lora(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """``y += B[s] A[s] x`` per row, shrink and expand fused (nothing between them)."""
        xl, slots = self._inputs(x)
        if use_triton(x):
            lora_triton(y, xl, self.lora_a, self.lora_b, slots, self.part_starts)
        else:
            lora_torch(y, xl, self.lora_a, self.lora_b, slots)

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
            weights: shard id -> ``(A, B)`` as ``shard_weights`` gives them for this rank,
                B already scaled.
        """
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        a_block = self.lora_a.shape[1] // len(self.parts)
        b_block = self.lora_b.shape[1] // len(self.parts)
        for shard, (a, b) in weights.items():
            i, start, _ = self.parts[shard]
            a0, b0 = i * a_block, i * b_block
            self.lora_a[slot, a0 : a0 + a.shape[0]].copy_(a, non_blocking=True)
            self.lora_b[slot, b0 : b0 + b.shape[1], start : start + b.shape[0]].copy_(
                b.T, non_blocking=True
            )

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()


class RowParallelLoRALinear(LoRALinear):
    """A row-parallel base over several ranks: A sliced to this rank's input features, B
    whole, the adapter's partial product added before the base's all-reduce (and bias)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        y = base.quant_method.apply(base, x)
        self._add_lora(y, x)
        return base.reduce_output(y)


class ShardedColumnLoRALinear(LoRALinear):
    """``--fully-sharded-loras`` on a column-parallel base: A also keeps this rank's block of
    ``r / tp`` ranks of each part; the shrink's ``[T, P*r/tp]`` is all-gathered into
    ``[T, P*r]`` before the expand with this rank's B rows.

    Raises:
        ValueError: ``max_rank`` not divisible by the tensor-parallel size.
    """

    def _stack_shape(self, num_parts: int) -> tuple[int, int, int]:
        if self.max_rank % self.tp_size:
            raise ValueError(
                f"--fully-sharded-loras: --max-lora-rank ({self.max_rank}) must be divisible "
                f"by --tensor-parallel-size ({self.tp_size})"
            )
        ranks = num_parts * self.max_rank
        return ranks // self.tp_size, ranks, self.base.output_size

    def shard_weights(self, shard, a, b):
        a, b = super().shard_weights(shard, a, b)
        block = self.max_rank // self.tp_size
        # An adapter of rank below max_lora_rank: later ranks' blocks are short or empty
        # (their slot rows stay zero).
        return a[self.tp_rank * block : (self.tp_rank + 1) * block], b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        xl, slots = self._inputs(x)
        t = tensor_model_parallel_all_gather(_shrink(xl, self.lora_a, slots))
        # Gathered rank-major ([rank][part][block]); B's rows are part-major ([part][rank]).
        num_rows, parts = t.shape[0], len(self.parts)
        block = self.lora_a.shape[1] // parts
        t = t.view(num_rows, self.tp_size, parts, block).transpose(1, 2).reshape(num_rows, -1)
        _expand(y, t, self.lora_b, slots, self.part_starts)
        return y


class ShardedRowLoRALinear(LoRALinear):
    """``--fully-sharded-loras`` on a row-parallel base: B keeps this rank's output
    features; the shrink's partial ``[T, r]`` is all-reduced, and the expand adds into this
    rank's output slice of the partial product, which the base's all-reduce sums.

    Raises:
        ValueError: output features not divisible by the tensor-parallel size.
    """

    def _stack_shape(self, num_parts: int) -> tuple[int, int, int]:
        out = self.base.output_size
        if out % self.tp_size:
            raise ValueError(
                f"--fully-sharded-loras: {out} output features do not split over "
                f"{self.tp_size} tensor-parallel ranks"
            )
        ranks = num_parts * self.max_rank
        return ranks, ranks, out // self.tp_size

    def shard_weights(self, shard, a, b):
        a, b = super().shard_weights(shard, a, b)
        n = self.lora_b.shape[2]
        return a, b[self.tp_rank * n : (self.tp_rank + 1) * n]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        y = base.quant_method.apply(base, x)
        xl, slots = self._inputs(x)
        t = tensor_model_parallel_all_reduce(_shrink(xl, self.lora_a, slots))
        n = self.lora_b.shape[2]
        _expand(y[:, self.tp_rank * n : (self.tp_rank + 1) * n], t, self.lora_b, slots)
        return base.reduce_output(y)


def _shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return lora_shrink_triton(x, a, slots) if use_triton(x) else lora_shrink_torch(x, a, slots)


def _expand(
    y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
    part_starts: tuple[int, ...] = (),
) -> None:
    if use_triton(y):
        lora_expand_triton(y, t, b, slots, part_starts)
    else:
        lora_expand_torch(y, t, b, slots)


def lora_layer(
    base: nn.Module,
    parts: list[Part],
    num_slots: int,
    max_rank: int,
    dtype: torch.dtype,
    batch: LoRABatch,
    fully_sharded: bool = False,
) -> LoRALinear:
    """The LoRA layer around ``base`` for its tensor-parallel split (arguments as
    ``LoRALinear``'s; ``fully_sharded``: ``--fully-sharded-loras``).

    Raises:
        ValueError: ``fully_sharded`` with ranks or output features the tensor-parallel
            size does not divide.
    """
    if getattr(base, "tp_size", 1) == 1:
        return LoRALinear(base, parts, num_slots, max_rank, dtype, batch)
    if isinstance(base, RowParallelLinear):
        cls = ShardedRowLoRALinear if fully_sharded else RowParallelLoRALinear
    elif isinstance(base, ColumnParallelLinear) and fully_sharded:
        cls = ShardedColumnLoRALinear
    else:
        cls = LoRALinear
    return cls(base, parts, num_slots, max_rank, dtype, batch)

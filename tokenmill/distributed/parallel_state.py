"""Tensor-parallel rank and world size as the model layers see them.

One process per device; a single-device engine is rank 0 of a world of 1. Layers read
these to shard their weights, so the same model code serves any tensor-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _TPState:
    rank: int = 0
    world_size: int = 1


_TP = _TPState()


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def set_tensor_model_parallel(rank: int, world_size: int) -> None:
    """Set this process's tensor-parallel coordinates (before the model is built)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    _TP.rank, _TP.world_size = rank, world_size


def tensor_model_parallel_all_reduce(x):
    """Sum ``x`` over the tensor-parallel group (identity for a world of 1)."""
    if _TP.world_size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x)
    return x

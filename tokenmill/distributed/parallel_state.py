"""This process's place in the parallel layout, and the collectives the model uses.

One process per rank; a single-device engine is rank 0 of a world of 1, where every
collective here is the identity. Ranks are numbered ``pp_rank * tp_size + tp_rank`` (see
``ParallelConfig``). Layers read the coordinates when they are built, so the same model code
serves any layout. Collectives go through ``torch.distributed``: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class _ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    expert_parallel: bool = False
    # The tensor-parallel group of this rank (None: the default group, or a world of 1).
    tp_group: Any = None
    # Global ranks of this rank's tensor-parallel group and of its pipeline.
    tp_ranks: list[int] = field(default_factory=lambda: [0])
    pp_ranks: list[int] = field(default_factory=lambda: [0])
    # all_gather_into_tensor (one buffer) where the backend has it (NCCL); gloo gathers a list.
    gather_into_tensor: bool = False


_STATE = _ParallelState()


def get_tensor_model_parallel_rank() -> int:
    return _STATE.tp_rank


def get_tensor_model_parallel_world_size() -> int:
    return _STATE.tp_size


def get_pipeline_parallel_rank() -> int:
    return _STATE.pp_rank


def get_pipeline_parallel_world_size() -> int:
    return _STATE.pp_size


def is_first_pipeline_stage() -> bool:
    return _STATE.pp_rank == 0


def is_last_pipeline_stage() -> bool:
    return _STATE.pp_rank == _STATE.pp_size - 1


def expert_parallel_enabled() -> bool:
    """Whether MoE layers spread whole experts over the tensor-parallel ranks."""
    return _STATE.expert_parallel and _STATE.tp_size > 1


def set_tensor_model_parallel(rank: int, world_size: int) -> None:
    """Set this process's tensor-parallel coordinates without process groups (single-process
    checks of how layers shard their weights; collectives would then fail)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    _STATE.tp_rank, _STATE.tp_size = rank, world_size


def pipeline_stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``[start, end)`` of the layers pipeline stage ``pp_rank`` holds.

    Layers are split evenly; the remainder goes one each to the stages before the last, which
    also holds the final norm and the LM head (vLLM's split).

    Raises:
        ValueError: fewer layers than stages.
    """
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot be split into {pp_size} pipeline stages")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        sizes[-2 - i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def init_model_parallel(
    rank: int,
    tp_size: int,
    pp_size: int,
    expert_parallel: bool,
    backend: str,
    init_method: str,
) -> None:
    """Join the world of ``tp_size * pp_size`` ranks and make its groups.

    Every rank calls this with the same sizes; each creates every tensor-parallel group in
    the same order (``torch.distributed.new_group`` is collective).

    Args:
        rank: this process's global rank.
        backend: ``nccl`` or ``gloo``.
        init_method: the rendezvous, e.g. ``tcp://10.0.0.1:29500``.
    """
    import torch.distributed as dist

    world_size = tp_size * pp_size
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = None
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks) if pp_size > 1 else dist.group.WORLD
        if stage == pp_rank:
            tp_group = group
    _STATE.tp_rank, _STATE.tp_size = tp_rank, tp_size
    _STATE.pp_rank, _STATE.pp_size = pp_rank, pp_size
    _STATE.expert_parallel = expert_parallel
    _STATE.tp_group = tp_group
    _STATE.tp_ranks = list(range(pp_rank * tp_size, (pp_rank + 1) * tp_size))
    _STATE.pp_ranks = [tp_rank + s * tp_size for s in range(pp_size)]
    _STATE.gather_into_tensor = backend == "nccl"


def destroy_model_parallel() -> None:
    """Leave the process groups and return to a world of 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _STATE.__init__()  # type: ignore[misc]


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group, in place (identity for one rank)."""
    if _STATE.tp_size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=_STATE.tp_group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every tensor-parallel rank's ``x`` along the last dimension, in rank
    order: ``[..., N] -> [..., N * tp]`` (identity for one rank)."""
    if _STATE.tp_size == 1:
        return x
    import torch.distributed as dist

    tp = _STATE.tp_size
    x = x.contiguous()
    if _STATE.gather_into_tensor:
        out = torch.empty((tp, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=_STATE.tp_group)
        parts = list(out.unbind(0))
    else:
        parts = [torch.empty_like(x) for _ in range(tp)]
        dist.all_gather(parts, x, group=_STATE.tp_group)
    return torch.cat(parts, dim=-1)


def broadcast_from_first_tp_rank(x: torch.Tensor) -> torch.Tensor:
    """Overwrite ``x`` on every tensor-parallel rank with the first rank's, in place.

    Sampled tokens go through this: every rank keeps the same batch state even where
    sampling on two ranks could differ (random streams)."""
    if _STATE.tp_size == 1:
        return x
    import torch.distributed as dist

    dist.broadcast(x, src=_STATE.tp_ranks[0], group=_STATE.tp_group)
    return x


def send_to_next_stage(x: torch.Tensor) -> Any:
    """Start sending ``x`` (contiguous) to this rank's peer in the next pipeline stage;
    returns the send's work handle (``wait()`` before ``x`` is written again)."""
    import torch.distributed as dist

    return dist.isend(x, dst=_STATE.pp_ranks[_STATE.pp_rank + 1])


def receive_from_previous_stage(x: torch.Tensor) -> None:
    """Fill ``x`` (contiguous) with what this rank's peer in the previous stage sends."""
    import torch.distributed as dist

    dist.recv(x, src=_STATE.pp_ranks[_STATE.pp_rank - 1])

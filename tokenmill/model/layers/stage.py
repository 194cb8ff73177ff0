"""Pipeline-parallel model building: a rank builds only the modules of its stage.

The modules of other stages are ``PPMissingLayer`` placeholders, so layer indices and
checkpoint names stay those of the whole model and the loader skips those tensors
(``loader.weights.other_stage_prefixes``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from tokenmill.distributed.parallel_state import (
    get_pipeline_parallel_rank,
    get_pipeline_parallel_world_size,
    is_first_pipeline_stage,
    is_last_pipeline_stage,
    pipeline_stage_layers,
)


class PPMissingLayer(nn.Identity):
    """A module another pipeline stage holds: no weights, never called."""


def first_stage(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on the first pipeline stage, a placeholder elsewhere (the embedding)."""
    return build() if is_first_pipeline_stage() else PPMissingLayer()


def last_stage(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on the last pipeline stage, a placeholder elsewhere (the final norm)."""
    return build() if is_last_pipeline_stage() else PPMissingLayer()


def stage_layers(num_layers: int, build: Callable[[int], nn.Module]) -> nn.ModuleList:
    """Layers ``build(i)`` of this rank's pipeline stage, placeholders for the others'."""
    start, end = pipeline_stage_layers(
        num_layers, get_pipeline_parallel_rank(), get_pipeline_parallel_world_size()
    )
    return nn.ModuleList(
        build(i) if start <= i < end else PPMissingLayer() for i in range(num_layers)
    )

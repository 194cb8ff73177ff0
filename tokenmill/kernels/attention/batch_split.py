"""How one step's batch splits between the Triton attention kernels, and the launches its
layers share (``triton_backend.py`` plans each step once, from host fields only)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.kernels.attention.launch import UNIFORM_MAX_PREFILLS
from tokenmill.model.attention.backend import AttentionMetadata


@dataclass
class StepPlan:
    """How one step's batch splits between the two kernels (same for every layer)."""

    num_decodes: int  # leading requests served by the decode kernel
    num_prefills: int  # the rest, served by the varlen kernel
    prefill_start: int  # the first query token of those requests
    prefill_tokens: int  # their query tokens
    prefill_max_seq_len: int  # their longest context
    # Uniform grids: both kernels run over every request, each skipping the other's.
    uniform: bool = False
    workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    launches: dict[tuple, Launches] = field(default_factory=dict)


@dataclass
class Launches:
    """One path's kernel launches (decode or prompt) for one step and one layer shape: the
    grids, and the arguments other than the layer's own tensors and the step's metadata
    tensors. A ``None`` grid is not launched."""

    workspace: tuple[torch.Tensor, torch.Tensor] | None  # split partials; None: one split
    grid: tuple[int, int, int]
    kwargs: dict
    reduce_grid: tuple[int, ...] | None = None
    reduce_kwargs: dict = field(default_factory=dict)
    prefix_grid: tuple[int, int, int] | None = None  # cascade attention's shared prefix
    prefix_kwargs: dict = field(default_factory=dict)


def leading_decodes(metadata: AttentionMetadata) -> int:
    """How many of the batch's first requests are decodes (``query_len == 1``): the
    runner's ``num_decodes`` where it gave one, else read from the host query offsets."""
    if metadata.num_decodes:
        return metadata.num_decodes
    if metadata.max_query_len <= 1:
        return metadata.num_reqs
    q_lens = metadata.query_start_loc_cpu[1 : metadata.num_reqs + 1]
    q_lens = q_lens - metadata.query_start_loc_cpu[: metadata.num_reqs]
    not_decode = torch.nonzero(q_lens != 1)
    return int(not_decode[0, 0]) if len(not_decode) else metadata.num_reqs


def step_plan(metadata: AttentionMetadata) -> StepPlan:
    """The batch split, computed from host fields once per step and kept on ``metadata``."""
    plan = getattr(metadata, "_triton_plan", None)
    if plan is not None:
        return plan
    if metadata.uniform_grids:
        n, tokens = metadata.num_reqs, metadata.num_actual_tokens
        plan = StepPlan(n, min(n, UNIFORM_MAX_PREFILLS), 0, tokens, 0, uniform=True)
        metadata._triton_plan = plan  # type: ignore[attr-defined]
        return plan
    num_decodes = leading_decodes(metadata)
    num_prefills = metadata.num_reqs - num_decodes
    prefill_start = prefill_tokens = prefill_max_seq_len = 0
    if num_prefills:
        qsl = metadata.query_start_loc_cpu
        prefill_start = int(qsl[num_decodes])
        prefill_tokens = int(qsl[metadata.num_reqs]) - prefill_start
        prefill_max_seq_len = int(metadata.seq_lens_cpu[num_decodes : metadata.num_reqs].max())
    plan = StepPlan(num_decodes, num_prefills, prefill_start, prefill_tokens, prefill_max_seq_len)
    metadata._triton_plan = plan  # type: ignore[attr-defined]
    return plan

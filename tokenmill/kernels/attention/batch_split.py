"""How one step's batch splits between the paged-attention kernels, and the launches its
layers share: worked out once per step from host integers (``paged.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from tokenmill.kernels.attention.launch import UNIFORM_MAX_PREFILLS


class PagedBatch(Protocol):
    """What the paged-attention kernels read of a step's batch layout (the fields of
    ``tokenmill.model.attention.backend.AttentionMetadata``, which documents them)."""

    num_actual_tokens: int
    num_reqs: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_decodes: int
    common_prefix_len: int
    uniform_grids: bool
    prefill_range: torch.Tensor | None
    reads_step_kv: bool
    last_key_pos: torch.Tensor | None


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


@dataclass
class BatchSplit:
    """How one step's batch splits between the decode and the prompt kernel (the same for
    every layer), and what the step's layers share: split workspaces and launches by layer
    shape."""

    num_decodes: int  # leading requests served by the decode kernel
    num_prefills: int  # the rest, served by the varlen kernel
    prefill_start: int  # the first query token of those requests
    prefill_tokens: int  # their query tokens
    prefill_max_seq_len: int  # their longest context
    # Uniform grids: both kernels run over every request, each skipping the other's.
    uniform: bool = False
    workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    launches: dict[tuple, Launches] = field(default_factory=dict)


def leading_decodes(batch: PagedBatch) -> int:
    """How many of the batch's first requests are decodes (``query_len == 1``): the
    runner's ``num_decodes`` where it gave one, else read from the host query offsets."""
    if batch.num_decodes:
        return batch.num_decodes
    if batch.max_query_len <= 1:
        return batch.num_reqs
    q_lens = batch.query_start_loc_cpu[1 : batch.num_reqs + 1]
    q_lens = q_lens - batch.query_start_loc_cpu[: batch.num_reqs]
    not_decode = torch.nonzero(q_lens != 1)
    return int(not_decode[0, 0]) if len(not_decode) else batch.num_reqs


def batch_split(batch: PagedBatch) -> BatchSplit:
    """The step's split, from host fields only (uniform grids: from the padded sizes)."""
    if batch.uniform_grids:
        n, tokens = batch.num_reqs, batch.num_actual_tokens
        return BatchSplit(n, min(n, UNIFORM_MAX_PREFILLS), 0, tokens, 0, uniform=True)
    num_decodes = leading_decodes(batch)
    num_prefills = batch.num_reqs - num_decodes
    prefill_start = prefill_tokens = prefill_max_seq_len = 0
    if num_prefills:
        qsl = batch.query_start_loc_cpu
        prefill_start = int(qsl[num_decodes])
        prefill_tokens = int(qsl[batch.num_reqs]) - prefill_start
        prefill_max_seq_len = int(batch.seq_lens_cpu[num_decodes : batch.num_reqs].max())
    return BatchSplit(num_decodes, num_prefills, prefill_start, prefill_tokens, prefill_max_seq_len)

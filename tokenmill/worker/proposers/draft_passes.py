"""A model proposer's passes over persistent device buffers, and the CUDA graphs of its
single-token passes.

Eager and fed from the host, each of a proposer's ``k`` passes (``model_proposer.py``)
copied its inputs to the device one array at a time, and every such copy from pageable
memory waits for the stream: the host stopped after each pass until the device had caught
up, then launched the next pass's few hundred kernels. A small draft model is
launch-bound, so its passes cost their launches ``k`` times over.

Here a step's host inputs go to the device in one staged copy (``StepStaging``) before the
first pass: its tokens, positions, slots, query starts, context lengths and the block-table
rows of its requests, proposing requests first. The ``k - 1`` single-token passes then need
nothing more from the host: each works out its positions, slots and context lengths on the
device from the first single-token position and the block table, takes the previous pass's
argmax as its input (and, for EAGLE, its carried hidden state) and writes its argmax into
the step's draft table, which goes to the host once, after the last pass.

Those ``k - 1`` passes are one function of the first ``P`` rows of the buffers
(``DecodePasses``), captured as one CUDA graph per padded batch size ``P``
(``DraftGraphs``, the model runner's ``WholePassGraphs`` in the runner's graph pool): ``B``
proposing requests replay the graph of the smallest ``P >= B``, rows ``B..P`` inert padding
(first position -1: slot -1, nothing written; context 0, nothing read).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from tokenmill.math_utils import cdiv
from tokenmill.model.attention.backend import AttentionMetadata
from tokenmill.worker.buffer_metadata import BufferMetadata, StagedBuffer
from tokenmill.worker.cuda_graph import WholePassGraphs, default_capture_sizes
from tokenmill.worker.step_staging import DeviceArena, StepStaging


class DraftModel(Protocol):
    """What the passes call on a proposer (``model_proposer.ModelProposer``)."""

    block_size: int
    shifted: bool

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None, metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def greedy_tokens(self, out: torch.Tensor) -> torch.Tensor: ...

# Single-token passes of more requests than this run eagerly: each captured size costs
# ``k - 1`` passes of the draft's activations and logits in the graph pool, and past a few
# hundred requests speculation rarely pays.
MAX_GRAPH_BATCH = 256


class DraftBuffers(BufferMetadata):
    """The passes' persistent device buffers (one arena, staged once per step) and the
    step's draft table.

    Token buffers hold the first pass's tokens, then (rows ``0..P``) the single-token
    passes' first inputs; request buffers hold the first pass's requests, proposing ones
    first, so that the block-table rows of the ``B`` proposing requests are rows ``0..B``
    for both.

    Args:
        max_tokens: the most tokens of a first pass (the step's tokens plus one per request).
        max_reqs: the most requests of a step.
        max_blocks: block-table width (blocks of a ``max_model_len`` request).
        max_model_len: the longest context.
        num_speculative_tokens: k, the columns of the draft table.
        device: where the buffers live.
    """

    def __init__(
        self,
        max_tokens: int,
        max_reqs: int,
        max_blocks: int,
        max_model_len: int,
        num_speculative_tokens: int,
        device: torch.device,
    ) -> None:
        i64, i32 = torch.int64, torch.int32
        arena = DeviceArena(
            [
                ((max_tokens,), i64),  # input ids
                ((max_tokens,), i64),  # positions (single-token passes: the first one's)
                ((max_tokens,), i64),  # slot mapping
                ((max_reqs + 1,), i32),  # query start locations
                ((max_reqs,), i32),  # context lengths
                ((max_reqs, max_blocks), i32),  # block table
            ],
            device,
        )
        bufs = arena.buffers
        self.input_ids, self.positions, self.slot_mapping = (StagedBuffer(t) for t in bufs[:3])
        self.query_start_loc, self.seq_lens = StagedBuffer(bufs[3]), StagedBuffer(bufs[4])
        self.block_table = StagedBuffer(bufs[5], host=False)
        self.max_model_len = max_model_len
        self.max_blocks = max_blocks
        self.max_num_reqs = max_reqs
        self.max_num_tokens = max_tokens
        # Staged per step: four token arrays (ids, positions, slots, hidden-state rows), the
        # request arrays and block-table rows, the rows of the first drafts.
        capacity = 4 * max_tokens * 8 + (3 * max_reqs + 1) * 8 + max_reqs * max_blocks * 4
        self.staging = StepStaging(capacity, arena, device)
        # ``[max_reqs, k]`` int64: the step's drafts, proposing request by request.
        self.drafts = torch.zeros(max_reqs, num_speculative_tokens, dtype=i64, device=device)
        # ``[max_reqs + 1]`` int32 ``0, 1, ...``: the query starts of single-token passes.
        self.arange = torch.arange(max_reqs + 1, dtype=i32, device=device)
        # ``[max_reqs, H]``: a shifted proposer's carried hidden states (``carry_buffer``).
        self.hidden: torch.Tensor | None = None
        self.model: nn.Module | None = None  # ``DecodePasses`` (read by the graphs)

    def carry_buffer(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """``[max_reqs, width]`` of ``dtype``: the single-token passes' first carried hidden
        states (made on first use)."""
        if self.hidden is None:
            self.hidden = torch.zeros(
                self.max_num_reqs, width, dtype=dtype, device=self.drafts.device
            )
        return self.hidden


def single_token_seq_lens(first: np.ndarray, step: int, max_model_len: int) -> np.ndarray:
    """``[P]`` int32 context lengths of single-token pass ``step`` (0-based) of requests whose
    first single-token position is ``first [P]`` (-1: a padding request, context 0).

    Positions past ``max_model_len`` are clamped to its last (their drafts are never used).
    """
    pos = np.minimum(first + step, max_model_len - 1)
    return np.where(first >= 0, pos + 1, 0).astype(np.int32)


class DecodePasses(nn.Module):
    """The ``k - 1`` single-token passes over rows ``0..P`` of a proposer's buffers, as a
    module whose call ``(input_ids [P], first_positions [P], metadata)`` the graphs capture.

    Pass ``j`` (1-based) takes the token at ``first_positions + j - 1`` (row of the previous
    pass's argmax; pass 1 ``input_ids``), computes its slot and context on the device, and
    writes its argmax into column ``j`` of the draft table. Rows whose first position is -1
    are padding: slot -1, context 0.

    Args:
        proposer: whose ``forward`` and ``greedy_tokens`` run.
        buffers: the proposer's buffers.
        num_passes: ``k - 1``.
    """

    def __init__(self, proposer: DraftModel, buffers: DraftBuffers, num_passes: int) -> None:
        super().__init__()
        # Not a submodule: the proposer's layers are not this module's parameters.
        self.__dict__["proposer"] = proposer
        self.buffers = buffers
        self.num_passes = num_passes

    def forward(
        self,
        input_ids: torch.Tensor,
        first_positions: torch.Tensor,
        metadata: AttentionMetadata | list[AttentionMetadata],
    ) -> torch.Tensor:
        """Run the passes over ``P`` rows: ``input_ids [P]`` int64 (the first drafts),
        ``first_positions [P]`` int64 (-1: padding), and one metadata for every pass (a
        captured graph's, planned for any context) or one per pass (eager, with exact host
        context lengths: the CPU backend reads them). Returns the draft table's first ``P``
        rows, ``[P, k]`` int64."""
        proposer, buf = self.proposer, self.buffers
        size = input_ids.shape[0]
        last, bs = buf.max_model_len - 1, proposer.block_size
        valid = first_positions >= 0
        table = buf.block_table.device[:size]
        buf.query_start_loc.device[: size + 1].copy_(buf.arange[: size + 1])
        hidden = buf.hidden[:size] if proposer.shifted else None
        ids = input_ids
        for j in range(self.num_passes):
            raw = first_positions + j
            writes = valid & (raw <= last)
            pos = raw.clamp(0, last)
            block = table.gather(1, (pos // bs).unsqueeze(1)).squeeze(1).to(torch.int64)
            buf.slot_mapping.device[:size].copy_(torch.where(writes, block * bs + pos % bs, -1))
            buf.seq_lens.device[:size].copy_(torch.where(valid, pos + 1, 0))
            md = metadata[j] if isinstance(metadata, list) else metadata
            out, carried = proposer.forward(ids, pos, hidden, md)
            ids = proposer.greedy_tokens(out)
            buf.drafts[:size, j + 1].copy_(ids)
            hidden = carried
        return buf.drafts[:size]


class DraftGraphs(WholePassGraphs):
    """CUDA graphs of a proposer's single-token passes, one per padded batch size.

    Args:
        buffers: the proposer's buffers (their ``model`` a ``DecodePasses``).
        sizes: batch sizes to capture (default: the decode graphs' sizes up to
            ``MAX_GRAPH_BATCH``).
        pool: the model runner's graph pool (no two graphs of a runner replay at once).
    """

    what = "CUDA graphs of the proposer's single-token passes (batch sizes {lo}..{hi})"

    def __init__(
        self,
        buffers: DraftBuffers,
        sizes: list[int] | None = None,
        pool: tuple[int, int] | None = None,
    ) -> None:
        sizes = sizes or default_capture_sizes(buffers.max_num_reqs, MAX_GRAPH_BATCH)
        super().__init__(buffers, sizes, pool)  # type: ignore[arg-type]

    def capture_metadata(self, size: int) -> Any:
        buf = self.runner
        buf.positions.device[:size].fill_(-1)  # every row padding: nothing written
        buf.seq_lens.np[:size] = 0
        return buf.decode_metadata(size)  # type: ignore[attr-defined]


def first_pass_table_width(
    seq_lens: np.ndarray, first: np.ndarray, num_passes: int, block_size: int, max_blocks: int
) -> int:
    """Block-table columns the step's passes read: the first pass's contexts ``seq_lens``
    and the single-token passes' positions from ``first`` on (``num_passes`` of them)."""
    longest = int(seq_lens.max()) if len(seq_lens) else 1
    if num_passes and len(first):
        longest = max(longest, int(first.max()) + num_passes)
    return min(cdiv(longest, block_size), max_blocks)

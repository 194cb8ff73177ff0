"""Attention metadata over the model runner's persistent device buffers, and the inert
padding rows of CUDA-graph batches (``ModelRunner``'s base; the buffers are the runner's)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tokenmill.model.attention.backend import AttentionMetadata


class StagedBuffer:
    """A persistent device tensor (a view of a device arena) and the host array a step
    fills before it is staged (``StepStaging.put_into``).

    Args:
        device: the device tensor, int64 or int32.
        host: keep a host array of the same shape (else an empty one).
    """

    def __init__(self, device: torch.Tensor, host: bool = True) -> None:
        self.device = device
        dtype = {torch.int64: np.int64, torch.int32: np.int32}[device.dtype]
        self.np = np.zeros(tuple(device.shape) if host else (0,), dtype=dtype)


class BufferMetadata:
    """Metadata methods of ``ModelRunner`` (which sets these attributes)."""

    input_ids: Any
    positions: Any
    slot_mapping: Any
    query_start_loc: Any
    seq_lens: Any
    block_table: Any
    max_model_len: int

    def pad_token_inputs(self, num_tokens: int, padded: int) -> None:
        """Make rows ``num_tokens..padded`` of the token buffers inert padding: token 0 at
        position 0 with slot -1 (its K/V is never written)."""
        self.input_ids.device[num_tokens:padded].zero_()
        self.positions.device[num_tokens:padded].zero_()
        self.slot_mapping.device[num_tokens:padded].fill_(-1)

    def pad_decode_batch(self, num_reqs: int, padded: int) -> AttentionMetadata:
        """Fill rows ``num_reqs..padded`` of the device buffers with inert padding requests
        (one token each, slot -1 so nothing is written, context length 0) and return the
        metadata of the padded batch, as a captured CUDA graph sees it (planned for
        contexts up to ``max_model_len``)."""
        self.pad_token_inputs(num_reqs, padded)
        self.seq_lens.device[num_reqs:padded].zero_()
        self.seq_lens.np[num_reqs:padded] = 0  # what ``decode_metadata`` reports
        qsl = self.query_start_loc.device
        torch.arange(num_reqs + 1, padded + 1, out=qsl[num_reqs + 1 : padded + 1])
        return self.decode_metadata(padded)

    def single_request_metadata(self, num_tokens: int, seq_len: int) -> AttentionMetadata:
        """Metadata over the persistent buffers for one request computing the last
        ``num_tokens`` of its ``seq_len`` positions; filling the device buffers is the
        caller's business."""
        qsl = torch.tensor([0, num_tokens], dtype=torch.int32)
        return self.buffer_metadata(
            num_tokens,
            1,
            max_query_len=num_tokens,
            max_seq_len=seq_len,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=torch.tensor([seq_len], dtype=torch.int32),
        )

    def decode_metadata(self, batch_size: int, max_seq_len: int | None = None) -> AttentionMetadata:
        """Metadata over the persistent buffers for a decode batch of ``batch_size``, planned
        for contexts up to ``max_seq_len`` tokens (default ``max_model_len``)."""
        return self.buffer_metadata(
            batch_size,
            batch_size,
            max_query_len=1,
            max_seq_len=max_seq_len or self.max_model_len,
            query_start_loc_cpu=torch.arange(batch_size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.from_numpy(self.seq_lens.np[:batch_size].copy()),
            num_decodes=batch_size,
        )

    def buffer_metadata(self, num_tokens: int, num_reqs: int, **fields) -> AttentionMetadata:
        """``AttentionMetadata`` whose device tensors are views of the persistent buffers:
        the first ``num_reqs`` rows of the request buffers (query starts, context lengths,
        block table) and the first ``num_tokens`` slots; ``fields`` gives the rest."""
        return AttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=num_reqs,
            query_start_loc=self.query_start_loc.device[: num_reqs + 1],
            seq_lens=self.seq_lens.device[:num_reqs],
            block_table=self.block_table.device[:num_reqs],
            slot_mapping=self.slot_mapping.device[:num_tokens],
            **fields,
        )

"""Whole-step CUDA graphs for steps that mix prompt chunks with decodes.

The piecewise graphs (``piecewise_graph.py``) run such a step's attention eagerly between
``L + 1`` captured pieces, because the kernels' grids follow the batch layout; that costs
the GPU a gap at every hand-over, in about half of a paced serving load's steps.

With ``AttentionMetadata.uniform_grids`` the attention kernels size their grids from the
padded batch alone and find each request's work in the device tensors
(``kernels/attention/paged.py``). So the whole forward pass is captured once per
padded token count ``T`` over ``R = min(T, max_num_reqs)`` request rows, and any step of at
most ``T`` tokens with at most the backend's ``uniform_max_prefills`` requests after its
leading decodes replays it: padding requests take one padding token each while there are
some (slot -1, context 0: nothing written or read), then none. Other steps keep the
piecewise graphs, as do steps with cascade attention.
"""

from __future__ import annotations

import torch

from tokenmill.model.attention.backend import AttentionMetadata
from tokenmill.worker.cuda_graph import GraphHost, WholePassGraphs
from tokenmill.worker.piecewise_graph import default_piecewise_sizes


class MixedCUDAGraphRunner(WholePassGraphs):
    """Captures and replays the forward pass of steps of any layout, per padded token count.

    Args:
        runner: the model runner whose buffers the graphs read and write; its attention
            backend must support uniform grids.
        capture_sizes: token counts to capture (default: the piecewise graphs' sizes).
        pool: as for ``PaddedGraphs``.
    """

    what = "whole-step CUDA graphs for mixed batches ({lo}..{hi} tokens)"

    def __init__(
        self,
        runner: GraphHost,
        capture_sizes: list[int] | None = None,
        pool: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(
            runner, capture_sizes or default_piecewise_sizes(runner.max_num_tokens), pool
        )

    def request_rows(self, size: int) -> int:
        """Request rows of the graph of ``size`` tokens (a step has at most one per token)."""
        return min(size, self.runner.max_num_reqs)

    def pad_batch(self, num_tokens: int, num_reqs: int, size: int) -> AttentionMetadata:
        """Pad the step in the runner's buffers to the graph of ``size`` tokens and return
        the metadata that graph is captured with (uniform grids over its request rows).

        Tokens ``num_tokens..size`` become inert padding tokens; requests past ``num_reqs``
        take one of them each while any are left, then none, with a context of 0. The
        device ``prefill_range`` (the requests after the leading decodes, at most the
        backend's ``uniform_max_prefills``) is the step's, as the runner staged it.
        """
        runner = self.runner
        rows = self.request_rows(size)
        runner.pad_token_inputs(num_tokens, size)
        runner.seq_lens.device[num_reqs:rows].zero_()
        ends = runner.query_start_loc.device[num_reqs + 1 : rows + 1]
        torch.arange(num_tokens + 1, num_tokens + 1 + len(ends), out=ends)
        ends.clamp_(max=size)
        return runner.buffer_metadata(
            size,
            rows,
            max_query_len=size,
            max_seq_len=runner.max_model_len,
            # Not read with uniform grids; well-formed for any code that checks shapes.
            query_start_loc_cpu=torch.zeros(rows + 1, dtype=torch.int32),
            seq_lens_cpu=torch.zeros(rows, dtype=torch.int32),
            uniform_grids=True,
            prefill_range=runner.prefill_range.device,
        )

    def capture_metadata(self, size: int) -> AttentionMetadata:
        self.runner.prefill_range.device.zero_()  # no decodes, no prompt requests
        return self.pad_batch(0, 0, size)  # every request a padding request

    def run(self, num_tokens: int, num_reqs: int) -> torch.Tensor:
        """Replay for a step of ``num_tokens`` tokens and ``num_reqs`` requests whose inputs
        (``prefill_range`` included) are in the runner's buffers; returns
        hidden states ``[padded, H]`` (a static buffer; rows past ``num_tokens`` are
        padding)."""
        size = self.padded_size(num_tokens)
        self.pad_batch(num_tokens, num_reqs, size)
        return self.replay(size)

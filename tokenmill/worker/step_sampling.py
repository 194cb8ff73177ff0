"""The model runner's sampling: logits of the step's sampling rows, the sampler's metadata
from the persistent batch, and the copy of sampled tokens to the host (``ModelRunner``'s
base; the attributes it reads are the runner's)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenmill.core.engine_io import LogprobsLists
from tokenmill.distributed.parallel_state import broadcast_from_first_tp_rank
from tokenmill.kernels.quant import int4_cpu
from tokenmill.worker.sampling_metadata import (
    SamplingMetadata,
    SamplingRow,
    build_plain_sampling_metadata,
    build_sampling_metadata,
)
from tokenmill.worker.step_io import StepInputs

if TYPE_CHECKING:
    from tokenmill.worker.input_batch import InputBatch
    from tokenmill.worker.sampler import Sampler


class StepSampling:
    """Sampling methods of ``ModelRunner`` (which sets these attributes)."""

    model: Any
    input_batch: InputBatch
    sampler: Sampler
    device: torch.device
    vocab_size: int
    _copy_stream: Any

    def sample_tokens(
        self,
        inputs: StepInputs,
        hidden: torch.Tensor,
        grammar_bitmasks: Mapping[str, np.ndarray],
    ) -> tuple[list[int], dict[str, LogprobsLists]]:
        """One token for each of the step's sampling requests (``inputs.sample_rows``), and
        the logprobs of those that asked, by request id; the step's one sync."""
        assert self.model is not None
        with int4_cpu.prompt_rows(inputs.sample_prompt_rows):
            logits = self.model.compute_logits(self._sample_hidden(hidden, inputs))
        sample_batch_rows = inputs.batch_rows[inputs.sample_rows]
        metadata = inputs.sampling_metadata or self._sampling_metadata(
            inputs, sample_batch_rows, grammar_bitmasks
        )
        out = self.sampler(logits, metadata)
        broadcast_from_first_tp_rank(out.sampled_token_ids)
        token_ids = out.sampled_token_ids.tolist()  # the step's one sync
        logprobs: dict[str, LogprobsLists] = {}
        if out.logprobs is not None:
            per_row = out.logprobs.to_lists_per_row(metadata.num_logprobs)
            for i, lp in zip(inputs.sample_rows, per_row, strict=False):
                if lp is not None:
                    logprobs[inputs.req_ids[i]] = lp
        return token_ids, logprobs

    def _copy_sampled(self, sampled: torch.Tensor, host: torch.Tensor) -> torch.cuda.Event | None:
        """Start copying ``sampled`` to the pinned ``host`` tensor; returns the event that
        marks its end on CUDA (None elsewhere, where the copy is done on return)."""
        if self.device.type != "cuda":
            host.copy_(sampled)
            return None
        stream = self._copy_stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream())
        sampled.record_stream(stream)  # its memory is not reused before the copy
        with torch.cuda.stream(stream):
            host.copy_(sampled, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return event

    @staticmethod
    def _sample_hidden(hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """The hidden states of the step's sampling tokens: a view when every token samples
        (then each request has one token, and the indices are 0..n-1), else a gather."""
        if len(inputs.sample_rows) == inputs.num_tokens:
            return hidden[: inputs.num_tokens]
        return hidden[inputs.logits_indices]

    def _plain_sampling_metadata(
        self, rows: np.ndarray, to_device: Callable[[np.ndarray], torch.Tensor] | None = None
    ) -> SamplingMetadata:
        """The sampler's metadata for InputBatch ``rows`` that all sample on the plain path
        (temperature/top-k/top-p/min-p only): a numpy gather of per-row parameters, put on
        the device by ``to_device`` (default: a copy per array)."""
        b = self.input_batch
        return build_plain_sampling_metadata(
            b.greedy[rows], b.temperature[rows], b.top_k[rows], b.top_p[rows], b.min_p[rows],
            self.vocab_size, self.device, to_device,
        )  # fmt: skip

    def _sampling_metadata(
        self,
        inputs: StepInputs,
        rows: np.ndarray,
        grammar_bitmasks: Mapping[str, np.ndarray] | None = None,
    ) -> SamplingMetadata:
        """The sampler's metadata: ``_plain_sampling_metadata`` when every row is plain,
        else the general per-row builder (with the grammar bitmasks of requests with
        structured outputs)."""
        b = self.input_batch
        if not b.simple_sampling[rows].all():
            bitmasks = grammar_bitmasks or {}
            sampling_rows = []
            for i in inputs.sample_rows:
                req_id = inputs.req_ids[i]
                s = b.requests[req_id]
                sampling_rows.append(
                    SamplingRow(
                        s.sampling_params,
                        s.prompt_token_ids,
                        s.output_token_ids,
                        bitmasks.get(req_id),
                    )
                )
            return build_sampling_metadata(sampling_rows, self.vocab_size, self.device)
        return self._plain_sampling_metadata(rows)

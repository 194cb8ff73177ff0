"""What one step of the model runner hands on: its prepared inputs (``StepInputs``) and,
under async scheduling, its output still on its way to the host (``AsyncModelRunnerOutput``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.core.engine_io import LogprobsLists
from tokenmill.core.model_runner_output import ModelRunnerOutput
from tokenmill.kernels.quant.int4_cpu import PromptRows
from tokenmill.model.attention.backend import AttentionMetadata
from tokenmill.worker.input_batch import InputBatch
from tokenmill.worker.sampler import compute_prompt_logprobs
from tokenmill.worker.sampling_metadata import SamplingMetadata


@dataclass
class StepInputs:
    """One step's batch, ready for the model.

    Attributes:
        req_ids: scheduled requests in batch order.
        num_tokens: scheduled tokens (the real ones; device buffers may be padded).
        metadata: attention metadata.
        sample_rows: batch indices of the requests that sample a token this step.
        logits_indices: ``[len(sample_rows)]`` int64 on the device: each sampling
            request's last token.
        num_scheduled: ``[num_reqs]`` tokens per request (host).
        num_computed: ``[num_reqs]`` tokens cached before this step (host).
        batch_rows: ``[num_reqs]`` InputBatch rows of the requests (host).
        prompt_rows, sample_prompt_rows: which tokens, and which sampling rows, are prompt
            tokens, for the CPU's quantized products (``int4_cpu.prompt_rows``); None on
            CUDA and where none is.
        sampling_metadata: the sampler's parameters, staged with the step's inputs, when
            every sampling request samples on the plain path; else None (built later).
        failed_requests: requests whose LoRA adapter no longer loads (id -> reason), run
            without it this step and reported in the step's output.
    """

    req_ids: list[str]
    num_tokens: int
    metadata: AttentionMetadata
    sample_rows: list[int]
    logits_indices: torch.Tensor
    num_scheduled: np.ndarray
    num_computed: np.ndarray
    batch_rows: np.ndarray
    sampling_metadata: SamplingMetadata | None = None
    prompt_rows: PromptRows | None = None
    sample_prompt_rows: PromptRows | None = None
    failed_requests: dict[str, str] = field(default_factory=dict)

    @property
    def is_decode_only(self) -> bool:
        return self.metadata.max_query_len == 1


def leading_ones(num_scheduled: np.ndarray) -> int:
    """How many leading requests compute one token (the decode kernel's share)."""
    not_one = np.flatnonzero(num_scheduled != 1)
    return int(not_one[0]) if len(not_one) else len(num_scheduled)


class AsyncModelRunnerOutput:
    """A step whose sampled tokens are still being copied to the host.

    ``get()`` waits for the copy, records the tokens in the worker's batch and returns the
    ModelRunnerOutput. Outputs must be collected in step order.
    """

    def __init__(
        self,
        batch: InputBatch,
        inputs: StepInputs,
        host_tokens: torch.Tensor,
        event: torch.cuda.Event | None,
    ) -> None:
        self.batch = batch
        self.inputs = inputs
        self.host_tokens = host_tokens
        self.event = event

    def get(self) -> ModelRunnerOutput:
        if self.event is not None:
            self.event.synchronize()
        inputs = self.inputs
        token_ids = self.host_tokens.tolist()
        sampled: list[list[int]] = [[] for _ in inputs.req_ids]
        batch = self.batch
        for i, tok in zip(inputs.sample_rows, token_ids, strict=False):
            req_id = inputs.req_ids[i]
            sampled[i] = [tok]
            if req_id in batch.row_of:  # it may have finished or been preempted meanwhile
                batch.append_token(req_id, tok)
        return ModelRunnerOutput(inputs.req_ids, sampled, failed_requests=inputs.failed_requests)


def prompt_logprobs_of_step(
    model: torch.nn.Module | None,
    batch: InputBatch,
    inputs: StepInputs,
    hidden: torch.Tensor,
    device: torch.device,
) -> dict[str, LogprobsLists]:
    """Logprobs of the prompt tokens this step's positions predict (requests that ask),
    from the step's hidden states ``hidden [num_tokens, H]``."""
    result: dict[str, LogprobsLists] = {}
    starts = inputs.metadata.query_start_loc_cpu.tolist()
    for i, req_id in enumerate(inputs.req_ids):
        state = batch.requests[req_id]
        k = state.sampling_params.prompt_logprobs
        # A request resumed after preemption recomputes its prompt; its prompt logprobs
        # were already sent.
        if k is None or state.output_token_ids:
            continue
        first = int(inputs.num_computed[i])
        prompt_len = len(state.prompt_token_ids)
        # Position p predicts prompt token p + 1; the last prompt position predicts output.
        last = min(first + int(inputs.num_scheduled[i]), prompt_len - 1)
        if last <= first:
            continue
        token_idx = torch.arange(starts[i], starts[i] + last - first, device=device)
        logits = model.compute_logits(hidden[token_idx])  # type: ignore[union-attr]
        targets = torch.tensor(state.prompt_token_ids[first + 1 : last + 1], device=device)
        lp = compute_prompt_logprobs(logits, targets, k)
        result[req_id] = lp.to_lists([(0, last - first)], [k])[0]
    return result

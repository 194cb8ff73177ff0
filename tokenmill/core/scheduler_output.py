"""SchedulerOutput: what the scheduler tells the worker to run in one step (core -> worker).

A new request crosses to the worker once, in full (NewRequestData); after that only
what changed crosses (CachedRequestData: new block ids and token counts), plus the ids
of requests that finished. The worker keeps each request's state and applies this diff.

GrammarOutput travels beside it: the token bitmasks of the structured-output requests that
sample in the step, filled by the engine core after the plan is built (the plan itself is
never changed once the scheduler has returned it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.core.kv_offload import KVTransfers
from tokenmill.lora.request import LoRARequest
from tokenmill.multimodal.inputs import MultiModalFeature
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.core.request import Request


@dataclass(frozen=True)
class NewRequestData:
    """A request scheduled for the first time (or again after preemption, in full).

    Attributes:
        req_id: the request id.
        prompt_token_ids: the prompt.
        output_token_ids: tokens already generated (non-empty only when a preempted
            request is resumed: the worker dropped its state at preemption).
        sampling_params: decoding parameters.
        block_ids: the request's KV block ids, in order (one block per ``block_size``
            tokens of context).
        num_computed_tokens: tokens whose KV is already in those blocks (prefix-cache hits).
        mm_features: the prompt's images (None for a text prompt).
        lora_request: the LoRA adapter the request runs with, or None.
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    mm_features: list[MultiModalFeature] | None = None
    lora_request: LoRARequest | None = None

    @classmethod
    def of(cls, request: Request, block_ids: list[int]) -> NewRequestData:
        """The data of ``request`` (its tokens copied) with its KV ``block_ids``."""
        return cls(
            req_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            mm_features=request.mm_features or None,
            lora_request=request.lora_request,
        )


@dataclass(frozen=True)
class CachedRequestData:
    """Requests the worker already holds, scheduled again this step (parallel lists).

    Attributes:
        req_ids: the requests.
        new_block_ids: block ids appended to each request's block table this step.
        num_computed_tokens: tokens with KV cached before this step, per request.
        new_token_ids: request id -> its tokens from ``num_computed_tokens`` on, for the
            requests whose next tokens the scheduler chose rather than the worker's sampler
            (beam search picks a beam's token among its candidates); the worker replaces
            what it sampled by these.
    """

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan.

    Attributes:
        scheduled_new_reqs: requests the worker has not seen (or must rebuild).
        scheduled_cached_reqs: requests the worker holds, scheduled again.
        num_scheduled_tokens: request id -> tokens to compute this step; its iteration
            order is the batch order the worker must use.
        total_num_scheduled_tokens: the sum of ``num_scheduled_tokens`` (<= token budget).
        finished_req_ids: requests that finished or were aborted since the last step,
            or were preempted: the worker drops their state.
        reads_step_kv: a request admitted this step hit a prefix-cache block that another
            request fills in this step, so it reads KV the step itself writes
            (``KVCacheManager.reads_step_kv``); the worker then runs the step with kernels
            that read the KV cache only after the step's KV writes.
        scheduled_encoder_inputs: request id -> indices of its ``mm_features`` whose
            encoder output the worker computes (and caches) this step.
        free_encoder_ids: identifiers of encoder outputs the worker drops from its cache
            (before encoding this step's).
        block_copies: (source, destination) KV block pairs the worker copies before the
            step's forward pass: the block two beams diverge in (copy-on-write).
        kv_transfers: KV blocks moved to and from the offload tiers before the step's
            forward pass (and before ``block_copies``), or None.
        new_token_ids: pipeline parallelism only: request id -> the sampled tokens among
            the request's scheduled tokens this step (from position ``max(num_computed,
            prompt length)`` on). The stages before the last never sample, so they take
            a running request's new tokens from here.
        scheduled_spec_decode_tokens: request id -> the draft tokens it verifies this step
            (speculative decoding): the last of its scheduled tokens, after its last known
            token; requests without drafts are absent.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    reads_step_kv: bool = False
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_ids: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    kv_transfers: KVTransfers | None = None
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def has_worker_work(self) -> bool:
        """Whether the worker must see this output even with no token scheduled: requests
        to drop, or KV blocks to copy."""
        return bool(
            self.total_num_scheduled_tokens
            or self.finished_req_ids
            or self.block_copies
            or self.kv_transfers
        )

    @classmethod
    def make_empty(cls, finished_req_ids: set[str] | None = None) -> SchedulerOutput:
        return cls([], CachedRequestData(), {}, 0, finished_req_ids or set())


@dataclass(frozen=True)
class GrammarOutput:
    """The grammar bitmasks of one step (core -> worker), beside its ``SchedulerOutput``.

    Attributes:
        bitmasks: request id -> ``[ceil(V / 32)]`` int32 bitmask of the tokens its grammar
            allows next (bit ``t % 32`` of word ``t // 32`` for token ``t``), for the
            requests with structured outputs that sample this step. A request with a
            grammar but no bitmask here was given up: it samples unmasked, and the scheduler
            drops that token and aborts it.
    """

    bitmasks: Mapping[str, Any] = field(default_factory=dict)

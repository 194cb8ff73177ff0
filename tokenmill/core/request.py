"""Request: the engine core's state of one sequence being generated.

Torch-free: the scheduler and KV cache manager reason about token counts and block ids only.
"""

from __future__ import annotations

import copy
import enum
import time
from typing import Any

from tokenmill.core.engine_io import EngineCoreRequest, FinishReason
from tokenmill.lora.request import LoRARequest
from tokenmill.multimodal.inputs import MultiModalFeature
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Life cycle: WAITING -> RUNNING (-> PREEMPTED -> RUNNING ...) -> FINISHED_*."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """One sequence: its prompt, the tokens generated so far and how many have KV cached.

    The scheduler's single rule works on two numbers: ``num_tokens`` (prompt + output)
    and ``num_computed_tokens`` (tokens whose KV is in the cache). A step schedules
    tokens so that the second catches up with the first.

    Attributes:
        block_hashes: chained hashes of the request's full blocks (prefix caching),
            kept in step with the tokens by ``KVCacheManager``.
        num_cached_tokens: prompt tokens that were prefix-cache hits when first
            scheduled (-1 until then).
        max_tokens: the output-length cap after clamping to the context length.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        max_model_len: int | None = None,
        mm_features: list[MultiModalFeature] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority
        self.cache_salt = cache_salt
        # The prompt's images (placeholder ranges, content hashes, encoder inputs), by offset.
        self.mm_features = sorted(mm_features or [], key=lambda f: f.offset)
        self.lora_request = lora_request
        # 0: the base model; prefix-cache blocks and adapter slots are keyed by it.
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling: tokens being sampled by steps in flight, not yet appended.
        self.num_output_placeholders = 0
        # Speculative decoding: draft tokens to verify after the known ones (not yet part
        # of the request's tokens; the scheduler counts them in its token budget).
        self.spec_token_ids: list[int] = []
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.max_tokens = sampling_params.max_tokens
        if max_model_len is not None:
            room = max_model_len - self.num_prompt_tokens
            self.max_tokens = room if self.max_tokens is None else min(self.max_tokens, room)
        self.eos_and_stop_ids = sampling_params.all_stop_token_ids
        # Its sampling reads host-side history, so its steps cannot overlap (async mode).
        self.needs_sync_step = sampling_params.uses_full_sampler
        # Structured outputs: its grammar's matcher (grammar_runtime.RequestGrammar),
        # set by the engine core.
        self.grammar: Any = None
        # Timestamps (time.time()) for queue-time and TTFT accounting.
        self.first_scheduled_time: float | None = None
        # Beam search: the request's group (core.beam_group.BeamGroup), set by the scheduler.
        self.beam_group: Any = None
        # A beam forked while running: it holds blocks but the worker has not seen it yet.
        self.unseen_by_worker = False

    @classmethod
    def from_engine_core_request(
        cls, req: EngineCoreRequest, max_model_len: int | None = None
    ) -> Request:
        return cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
            max_model_len=max_model_len,
            mm_features=req.mm_features,
            lora_request=req.lora_request,
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def fork(self, request_id: str) -> Request:
        """A copy under ``request_id`` with the same tokens, computed tokens and block
        hashes (a beam forked from this one; its blocks are ``KVCacheManager.fork``'s)."""
        child = copy.copy(self)
        child.request_id = request_id
        child._output_token_ids = list(self._output_token_ids)
        child._all_token_ids = list(self._all_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.num_output_placeholders = 0
        return child

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )

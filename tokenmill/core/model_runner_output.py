"""ModelRunnerOutput: what the worker returns after one step (worker -> core)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.engine_io import LogprobsLists


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Sampled tokens of one step, in batch order.

    Attributes:
        req_ids: request ids in the order the batch was run.
        sampled_token_ids: per request (same order), the tokens sampled this step;
            empty for a request whose prompt is still being prefilled in chunks.
        logprobs: request id -> logprobs of its sampled tokens, for requests that
            asked for them (``SamplingParams.logprobs``), or that need the sampled
            token's logprob (``best_of > n``).
        prompt_logprobs: request id -> logprobs of the prompt positions computed this
            step, for requests with ``SamplingParams.prompt_logprobs``.
        spec_token_ids: speculative decoding: per request (same order), the draft tokens
            proposed for its next step (empty: none); None without speculative decoding.
            With drafts verified this step, ``sampled_token_ids`` holds the accepted drafts
            and one token of the target's own.
        failed_requests: request id -> why it cannot go on (its LoRA adapter no longer
            loads); the step ran its rows without the adapter, and the core ends it.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    spec_token_ids: list[list[int]] | None = None
    failed_requests: dict[str, str] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        return cls([], [])

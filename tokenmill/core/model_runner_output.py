"""ModelRunnerOutput: what the worker returns after one step (worker -> core)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

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


def merge_stage_outputs(outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    """One step's output from every pipeline stage's, in stage order: the last stage's (its
    tokens) with the failed requests of every stage. Each stage loads its own layers'
    adapters, so one stage may fail a request the last stage ran (the step ran its rows
    there without the adapter): it must end all the same. The last stage's reason wins."""
    failed: dict[str, str] = {}
    for out in outputs:
        failed.update(out.failed_requests)
    last = outputs[-1]
    if len(failed) == len(last.failed_requests):
        return last
    return replace(last, failed_requests=failed)

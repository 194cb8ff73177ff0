"""What the front end measures of requests and engine steps, for logs and metrics.

``FinishedRequestStats`` (one per finished engine request) and ``IterationStats`` (one per
engine step) are what ``OutputProcessor`` hands to the stat loggers (``tokenmill.metrics``,
the dashboard).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.outputs import RequestMetrics


@dataclass
class FinishedRequestStats:
    """Latency figures of one engine request that finished (seconds, token counts).

    The phases follow vLLM's request metrics: queued (arrival -> first scheduled), prefill
    (first scheduled -> first token), decode (first token -> finish) and inference (first
    scheduled -> finish); a phase the request never reached is None.
    """

    request_id: str
    finish_reason: str
    e2e_latency: float  # arrival -> finish
    queue_time: float | None  # arrival -> first scheduled (None if never scheduled)
    num_prompt_tokens: int
    num_generation_tokens: int
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    # mean time between the request's output tokens (decode time / (tokens - 1))
    mean_time_per_output_token: float | None = None
    max_tokens: int | None = None  # the request's max_tokens parameter
    # the user request's n; set on its first engine request only, so each counts once
    params_n: int | None = None


@dataclass
class IterationStats:
    """What one engine step produced, for logs and Prometheus metrics.

    Attributes:
        iteration_timestamp: ``time.time()`` of the step (seconds).
        num_prompt_tokens: prompt tokens of requests whose prefill completed this step
            (they got their first token).
        num_generation_tokens: output tokens produced this step.
        time_to_first_tokens: TTFT (arrival -> first token, seconds) of each request that
            got its first token this step.
        inter_token_latencies: ITL (seconds since the request's previous token) of each
            request that got a later token this step.
        finished_requests: requests that finished this step.
    """

    iteration_timestamp: float
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


def finished_request_stats(
    request_id: str,
    reason: str,
    now: float,
    metrics: RequestMetrics,
    num_prompt_tokens: int,
    num_generation_tokens: int,
    max_tokens: int | None,
    params_n: int | None,
) -> FinishedRequestStats:
    """The figures of a request finishing at ``now`` (seconds), from its timestamps."""
    scheduled, first = metrics.first_scheduled_time, metrics.first_token_time
    decode = None if first is None else now - first
    return FinishedRequestStats(
        request_id=request_id,
        finish_reason=reason,
        e2e_latency=now - metrics.arrival_time,
        queue_time=None if scheduled is None else scheduled - metrics.arrival_time,
        num_prompt_tokens=num_prompt_tokens,
        num_generation_tokens=num_generation_tokens,
        prefill_time=None if scheduled is None or first is None else first - scheduled,
        decode_time=decode,
        inference_time=None if scheduled is None else now - scheduled,
        mean_time_per_output_token=(
            decode / (num_generation_tokens - 1)
            if decode is not None and num_generation_tokens > 1
            else None
        ),
        max_tokens=max_tokens,
        params_n=params_n,
    )

"""What the engine returns to users: RequestOutput, CompletionOutput, Logprob.

The shapes follow vLLM's, so code that reads ``out.outputs[0].text`` keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token at one position.

    Attributes:
        logprob: natural-log probability under the model's raw (unprocessed) distribution.
        rank: 1-based rank of the token in that distribution (1 = most likely).
        decoded_token: the token's text, or None if not detokenized.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the top-k tokens plus the chosen one).
SampleLogprobs = list[dict[int, Logprob]]
# The first prompt token has no logprob (nothing precedes it), hence the None.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    Attributes:
        index: position among the request's ``n`` sequences.
        text: generated text (cumulative, or only the new part for DELTA outputs).
        token_ids: generated token ids (same rule as ``text``).
        cumulative_logprob: sum of the sampled tokens' logprobs, if logprobs were computed.
        logprobs: per-token logprobs if ``SamplingParams.logprobs`` was set.
        finish_reason: None while running, else "stop", "length" or "abort".
        stop_reason: the stop string or stop token id that ended it, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps of one request (seconds, ``time.time()`` clock) for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The output of one request so far.

    Attributes:
        request_id: the id given at submission.
        prompt: the prompt text, if it was given as text.
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: per-prompt-token logprobs if asked for.
        outputs: one CompletionOutput per returned sequence (``n`` of them).
        finished: True once every sequence has finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: timestamps for latency accounting.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclass
class BeamSearchSequence:
    """One beam of a beam search (vLLM's ``BeamSearchSequence``).

    Attributes:
        tokens: the prompt's token ids followed by the beam's generated ones (its EOS token
            included when it ended on one).
        logprobs: per generated token, its logprob entry; empty (not computed) here.
        cum_logprob: the sum of the generated tokens' log-probabilities.
        text: ``tokens`` decoded, prompt and special tokens included (as vLLM's
            ``LLM.beam_search``).
        finish_reason: "stop" (an EOS token) or "length".
        stop_reason: always None (beam search stops on EOS tokens only).
        score: the length-normalised score the beams are ranked by:
            ``cum_logprob / num_generated_tokens ** length_penalty``.
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    """The result of one prompt's beam search: its best beams, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class EmbeddingOutput:
    """The pooled embedding of one input (embedding models)."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """The output of one embedding request."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    extra: dict = field(default_factory=dict)

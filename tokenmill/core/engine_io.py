"""What crosses between the front end (LLM / AsyncLLM) and the EngineCore.

Plain dataclasses that msgspec encodes as they are, so the same types serve in-process
(offline ``LLM``) and across the ZMQ socket to the engine process (``tokenmill serve``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenmill.core.beam_search import FinishedBeam
from tokenmill.lora.request import LoRARequest
from tokenmill.multimodal.inputs import MultiModalFeature
from tokenmill.sampling_params import BeamSearchParams, SamplingParams


class FinishReason(enum.IntEnum):
    """Why a sequence ended. ``str()`` gives the OpenAI API's word for it."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or the context length
    ABORT = 2  # aborted by the client or the engine

    def __str__(self) -> str:
        return self.name.lower()


@dataclass
class EngineCoreRequest:
    """A request as the engine core receives it: already tokenized and validated.

    Attributes:
        request_id: unique among live requests.
        prompt_token_ids: the prompt, as token ids.
        sampling_params: decoding parameters (``n == 1``; the front end fans out ``n > 1``);
            unused by an embedding model's core.
        arrival_time: ``time.time()`` when the front end accepted it (seconds).
        priority: lower runs earlier under ``--scheduling-policy priority``.
        cache_salt: mixed into the first block's hash, so that only requests with the
            same salt share prefix-cache blocks.
        mm_features: the prompt's images, processed, by offset (their placeholder tokens
            are in ``prompt_token_ids``); None for a text prompt.
        beam_search: set for a beam-search request (``sampling_params`` then asks for the
            candidates' logprobs); its one output carries the best beams.
        lora_request: the LoRA adapter to run with (``--enable-lora``), or None.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    mm_features: list[MultiModalFeature] | None = None
    beam_search: BeamSearchParams | None = None
    lora_request: LoRARequest | None = None


@dataclass
class LogprobsLists:
    """Log-probabilities for a run of positions, as plain lists (cheap to send).

    For each position ``i``: ``token_ids[i][0]`` is the chosen (sampled or prompt) token,
    followed by the top-k tokens in descending probability; ``logprobs[i][j]`` is the
    natural-log probability of ``token_ids[i][j]``; ``ranks[i]`` is the 1-based rank of
    the chosen token. The top-k entries have ranks 1..k by construction.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def slice(self, start: int, end: int) -> LogprobsLists:
        return LogprobsLists(
            self.token_ids[start:end], self.logprobs[start:end], self.ranks[start:end]
        )


# The stop reason of a request aborted because its structured-output constraint failed (did
# not compile, or admitted no further token): the rest of the reason is the user's message.
CONSTRAINT_FAILURE_PREFIX = "structured_outputs:"
# The stop reason of a request refused because the grammar compilers were busy with other
# constraints (the server answers 429): the rest of the reason is the user's message.
CONSTRAINT_BUSY_PREFIX = "structured_outputs (busy):"
# The stop reason of a request the engine refused (on arrival: an adapter folder gone since
# it was loaded, beams that cannot fit the KV cache; in a step: its adapter no longer loads;
# the server answers 400): the rest of the reason is the user's message.
REQUEST_REFUSED_PREFIX = "refused:"


@dataclass
class EngineCoreOutput:
    """What one step produced for one request.

    Attributes:
        request_id: the request.
        new_token_ids: tokens generated this step (usually one).
        new_logprobs: logprobs of those tokens if the request asked for them.
        new_prompt_logprobs: logprobs of the prompt positions computed this step.
        finish_reason: set on the last output of a finished request.
        stop_reason: the stop token id that ended it (stop strings are found by the
            front end, which then aborts the request in the core).
        num_cached_tokens: prompt tokens served from the prefix cache.
        pooled: an embedding model's pooled (not yet normalized) vector of the request's
            input, on its one and last output.
        beams: a beam-search request's best hypotheses, best first, on its one output.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    pooled: list[float] | None = None
    beams: list[FinishedBeam] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def refused(cls, request_id: str, reason: str) -> EngineCoreOutput:
        """The last output of a request the engine cannot run (``REQUEST_REFUSED_PREFIX``:
        the server answers it with a 400 and ``reason``)."""
        return cls(
            request_id, [], finish_reason=FinishReason.ABORT,
            stop_reason=f"{REQUEST_REFUSED_PREFIX} {reason}",
        )  # fmt: skip


@dataclass
class SpecDecodingStats:
    """Speculative decoding counters of one or more steps (deltas, as vLLM's).

    Attributes:
        num_spec_tokens: k, the drafts proposed per request and step.
        num_drafts: draft runs verified (one per request and step that verified drafts).
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: of those, tokens the target accepted.
        num_accepted_tokens_per_pos: ``[k]``: drafts accepted at each position (position
            ``i`` is accepted only when every earlier one is).
    """

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        return cls(num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one verified draft of ``num_draft_tokens`` of which the first
        ``num_accepted_tokens`` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def add(self, other: SpecDecodingStats) -> None:
        """Add ``other``'s counters to these (positions beyond these are appended)."""
        self.num_spec_tokens = max(self.num_spec_tokens, other.num_spec_tokens)
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(other.num_accepted_tokens_per_pos) - len(per_pos)))
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[i] += n

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified draft yields on average, the target's own token included
        (vLLM's convention): ``1 + accepted / drafts``; 1 with no drafts."""
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler after a step, for logs and Prometheus metrics.

    Counters (``*_queries``, ``*_hits``, ``num_preemptions``) are deltas since the last
    snapshot, so the front end can add them to monotonic Prometheus counters.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, in [0, 1]
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0
    # requests ended for their structured-output constraint: it failed to compile (or not
    # in time, or the compilers were busy), or one of its token masks took too long
    # (``core/grammar_compilation.py``, ``core/grammar_masks.py``)
    num_constraint_failures: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    mm_cache_queries: int = 0  # images looked up in the encoder cache
    mm_cache_hits: int = 0  # of those, found (not encoded again)
    # KV offload tiers, since the last snapshot: "{tier}_hit_tokens" (tokens of admitted
    # requests found there), "{tier}_store_bytes" / "{tier}_load_bytes" (moved into / out
    # of the tier) and "{tier}_seconds" (spent moving), for tier "host" and "disk".
    kv_offload_stats: dict[str, float] = field(default_factory=dict)
    # speculative decoding's counters (None without speculative decoding)
    spec_decoding_stats: SpecDecodingStats | None = None
    # LoRA adapter name -> requests using it, running and waiting (only with --enable-lora)
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)


@dataclass
class EngineCoreOutputs:
    """All outputs of one engine step, plus stats and request timing events.

    Attributes:
        outputs: one per request that produced tokens or finished this step.
        scheduler_stats: snapshot for metrics (None when stats are off).
        timestamp: ``time.time()`` when the step ended.
        scheduled: ids of requests scheduled for the first time this step, with the
            time (for queue-time metrics).
        engine_error: set when the core failed; the front end fails every live request.
        engine_index: which engine core sent it (its data-parallel rank).
    """

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    first_scheduled: dict[str, float] = field(default_factory=dict)
    engine_error: str | None = None
    engine_index: int = 0

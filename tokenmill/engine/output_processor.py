"""OutputProcessor: EngineCoreOutputs -> RequestOutputs.

Per engine step it detokenizes the new tokens of every request (incrementally), finds stop
strings (the core does not see text: a request stopped here is returned for the caller to
abort in the core), turns logprobs into ``Logprob`` dicts with decoded tokens, gathers the
children of ``n > 1`` / ``best_of`` requests, and records latency statistics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.core.engine_io import EngineCoreOutput, FinishReason
from tokenmill.engine.input_processor import ProcessedRequest
from tokenmill.engine.parallel_sampling import ParentRequest
from tokenmill.engine.request_state import LogprobsProcessor, OutputQueue, RequestState
from tokenmill.engine.request_stats import (  # (FinishedRequestStats: also imported from here)
    FinishedRequestStats,  # noqa: F401
    IterationStats,
    finished_request_stats,
)
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.tokenizer import decode_token_texts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass
class OutputProcessorResult:
    """The result of one ``process_outputs`` call.

    Attributes:
        request_outputs: outputs of requests registered without a queue.
        reqs_to_abort: engine request ids finished here by a stop string; the caller
            aborts them in the core.
        iteration_stats: statistics of the step (None when stats are off).
    """

    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]
    iteration_stats: IterationStats | None


@dataclass
class _ParentState:
    """A parallel-sampling request as the user sees it."""

    parent: ParentRequest
    prompt: str | None
    prompt_token_ids: list[int]
    queue: OutputQueue | None
    metrics: RequestMetrics
    prompt_logprobs: LogprobsProcessor  # child 0's: only it computes prompt logprobs
    num_cached_tokens: int = 0


class OutputProcessor:
    """Turns engine-core outputs into RequestOutputs for every live request.

    Args:
        tokenizer: the model's fast tokenizer.
        log_stats: collect IterationStats each step.
        stream_interval: the smallest chunk of tokens a streamed output carries
            (``SchedulerConfig.stream_interval``).
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, log_stats: bool = True, stream_interval: int = 1
    ) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.stream_interval = stream_interval
        # Aborted requests' stats, reported with the next step's IterationStats.
        self._aborted_stats = IterationStats(iteration_timestamp=0.0) if log_stats else None
        self.request_states: dict[str, RequestState] = {}  # engine request id -> state
        self.parent_states: dict[str, _ParentState] = {}  # user id -> parent
        self._token_texts: dict[int, str] = {}

    def _decode_tokens(self, token_ids: list[int]) -> list[str]:
        """Texts of single tokens, cached (the same top-k tokens recur every step)."""
        cache = self._token_texts
        missing = list({t for t in token_ids if t not in cache})
        if missing:
            cache.update(zip(missing, decode_token_texts(self.tokenizer, missing), strict=True))
        return [cache[t] for t in token_ids]

    # ---- registration -------------------------------------------------------------------

    def add_request(
        self,
        processed: ProcessedRequest,
        params: SamplingParams,
        queue: OutputQueue | None = None,
    ) -> None:
        """Register a request (and its children) before it is submitted to the core.

        Args:
            processed: the InputProcessor's result.
            params: the request's sampling parameters (the user's n, best_of, logprobs,
                output_kind).
            queue: receives the request's outputs; without one they are returned by
                ``process_outputs``.

        Raises:
            ValueError: a request with this id (or one of its children's ids) is live.
        """
        user_id = processed.request_id
        engine_ids = [r.request_id for r in processed.engine_requests]
        if user_id in self.parent_states or any(i in self.request_states for i in engine_ids):
            raise ValueError(f"request id {user_id!r} is already in use by a live request")
        fan_out = len(processed.engine_requests) > 1 or engine_ids[0] != user_id
        parent = ParentRequest(user_id, params) if fan_out else None
        kind = parent.child_output_kind if parent else params.output_kind
        states = []
        for index, req in enumerate(processed.engine_requests):
            state = RequestState(
                request_id=req.request_id,
                index=index,
                parent_id=user_id if parent else None,
                prompt=processed.prompt,
                prompt_token_ids=processed.prompt_token_ids,
                params=req.sampling_params,
                output_kind=kind,
                arrival_time=req.arrival_time,
                queue=queue,
                tokenizer=self.tokenizer,
                decode=self._decode_tokens,
            )
            state.max_tokens = req.sampling_params.max_tokens
            state.params_n = params.n if index == 0 else None
            state.stream_interval = self.stream_interval
            states.append(state)
            self.request_states[req.request_id] = state
        if parent is not None:
            self.parent_states[user_id] = _ParentState(
                parent=parent,
                prompt=processed.prompt,
                prompt_token_ids=processed.prompt_token_ids,
                queue=queue,
                metrics=RequestMetrics(arrival_time=processed.arrival_time),
                prompt_logprobs=states[0].logprobs,
            )

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        """Live user-facing requests (a parallel-sampling request counts once)."""
        singles = sum(1 for s in self.request_states.values() if s.parent_id is None)
        return singles + len(self.parent_states)

    # ---- the step -----------------------------------------------------------------------

    def process_outputs(
        self,
        engine_core_outputs: list[EngineCoreOutput],
        engine_core_timestamp: float | None = None,
        first_scheduled: dict[str, float] | None = None,
    ) -> OutputProcessorResult:
        """Process one engine step's outputs.

        Args:
            engine_core_outputs: the step's per-request outputs (unknown ids, e.g. of
                requests already aborted, are ignored).
            engine_core_timestamp: ``time.time()`` of the step (seconds); now if None.
            first_scheduled: engine request id -> time it was first scheduled
                (``EngineCoreOutputs.first_scheduled``), for queue-time metrics.

        Returns:
            The outputs not delivered to queues, the engine ids to abort, the step's stats.
        """
        now = time.time() if engine_core_timestamp is None else engine_core_timestamp
        stats = IterationStats(iteration_timestamp=now) if self.log_stats else None
        if stats is not None and self._aborted_stats and self._aborted_stats.finished_requests:
            stats.finished_requests.extend(self._aborted_stats.finished_requests)
            self._aborted_stats.finished_requests.clear()
        if first_scheduled:
            self._record_scheduled(first_scheduled)
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        touched: dict[str, _ParentState] = {}
        for output in engine_core_outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue
            if output.beams is not None:
                beam_output = self._beam_search_output(state, output, now, stats)
                self._deliver(beam_output, state.queue, request_outputs)
                continue
            self._record_tokens(state, len(output.new_token_ids), now, stats)
            finish_reason, stop_reason = output.finish_reason, output.stop_reason
            num_before = len(state.detokenizer.token_ids)
            stop_str = state.detokenizer.update(
                output.new_token_ids,
                stop_terminated=finish_reason == FinishReason.STOP,
                finished=finish_reason is not None,
            )
            if stop_str is not None:
                if finish_reason is None:
                    reqs_to_abort.append(state.request_id)
                finish_reason, stop_reason = FinishReason.STOP, stop_str
                kept = len(state.detokenizer.token_ids) - num_before
                if output.new_logprobs is not None and kept < len(output.new_token_ids):
                    output.new_logprobs = output.new_logprobs.slice(0, kept)
            state.logprobs.update(output)
            if output.num_cached_tokens:
                state.num_cached_tokens = output.num_cached_tokens
            completion = state.make_completion(
                finish_reason, stop_reason, has_new_tokens=bool(output.new_token_ids)
            )
            if finish_reason is not None:
                self._finish_state(state, str(finish_reason), now, stats)
            if completion is None:
                continue
            if state.parent_id is None:
                self._deliver(self._single_output(state, completion), state.queue, request_outputs)
            else:
                entry = self.parent_states[state.parent_id]
                entry.parent.add_child_output(completion)
                entry.num_cached_tokens = max(entry.num_cached_tokens, state.num_cached_tokens)
                touched[state.parent_id] = entry
        for user_id, entry in touched.items():
            parent_output = self._parent_output(user_id, entry, now)
            if parent_output is not None:
                self._deliver(parent_output, entry.queue, request_outputs)
        return OutputProcessorResult(request_outputs, reqs_to_abort, stats)

    def _beam_search_output(
        self,
        state: RequestState,
        output: EngineCoreOutput,
        now: float,
        stats: IterationStats | None,
    ) -> RequestOutput:
        """A beam search's one output: its best beams as completions, best first. A beam's
        text leaves out the EOS token that ended it (as vLLM's)."""
        assert output.beams is not None
        completions = []
        for i, beam in enumerate(output.beams):
            token_ids = list(beam.token_ids)
            shown = token_ids[:-1] if beam.finish_reason == "stop" else token_ids
            text = self.tokenizer.decode(shown, skip_special_tokens=state.skip_special_tokens)
            completions.append(
                CompletionOutput(i, text, token_ids, beam.cum_logprob, None, beam.finish_reason)
            )
        self._record_tokens(state, sum(len(c.token_ids) for c in completions), now, stats)
        state.num_cached_tokens = output.num_cached_tokens
        self._finish_state(state, str(output.finish_reason), now, stats)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=None,
            outputs=completions,
            finished=True,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
        )

    def _record_scheduled(self, first_scheduled: dict[str, float]) -> None:
        for request_id, t in first_scheduled.items():
            state = self.request_states.get(request_id)
            if state is None or state.metrics.first_scheduled_time is not None:
                continue
            state.metrics.first_scheduled_time = t
            if state.parent_id is not None:
                parent_metrics = self.parent_states[state.parent_id].metrics
                if parent_metrics.first_scheduled_time is None:
                    parent_metrics.first_scheduled_time = t

    def _record_tokens(
        self, state: RequestState, num_new: int, now: float, stats: IterationStats | None
    ) -> None:
        if num_new == 0:
            return
        metrics = state.metrics
        if stats is not None:
            stats.num_generation_tokens += num_new
            if metrics.first_token_time is None:
                stats.num_prompt_tokens += len(state.prompt_token_ids)
                stats.time_to_first_tokens.append(now - metrics.arrival_time)
            elif metrics.last_token_time is not None:
                stats.inter_token_latencies.append(now - metrics.last_token_time)
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        if state.parent_id is not None:
            parent_metrics = self.parent_states[state.parent_id].metrics
            if parent_metrics.first_token_time is None:
                parent_metrics.first_token_time = now
            parent_metrics.last_token_time = now

    def _finish_state(
        self, state: RequestState, reason: str, now: float, stats: IterationStats | None
    ) -> None:
        self.request_states.pop(state.request_id, None)
        state.metrics.finished_time = now
        if stats is None:
            return
        stats.finished_requests.append(
            finished_request_stats(
                state.request_id,
                reason,
                now,
                state.metrics,
                len(state.prompt_token_ids),
                len(state.token_ids),
                state.max_tokens,
                state.params_n,
            )
        )

    @staticmethod
    def _deliver(
        output: RequestOutput, queue: OutputQueue | None, outputs: list[RequestOutput]
    ) -> None:
        if queue is not None:
            queue.put(output)
        else:
            outputs.append(output)

    def _single_output(self, state: RequestState, completion: CompletionOutput) -> RequestOutput:
        delta = state.output_kind == RequestOutputKind.DELTA
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.logprobs.next_prompt_logprobs(delta),
            outputs=[completion],
            finished=completion.finished(),
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
        )

    def _parent_output(self, user_id: str, entry: _ParentState, now: float) -> RequestOutput | None:
        completions = entry.parent.pop_outputs()
        if completions is None:
            return None
        finished = entry.parent.finished
        if finished:
            entry.metrics.finished_time = now
            self.parent_states.pop(user_id, None)
        delta = entry.parent.params.output_kind == RequestOutputKind.DELTA
        return RequestOutput(
            request_id=user_id,
            prompt=entry.prompt,
            prompt_token_ids=entry.prompt_token_ids,
            prompt_logprobs=entry.prompt_logprobs.next_prompt_logprobs(delta),
            outputs=completions,
            finished=finished,
            num_cached_tokens=entry.num_cached_tokens,
            metrics=entry.metrics,
        )

    # ---- aborts and failures --------------------------------------------------------------

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forget requests the caller aborts; a request with a queue gets a final output.

        The final output (finish_reason "abort") lets a consumer waiting on the queue end.

        Args:
            request_ids: user-facing ids (an engine id of a single request is the same);
                unknown ids are ignored.

        Returns:
            The engine request ids to abort in the core (children included).
        """
        engine_ids: list[str] = []
        now = time.time()
        for request_id in request_ids:
            ids, output, queue = self._abort_one(request_id, now)
            engine_ids.extend(ids)
            if output is not None and queue is not None:
                queue.put(output)
        return engine_ids

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every live request with finish_reason "abort" (the engine has died).

        Args:
            error: why, for the log.

        Returns:
            The final outputs of requests without a queue (queues get theirs).
        """
        user_ids = list(self.parent_states)
        user_ids += [rid for rid, s in self.request_states.items() if s.parent_id is None]
        if user_ids:
            logger.error("engine failed; aborting %d requests: %s", len(user_ids), error)
        outputs: list[RequestOutput] = []
        now = time.time()
        for user_id in user_ids:
            _, output, queue = self._abort_one(user_id, now)
            if output is not None:
                self._deliver(output, queue, outputs)
        return outputs

    def _abort_one(
        self, user_id: str, now: float
    ) -> tuple[list[str], RequestOutput | None, OutputQueue | None]:
        """Finish one user-facing request as aborted: its engine ids, final output, queue."""
        entry = self.parent_states.get(user_id)
        if entry is not None:
            engine_ids = entry.parent.live_child_ids()
            for child_id in engine_ids:
                state = self.request_states.pop(child_id, None)
                if state is not None:
                    entry.parent.add_child_output(self._aborted_completion(state, now))
            output = self._parent_output(user_id, entry, now)
            self.parent_states.pop(user_id, None)  # (already gone: every child has finished)
            return engine_ids, output, entry.queue
        state = self.request_states.get(user_id)
        if state is None or state.parent_id is not None:
            return [], None, None
        del self.request_states[user_id]
        completion = self._aborted_completion(state, now)
        return [user_id], self._single_output(state, completion), state.queue

    def _aborted_completion(self, state: RequestState, now: float) -> CompletionOutput:
        self._finish_state(state, str(FinishReason.ABORT), now, self._aborted_stats)
        completion = state.make_completion(FinishReason.ABORT, None, has_new_tokens=False)
        assert completion is not None  # a finishing sequence always emits
        return completion

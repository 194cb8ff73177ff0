"""One request's state in the OutputProcessor: its incremental detokenizer, its logprobs as
``Logprob`` dicts, and the CompletionOutput each engine step gives it under its output kind
(cumulative, delta in chunks of ``stream_interval`` tokens, or final only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from tokenmill.core.engine_io import EngineCoreOutput, FinishReason, LogprobsLists
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class OutputQueue(Protocol):
    """Where a request's outputs go when the caller consumes them as they come (streaming)."""

    def put(self, output: RequestOutput) -> None: ...


TokenDecoder = Callable[[list[int]], list[str]]


class LogprobsProcessor:
    """Accumulates one sequence's sample and prompt logprobs as ``Logprob`` dicts.

    Args:
        num_logprobs: top-k per output position (None: none; -1: all that are sent).
        num_prompt_logprobs: the same for prompt positions.
        decode: token ids -> their texts (None: no decoded tokens).
    """

    def __init__(
        self, num_logprobs: int | None, num_prompt_logprobs: int | None, decode: TokenDecoder | None
    ) -> None:
        self.num_logprobs = num_logprobs
        self.num_prompt_logprobs = num_prompt_logprobs
        self.decode = decode
        self.logprobs: SampleLogprobs | None = None if num_logprobs is None else []
        self.cumulative_logprob: float | None = None if num_logprobs is None else 0.0
        self.prompt_logprobs: PromptLogprobs | None = None if num_prompt_logprobs is None else []
        self._sent_logprobs = 0
        self._sent_prompt_logprobs = 0

    def update(self, output: EngineCoreOutput) -> None:
        if self.logprobs is not None and output.new_logprobs is not None:
            assert self.num_logprobs is not None and self.cumulative_logprob is not None
            lists = output.new_logprobs
            self.logprobs.extend(self._convert(lists, self.num_logprobs))
            self.cumulative_logprob += sum(row[0] for row in lists.logprobs)
        if self.prompt_logprobs is not None and output.new_prompt_logprobs is not None:
            assert self.num_prompt_logprobs is not None
            if not self.prompt_logprobs:
                # The first prompt token has no logprob: nothing precedes it.
                self.prompt_logprobs.append(None)
            self.prompt_logprobs.extend(
                self._convert(output.new_prompt_logprobs, self.num_prompt_logprobs)
            )

    def _convert(self, lists: LogprobsLists, k: int) -> list[dict[int, Logprob]]:
        """One dict per position: the chosen token (its rank) then the top k (ranks 1..k)."""
        rows = [ids if k < 0 else ids[: k + 1] for ids in lists.token_ids]
        texts: list[str] | None = None
        if self.decode is not None:
            texts = self.decode([t for ids in rows for t in ids])
        result = []
        offset = 0
        for ids, lps, rank in zip(rows, lists.logprobs, lists.ranks, strict=True):
            entry = {ids[0]: Logprob(lps[0], rank, texts[offset] if texts else None)}
            for j in range(1, len(ids)):
                if ids[j] not in entry:
                    entry[ids[j]] = Logprob(lps[j], j, texts[offset + j] if texts else None)
            result.append(entry)
            offset += len(ids)
        return result

    def next_logprobs(self, delta: bool) -> SampleLogprobs | None:
        """All logprobs so far (a copy), or those not returned by an earlier delta call."""
        if self.logprobs is None:
            return None
        if not delta:
            return list(self.logprobs)
        new = self.logprobs[self._sent_logprobs :]
        self._sent_logprobs = len(self.logprobs)
        return new

    def next_prompt_logprobs(self, delta: bool) -> PromptLogprobs | None:
        """All prompt logprobs so far, or (delta) those not returned before (None if none)."""
        if not self.prompt_logprobs:
            return None
        if not delta:
            return list(self.prompt_logprobs)
        new = self.prompt_logprobs[self._sent_prompt_logprobs :]
        self._sent_prompt_logprobs = len(self.prompt_logprobs)
        return new or None


class RequestState:
    """The front end's state of one engine request (a plain request or one child)."""

    def __init__(
        self,
        request_id: str,
        index: int,
        parent_id: str | None,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: RequestOutputKind,
        arrival_time: float,
        queue: OutputQueue | None,
        tokenizer: PreTrainedTokenizerBase,
        decode: TokenDecoder,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.parent_id = parent_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.output_kind = output_kind
        self.queue = queue
        self.detokenize = params.detokenize
        self.skip_special_tokens = params.skip_special_tokens
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        self.logprobs = LogprobsProcessor(
            params.logprobs, params.prompt_logprobs, decode if params.detokenize else None
        )
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        self.max_tokens: int | None = params.max_tokens
        self.params_n: int | None = None  # the user's n, on a request's first state only
        self._sent_tokens = 0
        self.stream_interval = 1

    @property
    def token_ids(self) -> list[int]:
        return self.detokenizer.token_ids

    def make_completion(
        self,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        has_new_tokens: bool,
    ) -> CompletionOutput | None:
        """This step's CompletionOutput under the request's output kind, or None for none.

        DELTA outputs carry the tokens, text and logprobs since the last output, at least
        ``stream_interval`` tokens of them but in the first output and the last. A step
        that adds tokens but no text (text held back for a possible stop string, or an
        incomplete character) still emits an output, with empty text, as vLLM does: a
        stream's first chunk then marks the first token, whatever its text.
        """
        finished = finish_reason is not None
        kind = self.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        if (
            delta
            and not finished
            and self._sent_tokens > 0
            and len(self.token_ids) - self._sent_tokens < self.stream_interval
        ):
            return None  # the tokens (and their text) wait for a full chunk
        text = self.detokenizer.get_next_output_text(finished, delta)
        if delta:
            new_tokens = len(self.token_ids) > self._sent_tokens
            progressed = new_tokens or bool(text)
            if not (finished or progressed):
                return None
            token_ids = self.token_ids[self._sent_tokens :]
            self._sent_tokens = len(self.token_ids)
        else:
            if not (finished or has_new_tokens):
                return None
            token_ids = list(self.token_ids)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.logprobs.cumulative_logprob,
            logprobs=self.logprobs.next_logprobs(delta),
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason,
        )

"""RequestOutputCollector: hands a request's outputs from the output handler to its stream.

If the stream's consumer is slower than the engine (a slow client), DELTA outputs that
pile up are merged into one, so a stream never falls behind by more than one message and
memory stays bounded.
"""

from __future__ import annotations

import asyncio

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import RequestOutputKind


def merge_delta(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Append ``new``'s increments to ``old`` (both DELTA outputs of one request)."""
    by_index = {c.index: c for c in old.outputs}
    for c in new.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            by_index[c.index] = c
            continue
        prev.text += c.text
        prev.token_ids = prev.token_ids + c.token_ids
        if c.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + c.logprobs
        prev.cumulative_logprob = c.cumulative_logprob
        prev.finish_reason = c.finish_reason
        prev.stop_reason = c.stop_reason
    old.outputs = [by_index[i] for i in sorted(by_index)]
    old.finished = new.finished
    old.metrics = new.metrics or old.metrics
    old.num_cached_tokens = max(old.num_cached_tokens, new.num_cached_tokens)
    if old.prompt_logprobs is None:
        old.prompt_logprobs = new.prompt_logprobs
    return old


class RequestOutputCollector:
    """One pending item at most: the latest output (merged for DELTA) or an exception."""

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.delta = output_kind == RequestOutputKind.DELTA
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        current = self._item
        if current is None or isinstance(item, BaseException) or isinstance(current, BaseException):
            if not isinstance(current, BaseException):
                self._item = item
        elif self.delta:
            self._item = merge_delta(current, item)
        else:
            self._item = item
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next output; raises the exception put in its place."""
        await self._ready.wait()
        item, self._item = self._item, None
        self._ready.clear()
        if isinstance(item, BaseException):
            self._item = item  # stays failed for any later get()
            self._ready.set()
            raise item
        assert item is not None
        return item


__all__ = ["RequestOutputCollector", "merge_delta", "CompletionOutput"]

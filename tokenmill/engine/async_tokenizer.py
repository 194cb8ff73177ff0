"""AsyncTokenizer: tokenizes prompts off the server's event loop, in micro-batches.

The Rust tokenizer's single ``encode`` holds the GIL for the whole call (~5 ms for a
2k-token prompt): a burst of long prompts on the event loop stalls every stream for
hundreds of milliseconds. ``encode_batch`` releases the GIL and encodes in parallel, so
prompts that arrive together are encoded as one batch in a worker thread while the event
loop keeps streaming.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from transformers import PreTrainedTokenizerBase

from tokenmill.engine.input_processor import InvalidRequestError
from tokenmill.tokenizer import encode_prompt, get_backend_tokenizer


class AsyncTokenizer:
    """``await encode(text)`` gives the same ids as ``tokenizer.encode(text)``.

    Args:
        tokenizer: a transformers fast tokenizer (slow ones are encoded one by one in the
            worker thread).
        max_batch: most prompts encoded in one ``encode_batch`` call.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_batch: int = 256) -> None:
        self.tokenizer = tokenizer
        backend = get_backend_tokenizer(tokenizer)
        self._backend = None if getattr(tokenizer, "split_special_tokens", False) else backend
        self.max_batch = max_batch
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-tokenizer")
        self._pending: list[tuple[str, bool, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((text, add_special_tokens, future))
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            for special in (True, False):
                group = [(t, f) for t, s, f in batch if s == special]
                if not group:
                    continue
                texts = [t for t, _ in group]
                try:
                    ids = await loop.run_in_executor(self._executor, self._encode, texts, special)
                except Exception:
                    # One bad text (e.g. a lone surrogate) fails the whole batch call: encode
                    # one by one so that only its own request gets the error.
                    await self._encode_each(group, special)
                    continue
                for (_, future), row in zip(group, ids, strict=True):
                    if not future.done():
                        future.set_result(row)

    async def _encode_each(
        self, group: list[tuple[str, asyncio.Future[list[int]]]], special: bool
    ) -> None:
        loop = asyncio.get_running_loop()
        for text, future in group:
            try:
                [row] = await loop.run_in_executor(self._executor, self._encode, [text], special)
            except Exception as e:
                if not future.done():
                    future.set_exception(
                        InvalidRequestError(f"the prompt could not be tokenized: {e}")
                    )
                continue
            if not future.done():
                future.set_result(row)

    def _encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        if self._backend is None:
            return [encode_prompt(self.tokenizer, t, add_special_tokens) for t in texts]
        encodings = self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

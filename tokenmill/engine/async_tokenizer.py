"""AsyncTokenizer: tokenizes prompts off the server's event loop, in parallel.

The Rust tokenizer's single ``encode`` holds the GIL for the whole call (~4 ms for a
2k-token prompt): a burst of long prompts on the event loop would stall every stream.
``encode_batch`` releases the GIL, so each prompt is encoded as a batch of one in a small
thread pool: prompts that arrive together are encoded side by side, and none waits for the
others of its burst (a single batch call would hold every prompt until the last is done).

Chat templates are rendered on the same threads (``render``), after a bound on the
conversation's size: Jinja rendering holds the GIL, but from a worker thread it yields the
event loop its turns, where on the loop 600,000 short messages froze every stream for 13 s.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from transformers import PreTrainedTokenizerBase

from tokenmill.engine.input_processor import InvalidRequestError
from tokenmill.tokenizer import encode_prompt, get_backend_tokenizer


def default_num_workers() -> int:
    """Tokenizer threads: one per core, between 2 and 8."""
    return max(2, min(8, os.cpu_count() or 1))


def max_prompt_chars(tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> int:
    """Characters past which a text cannot fit ``max_model_len`` tokens: twice the context
    times the longest token's string (a byte-level BPE or SentencePiece token covers at most
    that many characters of text; the factor 2 leaves room for normalizers that shrink
    text). Tokenizing costs ~1.5 us per character, so without this bound a 20M-character
    prompt held a tokenizer thread for 30 s before its error."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return 2 * max(1, longest) * max_model_len


class AsyncTokenizer:
    """``await encode(text)`` gives the same ids as ``tokenizer.encode(text)``.

    Args:
        tokenizer: a transformers tokenizer; a fast one is encoded through its Rust backend
            (GIL released), a slow one (or one that splits special tokens) by transformers.
        num_workers: threads encoding at once (default: ``default_num_workers()``).
        max_model_len: the model's context (tokens); texts longer than
            ``max_prompt_chars`` are rejected without tokenizing them. None: no bound.

    Raises (from ``encode``):
        InvalidRequestError: the text cannot be tokenized (e.g. a lone surrogate), or is
            too long for the context.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        num_workers: int | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_chars = (
            None if max_model_len is None else max_prompt_chars(tokenizer, max_model_len)
        )
        backend = get_backend_tokenizer(tokenizer)
        self._backend = None if getattr(tokenizer, "split_special_tokens", False) else backend
        self._executor = ThreadPoolExecutor(
            num_workers or default_num_workers(), thread_name_prefix="tokenmill-tokenizer"
        )

    async def encode(
        self, text: str, add_special_tokens: bool = True, param: str | None = None
    ) -> list[int]:
        """The token ids of ``text``; ``param`` names the request field it came from, for
        the error of a text that cannot be tokenized."""
        self._check_chars(len(text), f"the prompt is {len(text):,} characters long", param)
        loop = asyncio.get_running_loop()
        encode = self._encode
        try:
            return await loop.run_in_executor(self._executor, encode, text, add_special_tokens)
        except TypeError:  # the Rust tokenizer's wording for text that is not valid Unicode
            raise InvalidRequestError(
                "the prompt could not be tokenized: it holds text that is not valid Unicode "
                "(a lone surrogate)",
                param,
            ) from None
        except Exception as e:  # any text the tokenizer rejects is the request's error
            raise InvalidRequestError(f"the prompt could not be tokenized: {e}", param) from None

    async def render(
        self, render: Callable[[], str], num_messages: int, num_chars: int, param: str
    ) -> str:
        """``render()`` (a chat template's rendering of a conversation of ``num_messages``
        messages whose contents hold ``num_chars`` characters) on the tokenizer threads.

        Raises:
            InvalidRequestError: the conversation cannot fit the context, checked before it
                is rendered: more messages than the context has tokens (a template renders
                each message as at least its role's marker), or more characters than
                ``max_prompt_chars``. Whatever ``render`` raises, as it raised it.
        """
        if self.max_model_len is not None and num_messages > self.max_model_len:
            raise InvalidRequestError(
                f"the conversation has {num_messages:,} messages: more than this model's "
                f"context of {self.max_model_len:,} tokens can hold",
                param,
            )
        self._check_chars(num_chars, f"the messages hold {num_chars:,} characters", param)
        return await asyncio.get_running_loop().run_in_executor(self._executor, render)

    def _check_chars(self, num_chars: int, what: str, param: str | None) -> None:
        """Refuse ``num_chars`` characters past ``max_chars``; ``what`` says whose they are."""
        if self.max_chars is not None and num_chars > self.max_chars:
            raise InvalidRequestError(
                f"{what}: more than any text of {self.max_model_len:,} tokens (this model's "
                "context) can be",
                param,
            )

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._backend is None:
            return encode_prompt(self.tokenizer, text, add_special_tokens)
        [encoding] = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

"""Incremental detokenization of one output sequence, with stop strings.

Text is produced with ``tokenizers.decoders.DecodeStream`` (Rust): it decodes a short sliding
window of token ids and emits only the part after the window's previous text, and it holds a
token back while the text would end in U+FFFD — a multi-byte UTF-8 character split across
byte-level BPE or byte-fallback tokens is emitted whole, once complete. The stream starts from
the last few prompt tokens, so the first generated token decodes as it does after the prompt
(a SentencePiece word-start space is kept, nothing is stripped as if it began a text).

Guarantee (leaving aside stop strings and a final stop token, see ``update``): the
concatenation of all increments equals ``decode(context + output)`` with ``decode(context)``
removed, where ``context`` is the last ``CONTEXT_TOKENS`` prompt tokens. For byte-level BPE
tokenizers (GPT-2 style: SmolLM2, Llama 3, Qwen) that is exactly
``tokenizer.decode(output_ids, skip_special_tokens=...)`` for any token ids, U+FFFD of bytes
left incomplete at the end included (they are flushed when the sequence finishes). The one
exception: a byte-fallback decoder (SentencePiece models) turns a run of byte tokens that is
not valid UTF-8 into one U+FFFD per token, bytes already streamed as characters included; a
stream cannot take text back, so those characters stay and decoding goes on after them (no
token's text is lost).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import decode_with_context, get_backend_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Prompt tokens the decoder sees before the output: enough for any decoder's start-of-text
# rules (a SentencePiece space, a Strip) to be spent on the prompt.
CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of one sequence, built token by token; finds stop strings in it.

    Args:
        tokenizer: a transformers fast tokenizer.
        prompt_token_ids: the prompt (its last tokens are decoding context).
        params: the sequence's sampling parameters (stop strings, skip_special_tokens,
            include_stop_str_in_output, min_tokens, detokenize).

    Attributes:
        token_ids: every output token id so far (stop tokens included).
        output_text: the text so far (cut at a matched stop string).
        stop_buffer_length: characters held back from unfinished outputs, so that the
            start of a stop string never reaches a stream before it is known to be one.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.output_text = ""
        self.detokenize = params.detokenize
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        longest = max((len(s) for s in self.stop), default=0)
        self.stop_buffer_length = 0 if self.include_stop_str_in_output else max(longest - 1, 0)
        self.stopped = False
        self._stop_end = 0  # where the matched stop string ended in the text
        self._sent_text_offset = 0
        self._num_fed = 0  # output tokens given to the decoder
        self._num_pending = 0  # of those, tokens whose text the decoder still holds
        self._context: list[int] = []
        self._stream: DecodeStream | None = None
        if self.detokenize:
            self._init_stream(prompt_token_ids)

    def _init_stream(self, prompt_token_ids: list[int]) -> None:
        backend = get_backend_tokenizer(self.tokenizer)
        if backend is None:
            raise TypeError("IncrementalDetokenizer needs a fast (tokenizers-backed) tokenizer")
        self._backend = backend
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        if context and backend.decode(
            context, skip_special_tokens=self.skip_special_tokens
        ).endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a multi-byte character: its missing bytes would come
            # out of the first generated tokens and make the context text change.
            context = []
        self._context = context
        self._stream = DecodeStream(ids=context, skip_special_tokens=self.skip_special_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def update(
        self, new_token_ids: list[int], stop_terminated: bool, finished: bool = False
    ) -> str | None:
        """Add new tokens to the text and look for stop strings.

        Args:
            new_token_ids: tokens generated since the last call.
            stop_terminated: the last token is EOS or a stop token id; it is kept in
                ``token_ids`` but its text is left out unless include_stop_str_in_output
                (a special token leaves no text anyway when special tokens are skipped).
            finished: the sequence ends with these tokens (for any reason); bytes the
                decoder still holds are flushed.

        Returns:
            The matched stop string, or None. On a match the text is cut before it (after
            it with include_stop_str_in_output) and the sequence must be finished; of
            several new tokens (speculative decoding), those after the one whose text
            completed the match are dropped, as one-at-a-time decoding would never have
            generated them. Only stop strings ending in text of tokens past the first
            ``min_tokens`` count.
        """
        if self.stopped:
            return None
        first_index = len(self.token_ids)
        self.token_ids.extend(new_token_ids)
        if not self.detokenize:
            return None
        to_decode = new_token_ids
        if stop_terminated and not self.include_stop_str_in_output and to_decode:
            to_decode = to_decode[:-1]
        check_from = len(self.output_text)
        text_ends = []  # the text's length after each new token
        for i, token_id in enumerate(to_decode):
            self.output_text += self._decode_next(token_id)
            text_ends.append(len(self.output_text))
            if first_index + i < self.min_tokens:
                check_from = len(self.output_text)
        if (finished or stop_terminated) and self._num_pending:
            self.output_text += self._flush()
        if not self.stop:
            return None
        stop = self._check_stop(check_from)
        if stop is not None and len(new_token_ids) > 1:
            keep = next((i for i, end in enumerate(text_ends) if end >= self._stop_end), None)
            if keep is not None:
                del self.token_ids[first_index + keep + 1 :]
        return stop

    def _decode_next(self, token_id: int) -> str:
        assert self._stream is not None
        self._num_fed += 1
        try:
            chunk = self._stream.step(self._backend, token_id)
        except Exception as e:  # tokenizers raises when the decoder rewrote earlier text
            logger.debug("restarting DecodeStream: %s", e)
            self._num_pending += 1
            return self._restart_stream()
        if chunk is None:
            self._num_pending += 1
            return ""
        self._num_pending = 0
        return chunk

    def _pending_ids(self) -> list[int]:
        """Fed tokens whose text the decoder still holds."""
        return self.token_ids[self._num_fed - self._num_pending : self._num_fed]

    def _emitted_tail(self) -> list[int]:
        """The last ``CONTEXT_TOKENS`` tokens (prompt context included) whose text is out."""
        emitted = self._context + self.token_ids[: self._num_fed - self._num_pending]
        return emitted[-CONTEXT_TOKENS:]

    def _restart_stream(self) -> str:
        """Decode the held tokens with a fresh stream after the old one failed.

        The stream fails when a decoder changes text it already produced: a byte-fallback
        run turning invalid shows one U+FFFD per byte token, earlier bytes included. Text
        already emitted stays as it was; the held tokens are decoded after the last
        emitted ones (or on their own), so no token's text is lost.
        """
        pending = self._pending_ids()
        skip = self.skip_special_tokens
        for context in (self._emitted_tail(), []):
            if context and self._backend.decode(context, skip_special_tokens=skip).endswith(
                _REPLACEMENT_CHAR
            ):
                continue
            stream = DecodeStream(ids=context, skip_special_tokens=skip)
            try:
                chunks = [stream.step(self._backend, t) for t in pending]
            except Exception:  # the decoder rewrites text within these tokens too
                continue
            self._stream = stream
            emitted = [i for i, chunk in enumerate(chunks) if chunk is not None]
            self._num_pending = len(pending) - 1 - emitted[-1] if emitted else len(pending)
            return "".join(chunk for chunk in chunks if chunk)
        self._stream = DecodeStream(ids=[], skip_special_tokens=skip)
        self._num_pending = 0
        return self._backend.decode(pending, skip_special_tokens=skip)

    def _flush(self) -> str:
        """The text of the held tokens, incomplete characters included (as U+FFFD).

        Decodes the whole output once (O(output length), only at the end of a sequence
        that ends inside a character), so that the U+FFFD count matches a full decode;
        if the decoder rewrote earlier text, decodes the held tokens after the emitted ones.
        """
        pending = self._pending_ids()
        self._num_pending = 0
        skip = self.skip_special_tokens
        fed = self.token_ids[: self._num_fed]
        text = decode_with_context(self.tokenizer, self._context, fed, skip)
        if text is not None and text.startswith(self.output_text):
            return text[len(self.output_text) :]
        text = decode_with_context(self.tokenizer, self._emitted_tail(), pending, skip)
        if text is None:
            text = self._backend.decode(pending, skip_special_tokens=skip)
        return text

    def _check_stop(self, check_from: int) -> str | None:
        """Find the first stop string that ends after ``check_from`` and cut the text there.

        The match that ends first wins (the point where the text first contained a stop
        string); of matches ending at the same character, the longest.
        """
        text = self.output_text
        if len(text) <= check_from:
            return None
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stop:
            # A match must end in the new text: start no earlier than len(stop) - 1
            # characters before it.
            start = text.find(stop, max(check_from - len(stop) + 1, 0))
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        if best is None:
            return None
        end, start, stop = best
        self._stop_end = end
        self.output_text = text[:end] if self.include_stop_str_in_output else text[:start]
        self.stopped = True
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to put in the next output.

        Args:
            finished: the sequence has finished (everything is released).
            delta: return only text not returned by an earlier delta call.

        Returns:
            The cumulative text, or the new text since the last delta call. While not
            finished, the last ``stop_buffer_length`` characters are held back.
        """
        if not self.detokenize:
            return ""
        end = len(self.output_text)
        if not finished and self.stop_buffer_length:
            end = max(end - self.stop_buffer_length, 0)
        if not delta:
            return self.output_text[:end]
        start = self._sent_text_offset
        if end <= start:
            return ""
        self._sent_text_offset = end
        return self.output_text[start:end]

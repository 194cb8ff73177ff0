"""Logprobs as the OpenAI API writes them: clamped to JSON-safe values, the raw bytes of
single tokens (chat's ``bytes`` field), and vLLM's per-position ``prompt_logprobs``."""

from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from tokenmill.outputs import Logprob
from tokenmill.tokenizer import get_backend_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# JSON has no -inf or NaN: logprobs are clamped to this finite floor (as vLLM does).
MIN_LOGPROB = -9999.0


def clamp_logprob(value: float) -> float:
    """A JSON-safe logprob: -inf and NaN become MIN_LOGPROB (JSON has neither), as does
    anything below it; +inf becomes ``-MIN_LOGPROB``. Positive values stay: the logits
    modes of ``--logprobs-mode`` return unnormalised logits."""
    if math.isnan(value):
        return MIN_LOGPROB
    return min(max(value, MIN_LOGPROB), -MIN_LOGPROB)


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """Inverse of the byte -> printable character table of byte-level BPE.

    GPT-2's byte-level BPE (Radford et al. 2019, ``bytes_to_unicode`` in its encoder.py)
    keeps the 188 printable Latin-1 bytes as themselves and shifts the other 68 bytes, in
    order, to code points 256 and up, so every byte has a visible character.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_FALLBACK_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenBytes:
    """The raw UTF-8 bytes of single tokens (the ``bytes`` field of chat logprobs).

    A token may hold part of a multi-byte character, so its text alone cannot give its
    bytes: byte-level BPE vocabularies and SentencePiece byte-fallback tokens (``<0xE2>``)
    are mapped back to bytes; other tokens use the UTF-8 encoding of their text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        backend = get_backend_tokenizer(tokenizer)
        self._backend = backend
        decoder = getattr(backend, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        # Added tokens (e.g. <|im_end|>) are stored as their text, not byte-level encoded.
        added = getattr(backend, "get_added_tokens_decoder", None)
        self._added_ids = set(added()) if added is not None else set()
        self._cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int, text: str) -> list[int]:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        result = self._lookup(token_id, text)
        if len(self._cache) < 1 << 18:
            self._cache[token_id] = result
        return result

    def _lookup(self, token_id: int, text: str) -> list[int]:
        if token_id in self._added_ids or self._backend is None:
            return list(text.encode("utf-8"))
        piece = self._backend.id_to_token(token_id)
        if piece is not None:
            if self._byte_level:
                table = _byte_level_decoder()
                if all(c in table for c in piece):
                    return [table[c] for c in piece]
            match = _BYTE_FALLBACK_RE.match(piece)
            if match:
                return [int(match.group(1), 16)]
        return list(text.encode("utf-8"))


def top_ranked(entry: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The ``num_top`` most likely ``(token id, Logprob)`` of a position's entry, rank
    order (the chosen token appears only if it ranks among them)."""
    return sorted(
        (item for item in entry.items() if item[1].rank is not None and item[1].rank <= num_top),
        key=lambda item: item[1].rank or 0,
    )[:num_top]


def token_label(token_id: int, text: str, as_ids: bool) -> str:
    """How a token appears in logprobs: its text, or ``"token_id:<id>"`` for clients that
    asked for ids (vLLM's ``return_tokens_as_token_ids``; a token that is not valid text on
    its own is then still identifiable)."""
    return f"token_id:{token_id}" if as_ids else text


def per_prompt_position(
    prompt_ids: list[int], prompt_logprobs: list[dict[int, Logprob] | None] | None
) -> list[dict[int, Logprob] | None]:
    """The engine's prompt logprobs with one entry per prompt token: the first token has
    none, and a one-token prompt gets none at all."""
    entries = list(prompt_logprobs or [])
    return [None] * (len(prompt_ids) - len(entries)) + entries


def prompt_logprobs_json(
    prompt_ids: list[int], prompt_logprobs: list[dict[int, Logprob] | None] | None
) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` field: per prompt position, ``{token id: {"logprob",
    "rank", "decoded_token"}}`` for the prompt's token and the top alternatives, None where
    there is no logprob (see ``per_prompt_position``). Logprobs are clamped to finite
    values."""
    entries = per_prompt_position(prompt_ids, prompt_logprobs)
    return [
        None
        if entry is None
        else {
            token_id: {
                "logprob": clamp_logprob(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]

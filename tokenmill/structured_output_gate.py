"""A constraint that starts after a reasoning section: thinking models write free text up
to a marker (``</think>``), and structured outputs (a JSON schema, a forced tool call)
apply to the answer after it.

``AfterReasoningGrammar`` wraps a request's grammar (``grammar_runtime.RequestGrammar``,
compiled on the request's arrival like any other, so a constraint that does not compile is
refused at once). Until the output has produced the marker's token ids it allows every
token: its mask is all ones, known without a mask worker, and the grammar's matchers (the
engine's and the mask worker's copy) see none of these tokens. From the token after the
marker on it is the wrapped grammar from its start: the compile's first mask, then masks
filled by a mask worker told only the tokens accepted after the marker
(``core/grammar_masks.py``), within the same time bounds.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class AfterReasoningGrammar:
    """A grammar that applies once the output contains ``end_ids``.

    It has what the engine and the mask filler use of ``RequestGrammar``:
    ``take_first_mask``, ``accepted``, ``text``, ``accept``, ``is_complete``, ``fail`` and
    ``failure``.

    Args:
        grammar: the request's grammar (a ``RequestGrammar``), at its start.
        end_ids: the token ids that end the reasoning (non-empty).
        vocab_size: logit columns.

    Attributes:
        reasoning_ended: whether the output has produced ``end_ids``.
    """

    def __init__(self, grammar: Any, end_ids: list[int], vocab_size: int) -> None:
        self._grammar = grammar
        self._end_ids = list(end_ids)
        self._recent: list[int] = []
        self.reasoning_ended = False
        # Every token allowed: int32 words with all 32 bits set.
        self._all_tokens = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)

    @property
    def text(self) -> str:
        """The wrapped grammar, compiled and serialized (a mask worker's copy is built from it)."""
        return self._grammar.text

    @property
    def accepted(self) -> list[int]:
        """The tokens the wrapped grammar accepted: those after the marker, in order."""
        return self._grammar.accepted

    @property
    def failure(self) -> str | None:
        return self._grammar.failure

    def fail(self, reason: str) -> None:
        """Give the grammar up: its request finishes aborted with ``reason``."""
        self._grammar.fail(reason)

    def take_first_mask(self) -> np.ndarray | None:
        """The next mask if it is known without a mask worker, else None.

        Returns:
            ``[ceil(V / 32)]`` int32: every token while the reasoning runs; after it, the
            wrapped grammar's first mask (once, from its compile), then None.
        """
        if not self.reasoning_ended:
            return self._all_tokens.copy()
        return self._grammar.take_first_mask()

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token: a reasoning token is always accepted (the one that
        completes the marker ends the reasoning); after it, the wrapped grammar decides.
        False once the grammar was given up."""
        if self.reasoning_ended:
            return self._grammar.accept(token_id)
        if self.failure is not None:
            return False
        self._recent.append(token_id)
        del self._recent[: -len(self._end_ids)]
        self.reasoning_ended = self._recent == self._end_ids
        return True

    @property
    def is_complete(self) -> bool:
        """True once the answer is a whole sentence of the grammar and it was ended."""
        return self.reasoning_ended and self._grammar.is_complete

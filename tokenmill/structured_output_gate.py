"""A constraint that starts after a reasoning section: thinking models write free text up
to a marker (``</think>``), and structured outputs (a JSON schema, a forced tool call)
apply to the answer after it.

``AfterReasoningGrammar`` wraps a request's grammar: until the output has produced the
marker's token ids it allows every token and watches the sampled ones; from the token after
the marker on it is the wrapped grammar, from that grammar's start.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class AfterReasoningGrammar:
    """A grammar that applies once the output contains ``end_ids``.

    It has the methods and attributes of ``structured_output.RequestGrammar`` that the
    engine uses (``token_bitmask``, ``accept``, ``is_complete``, ``fail``, ``failure``).

    Args:
        grammar: the request's grammar (a ``RequestGrammar``), at its start.
        end_ids: the token ids that end the reasoning (non-empty).
        vocab_size: logit columns.
    """

    def __init__(self, grammar: Any, end_ids: list[int], vocab_size: int) -> None:
        self._grammar = grammar
        self._end_ids = list(end_ids)
        self._recent: list[int] = []
        self.reasoning_ended = False
        # Every token allowed: int32 words with all 32 bits set.
        self._all_tokens = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)

    @property
    def failure(self) -> str | None:
        return self._grammar.failure

    def fail(self, reason: str) -> None:
        self._grammar.fail(reason)

    def token_bitmask(self) -> np.ndarray:
        """``[ceil(V / 32)]`` int32: every token while reasoning, then the grammar's mask."""
        if not self.reasoning_ended:
            return self._all_tokens.copy()
        return self._grammar.token_bitmask()

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token: a reasoning token is always accepted (the one that
        completes the marker ends the reasoning); after it, the grammar decides."""
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

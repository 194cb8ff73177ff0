"""Responses kept in memory for ``previous_response_id`` and GET /v1/responses/{id}.

The store is bounded twice: by the number of responses (``--max-stored-responses``) and by
the characters their conversations hold in all (``MAX_STORED_CHARS``); past either bound the
oldest responses are dropped (a follow-up naming one gets a 404). Nothing is written to
disk: a restart forgets them all.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# Characters of stored conversations and responses, in all (~4 bytes each at most).
MAX_STORED_CHARS = 64 << 20


@dataclass
class StoredResponse:
    """A response and the conversation that follows from it.

    Attributes:
        response: the response object as sent.
        messages: the chat messages up to and including its output (instructions aside),
            which a request naming it as ``previous_response_id`` continues.
        chars: the size counted against the store's bound.
    """

    response: dict[str, Any]
    messages: list[dict[str, Any]]
    chars: int = 0


class ResponseStore:
    """An LRU map of response id -> StoredResponse.

    Args:
        max_responses: the most responses kept (0 keeps none).
        max_chars: the most characters kept in all.
    """

    def __init__(self, max_responses: int, max_chars: int = MAX_STORED_CHARS) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep a response (the oldest go once a bound is passed; one larger than the whole
        bound is not kept)."""
        stored.chars = len(json.dumps(stored.response)) + len(json.dumps(stored.messages))
        if self.max_responses <= 0 or stored.chars > self.max_chars:
            return
        with self._lock:
            old = self._items.pop(response_id, None)
            if old is not None:
                self._chars -= old.chars
            self._items[response_id] = stored
            self._chars += stored.chars
            while len(self._items) > self.max_responses or self._chars > self.max_chars:
                _, dropped = self._items.popitem(last=False)
                self._chars -= dropped.chars

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            stored = self._items.pop(response_id, None)
            if stored is None:
                return False
            self._chars -= stored.chars
            return True

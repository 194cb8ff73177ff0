"""The scheduler's waiting queue, under one of two policies.

``fcfs``: arrival order, with preempted requests put back at the front (they were admitted
before anything still waiting). ``priority``: a heap ordered by ``(priority,
arrival_time)``, lower first; a preempted request goes back into the heap under its
original key, so it again comes before everything that arrived later with the same
priority.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from tokenmill.core.request import Request


class RequestQueue(ABC):
    """Waiting requests in the order they should be admitted."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a newly arrived request."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Queue a preempted request ahead of requests that arrived after it."""

    @abstractmethod
    def peek_request(self) -> Request:
        """The next request to admit (raises IndexError when empty)."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Remove and return the next request to admit (raises IndexError when empty)."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Remove the given requests (those not queued are ignored); O(len(queue))."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The queued requests, in admission order."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """First come, first served: a deque."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek_request(self) -> Request:
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        ids = {r.request_id for r in requests}
        self._queue = deque(r for r in self._queue if r.request_id not in ids)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Lowest ``(priority, arrival_time)`` first: a binary heap (``heapq``).

    Ties on both keys go to the request queued first.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add_request(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, entry)

    def prepend_request(self, request: Request) -> None:
        # The heap key already puts it ahead of everything that arrived later.
        self.add_request(request)

    def peek_request(self) -> Request:
        return self._heap[0][3]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        ids = {r.request_id for r in requests}
        self._heap = [e for e in self._heap if e[3].request_id not in ids]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue for ``policy`` (``fcfs`` or ``priority``).

    Raises:
        ValueError: unknown policy.
    """
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; expected 'fcfs' or 'priority'")
